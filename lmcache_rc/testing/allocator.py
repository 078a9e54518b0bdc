"""The simulated vLLM allocator: block pool, boundary-checkpoint cache, KV cache manager.

What it owns: a CPU re-implementation of the scheduler-side objects a
boundary-checkpoint connector calls (``docs/design/vllm-boundary-api.md`` §2.3, §2.4,
§2.6 and the allocator item of §4): a block pool with the null block 0,
reference counts and an LRU queue of free-but-cached blocks whose reuse
invalidates the checkpoints depending on them; :class:`BoundaryCheckpointCache`
with staged/published/discarded/invalidated bundles and exact-prefix lookup; and
:class:`SimKVCacheManager` (the legacy #709 allocator) plus
:class:`SimAdmissionKVCacheManager` (the newer one with restore-admission
reservations, detected by ``reserve_admission`` in the signature).

Why: the connector is only as correct as the allocator contract it is tested
against; tests of this module pin that contract without a connector.

What it must never do: touch page bytes (that is the ranks' job) or talk to the
sidecar.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_rc.testing.toy_model import HybridGeometry, cdiv
from lmcache_rc.vllm.api import CHECKPOINT_KINDS

__all__ = [
    "BlockPool",
    "BoundaryCheckpoint",
    "BoundaryCheckpointCache",
    "CapturePlan",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "SimAdmissionKVCacheManager",
    "SimKVCacheBlocks",
    "SimKVCacheManager",
    "SimRequest",
    "build_kv_cache_config",
]

NULL_BLOCK_ID = 0


# ============================================================================ requests


_arrival = itertools.count()


@dataclass(eq=False)
class SimRequest:
    """The fields of ``vllm.v1.request.Request`` the allocator and connector read.

    See docs/design/vllm-boundary-api.md §2.3 (its last paragraph).

    ``max_new_tokens`` stops generation (the toy model has no EOS);
    ``instruction_boundary`` (if set) makes the engine end a prefill chunk there
    and publish an ``instruction`` checkpoint, like vLLM's
    ``recurrent_instruction_boundary``.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int = 8
    cache_salt: str | None = None
    lora_request: Any | None = None
    mm_features: Any | None = None
    skip_reading_prefix_cache: bool = False
    supports_boundary: bool = True
    instruction_boundary: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    boundary_checkpoint: BoundaryCheckpoint | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    sampling_params: Any = None
    prompt_embeds: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt plus generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """``len(all_token_ids)``."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)


# ============================================================================ block pool


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block (page) of the shared pool."""

    block_id: int
    ref_cnt: int = 0


class FreeKVCacheBlockQueue:
    """LRU queue of free blocks: allocation takes the head, frees append at the tail."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._q

    @property
    def num_free_blocks(self) -> int:
        """Number of free blocks."""
        return len(self._q)

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        _, block = self._q.popitem(last=False)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the queue (it is being referenced again)."""
        del self._q[block.block_id]

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (most recently freed)."""
        self._q[block.block_id] = block

    def move_to_front(self, block_id: int) -> None:
        """Test helper: make ``block_id`` the next block to be evicted."""
        self._q.move_to_end(block_id, last=False)

    def get_all_free_block_ids(self) -> list[int]:
        """Free block ids, head first."""
        return list(self._q)


class BlockPool:
    """Blocks ``0..num_blocks-1``; block 0 is the null block and is never handed out.

    ``on_evict(block_id)`` is called when a free block is reused, before it is
    handed out: the eviction hook that invalidates cached checkpoints.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.on_evict = on_evict
        self.evictions = 0

    def get_num_free_blocks(self) -> int:
        """Free blocks, including free-but-cached ones."""
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a positive reference count (the null block excluded)."""
        return self.num_blocks - 1 - len(self.free_block_queue)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue (ref count 1 each).

        A block some cached checkpoint depends on is evicted first (``on_evict``).
        """
        if num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"cannot get {num_blocks} free blocks, only {len(self.free_block_queue)} left"
            )
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if self.on_evict is not None:
                self.evictions += 1
                self.on_evict(block.block_id)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (taking free ones out of the queue)."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue tail."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def touch_ids(self, ids: Iterable[int]) -> None:
        """:meth:`touch` by block id."""
        self.touch(self.blocks[i] for i in ids)

    def free_ids(self, ids: Iterable[int]) -> None:
        """:meth:`free_blocks` by block id."""
        self.free_blocks(self.blocks[i] for i in ids)


# ============================================================================ checkpoints


@dataclass(frozen=True)
class BoundaryCheckpoint:
    """``vllm.v1.core.boundary_checkpoint.BoundaryCheckpoint``.

    See docs/design/vllm-boundary-api.md §2.4.
    """

    checkpoint_id: int
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    auxiliary_block_ids: tuple[int, ...]
    draft_prefix_len: int
    kind: str

    @property
    def dependencies(self) -> frozenset[int]:
        """Every non-zero id in ``block_ids`` and ``auxiliary_block_ids``."""
        ids = {b for group in self.block_ids for b in group if b != NULL_BLOCK_ID}
        ids.update(b for b in self.auxiliary_block_ids if b != NULL_BLOCK_ID)
        return frozenset(ids)

    def wire_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Copy-task form: per group the non-zero ids in position order, auxiliary last."""
        groups = [tuple(b for b in g if b != NULL_BLOCK_ID) for g in self.block_ids]
        groups.append(tuple(self.auxiliary_block_ids))
        return tuple(groups)


_Key = tuple[Any, Any]  # (salt / lora key, token tuple)


@dataclass
class _Entry:
    checkpoint: BoundaryCheckpoint
    key: _Key


@dataclass
class _Pending:
    checkpoint: BoundaryCheckpoint
    key: _Key
    num_ranks: int
    acks: set[int] = field(default_factory=set)
    invalidated: bool = False


def _request_key(request: Any) -> Any:
    lora = getattr(request, "lora_request", None)
    return (getattr(request, "cache_salt", None) or "", repr(lora) if lora is not None else None)


class BoundaryCheckpointCache:
    """``manager.boundary_checkpoints``: staged → published | discarded; published → invalidated.

    Tests peek at ``_entries`` (published, by id) and ``_pending`` (staged, by id).
    Published bundles hold no pins: their pages are free-but-cached unless someone
    (a request, a store copy, an admission owner) references them.
    """

    def __init__(self, block_pool: BlockPool, num_groups: int) -> None:
        self.block_pool = block_pool
        self.num_groups = num_groups
        self._entries: dict[int, _Entry] = {}
        self._pending: dict[int, _Pending] = {}
        self._block_index: dict[int, set[int]] = {}
        self._ids = itertools.count(1)
        self._used_ids: set[int] = set()
        self.stats = {"published": 0, "discarded": 0, "invalidated": 0, "deduplicated": 0}

    # ---------------------------------------------------------------- queries
    @staticmethod
    def supports_request(request: Any) -> bool:
        """Whether boundary checkpoints apply to ``request`` (prompt ids, no embeds, ...)."""
        if not getattr(request, "prompt_token_ids", None):
            return False
        if getattr(request, "prompt_embeds", None) is not None:
            return False
        return bool(getattr(request, "supports_boundary", True))

    def __len__(self) -> int:
        return len(self._entries)

    def next_id(self) -> int:
        """A fresh checkpoint id (monotonic from 1)."""
        return next(self._ids)

    def is_pending(self, checkpoint_id: int) -> bool:
        """Whether ``checkpoint_id`` is staged and unresolved."""
        return checkpoint_id in self._pending

    def contains_block(self, block_id: int) -> bool:
        """Whether a published bundle depends on ``block_id``."""
        return block_id in self._block_index

    def get(self, checkpoint_id: int) -> BoundaryCheckpoint | None:
        """The published checkpoint ``checkpoint_id`` (sim helper)."""
        entry = self._entries.get(checkpoint_id)
        return entry.checkpoint if entry else None

    def find(self, request: Any, max_length: int) -> BoundaryCheckpoint | None:
        """Longest published checkpoint whose exact token prefix is a prefix of ``request``."""
        if not self.supports_request(request) or getattr(
            request, "skip_reading_prefix_cache", False
        ):
            return None
        limit = min(max_length, request.num_tokens)
        tokens = request.all_token_ids
        salt = _request_key(request)
        best: BoundaryCheckpoint | None = None
        for entry in self._entries.values():
            ckpt = entry.checkpoint
            if entry.key[0] != salt or ckpt.num_tokens > limit:
                continue
            if best is not None and ckpt.num_tokens <= best.num_tokens:
                continue
            if tuple(tokens[: ckpt.num_tokens]) == entry.key[1]:
                best = ckpt
        return best

    # ---------------------------------------------------------------- pins
    def acquire(self, checkpoint_id: int) -> BoundaryCheckpoint | None:
        """Pin every dependency (+1 ref) of a published checkpoint; None if not published."""
        entry = self._entries.get(checkpoint_id)
        if entry is None:
            return None
        self.block_pool.touch_ids(sorted(entry.checkpoint.dependencies))
        return entry.checkpoint

    def release(self, checkpoint: BoundaryCheckpoint) -> None:
        """Undo one :meth:`acquire` (or a stage pin)."""
        self.block_pool.free_ids(sorted(checkpoint.dependencies, reverse=True))

    # ---------------------------------------------------------------- lifecycle
    def stage(self, request: Any, checkpoint: BoundaryCheckpoint, num_ranks: int) -> None:
        """Validate and record a pending bundle, pinning every dependency."""
        cid = checkpoint.checkpoint_id
        if cid in self._used_ids:
            raise ValueError(f"boundary checkpoint id {cid} was already used")
        if num_ranks < 1:
            raise ValueError("num_ranks must be at least 1")
        if checkpoint.kind not in CHECKPOINT_KINDS:
            raise ValueError(f"unknown boundary checkpoint kind {checkpoint.kind!r}")
        if not 0 < checkpoint.num_tokens <= request.num_tokens:
            raise ValueError("checkpoint num_tokens outside (0, request.num_tokens]")
        if len(checkpoint.block_ids) != self.num_groups:
            raise ValueError("checkpoint block_ids must have one tuple per KV cache group")
        if len(checkpoint.auxiliary_block_ids) != 1:
            raise ValueError("a checkpoint has exactly one auxiliary page")
        deps = checkpoint.dependencies
        nonzero = [b for g in checkpoint.block_ids for b in g if b != NULL_BLOCK_ID]
        nonzero += [b for b in checkpoint.auxiliary_block_ids if b != NULL_BLOCK_ID]
        if not deps or len(nonzero) != len(deps):
            raise ValueError("checkpoint dependencies must be non-empty and distinct")
        for b in deps:
            if not 0 < b < self.block_pool.num_blocks or self.block_pool.blocks[b].ref_cnt <= 0:
                raise ValueError(f"checkpoint depends on unowned block {b}")
        self._used_ids.add(cid)
        self.block_pool.touch_ids(sorted(deps))
        key: _Key = (_request_key(request), tuple(request.all_token_ids[: checkpoint.num_tokens]))
        self._pending[cid] = _Pending(checkpoint, key, num_ranks)

    def acknowledge(self, checkpoint_id: int, rank: int) -> bool:
        """Record ``rank``; True only on the call that publishes (all ranks, not invalidated)."""
        pending = self._pending.get(checkpoint_id)
        if pending is None:
            return False
        if not 0 <= rank < pending.num_ranks:
            raise ValueError(f"rank {rank} outside [0, {pending.num_ranks})")
        pending.acks.add(rank)
        if len(pending.acks) < pending.num_ranks:
            return False
        del self._pending[checkpoint_id]
        ckpt = pending.checkpoint
        if pending.invalidated:
            self.stats["discarded"] += 1
            self.release(ckpt)
            return False
        for other_id, entry in list(self._entries.items()):
            if entry.key == pending.key:
                self.stats["deduplicated"] += 1
                self.invalidate(other_id)
        self._entries[checkpoint_id] = _Entry(ckpt, pending.key)
        for b in ckpt.dependencies:
            self._block_index.setdefault(b, set()).add(checkpoint_id)
        self.stats["published"] += 1
        self.release(ckpt)
        return True

    def discard(self, checkpoint_id: int) -> None:
        """Release a pending bundle (no-op for unknown or published ids)."""
        pending = self._pending.pop(checkpoint_id, None)
        if pending is not None:
            self.stats["discarded"] += 1
            self.release(pending.checkpoint)

    def invalidate(self, checkpoint_id: int) -> None:
        """Drop one published bundle as a whole."""
        entry = self._entries.pop(checkpoint_id, None)
        if entry is None:
            return
        self.stats["invalidated"] += 1
        for b in entry.checkpoint.dependencies:
            ids = self._block_index.get(b)
            if ids is not None:
                ids.discard(checkpoint_id)
                if not ids:
                    del self._block_index[b]

    def invalidate_block(self, block_id: int) -> None:
        """Eviction hook: drop published bundles using ``block_id``; mark pending ones."""
        for cid in sorted(self._block_index.get(block_id, ())):
            self.invalidate(cid)
        for pending in self._pending.values():
            if block_id in pending.checkpoint.dependencies:
                pending.invalidated = True

    def clear(self) -> None:
        """Drop every published entry; RuntimeError while anything is pending."""
        if self._pending:
            raise RuntimeError("cannot clear boundary checkpoints while bundles are pending")
        for cid in list(self._entries):
            self.invalidate(cid)


# ============================================================================ manager


@dataclass
class SimKVCacheBlocks:
    """``KVCacheBlocks`` stand-in: block ids per KV group."""

    block_ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per KV group."""
        return self.block_ids


@dataclass
class SingleTypeManager:
    """``coordinator.single_type_managers[g]``: scheduler-side page width of group g."""

    block_size: int
    kv_cache_spec: Any = None


@dataclass
class Coordinator:
    """``manager.coordinator`` stand-in."""

    single_type_managers: list[SingleTypeManager]


@dataclass
class KVCacheGroupSpec:
    """``kv_cache_config.kv_cache_groups[g]``."""

    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheConfig:
    """``vllm.v1.kv_cache_interface.KVCacheConfig`` subset."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_tensors: list[Any] = field(default_factory=list)


def build_kv_cache_config(geometry: HybridGeometry, num_blocks: int) -> KVCacheConfig:
    """The ``KVCacheConfig`` of ``geometry``: one group per spec, layers ``model.layers.<g>``."""
    return KVCacheConfig(
        num_blocks,
        [KVCacheGroupSpec([f"model.layers.{g}"], s) for g, s in enumerate(geometry.groups)],
    )


@dataclass
class CapturePlan:
    """Blocks preallocated for one endpoint capture (tail/state copy per group + aux)."""

    num_tokens: int
    kind: str
    copies: dict[int, tuple[int, int]]  # group -> (source block of the request, capture block)
    auxiliary_block: int


@dataclass
class _RequestBlocks:
    tables: list[list[int]]  # attention: block per position; recurrent: [state block]
    held: list[int] = field(default_factory=list)  # one entry per reference the request holds


@dataclass
class _Admission:
    checkpoint_id: int | None = None
    owned: BoundaryCheckpoint | None = None


class SimKVCacheManager:
    """The legacy (#709) ``KVCacheManager`` boundary subset, plus the sim's request bookkeeping.

    Request block tables: an attention group has one block per logical page
    position (null where a restored sliding window starts later); a recurrent
    group has a single private state block.
    """

    def __init__(
        self,
        geometry: HybridGeometry,
        num_blocks: int,
        *,
        enable_boundary_checkpoints: bool = True,
        enable_caching: bool = True,
    ) -> None:
        self.geometry = geometry
        self.max_model_len = geometry.max_model_len
        self.enable_caching = enable_caching
        self.boundary_checkpoints: BoundaryCheckpointCache | None = None
        self.block_pool = BlockPool(num_blocks, on_evict=self._on_evict)
        if enable_boundary_checkpoints and enable_caching:
            self.boundary_checkpoints = BoundaryCheckpointCache(
                self.block_pool, len(geometry.groups)
            )
        self.coordinator = Coordinator(
            [SingleTypeManager(geometry.page_width(g), s) for g, s in enumerate(geometry.groups)]
        )
        self.kv_cache_config = build_kv_cache_config(geometry, num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self._boundary_allocations: dict[str, dict[int, CapturePlan]] = {}
        self._boundary_readers: dict[str, BoundaryCheckpoint] = {}
        self._external: dict[int, str] = {}

    # ---------------------------------------------------------------- hooks
    def _on_evict(self, block_id: int) -> None:
        if self.boundary_checkpoints is not None and self.boundary_checkpoints.contains_block(
            block_id
        ):
            self.boundary_checkpoints.invalidate_block(block_id)

    def new_step_starts(self) -> None:
        """Start of a ``schedule()`` call (admission context in the newer allocator)."""

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Caching is on and ``request`` does not skip prefix-cache reads."""
        return self.enable_caching and not getattr(request, "skip_reading_prefix_cache", False)

    def boundary_checkpoint_page_positions(self, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Logical page indices per KV group for a checkpoint of ``num_tokens``.

        See docs/design/vllm-boundary-api.md §2.3.
        """
        return self.geometry.page_positions(num_tokens)

    def request_block_tables(self, request_id: str) -> list[list[int]]:
        """Sim helper: a copy of the request's block tables."""
        return [list(t) for t in self._requests[request_id].tables]

    # ---------------------------------------------------------------- lookups
    def get_computed_blocks(self, request: Any) -> tuple[SimKVCacheBlocks, int, int]:
        """Local lookup: the longest published checkpoint that prefixes ``request``.

        Sets ``request.boundary_checkpoint``; returns (blocks, tokens, shared prefix
        boundary). Pending imports are invisible (0 tokens).
        """
        request.boundary_checkpoint = None
        empty = SimKVCacheBlocks(tuple([] for _ in self.geometry.groups))
        if self.boundary_checkpoints is None or not self.prefix_cache_lookup_enabled(request):
            return empty, 0, 0
        ckpt = self.boundary_checkpoints.find(request, request.num_tokens)
        if ckpt is None:
            return empty, 0, 0
        request.boundary_checkpoint = ckpt
        blocks = SimKVCacheBlocks(tuple(list(g) for g in ckpt.block_ids))
        return blocks, ckpt.num_tokens, ckpt.num_tokens

    # ---------------------------------------------------------------- allocation
    def _blocks_needed(self, rb: _RequestBlocks | None, upto_tokens: int) -> int:
        need = 0
        for g in range(len(self.geometry.groups)):
            have = len(rb.tables[g]) if rb is not None else 0
            if self.geometry.is_recurrent(g):
                need += 0 if have else 1
            else:
                need += max(0, cdiv(upto_tokens, self.geometry.page_width(g)) - have)
        return need

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: BoundaryCheckpoint | None = None,
    ) -> SimKVCacheBlocks | None:
        """Grow ``request``'s tables to cover ``num_computed + num_new_computed + num_new`` tokens.

        With a checkpoint hit (``new_computed_blocks``), takes a reader pin, shares
        its full attention pages and allocates private tail/state pages (the worker
        copies into them). Returns None, changing nothing, when the pool is short.
        """
        rid = request.request_id
        rb = self._requests.get(rid)
        ckpt = new_computed_blocks
        upto = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        fresh = 0
        if rb is None and ckpt is not None:
            # shared pages are taken from the checkpoint; private copies of the tail
            # and of every recurrent state come fresh.
            shared = 0
            for g in range(len(self.geometry.groups)):
                if not self.geometry.is_recurrent(g):
                    width = self.geometry.page_width(g)
                    shared = cdiv(ckpt.num_tokens, width) - 1
                    fresh += max(0, cdiv(max(upto, ckpt.num_tokens), width) - shared)
                else:
                    fresh += 1
            # the reader pin takes free-but-cached checkpoint pages out of the free queue
            fresh += sum(1 for b in ckpt.dependencies if self.block_pool.blocks[b].ref_cnt == 0)
        else:
            fresh = self._blocks_needed(rb, upto)
        if fresh > self.block_pool.get_num_free_blocks():
            return None
        if rb is None:
            rb = _RequestBlocks([[] for _ in self.geometry.groups])
            if ckpt is not None:
                assert self.boundary_checkpoints is not None
                pinned = self.boundary_checkpoints.acquire(ckpt.checkpoint_id)
                if pinned is None:
                    return None
                self._boundary_readers[rid] = pinned
                for g, ids in enumerate(ckpt.block_ids):
                    if self.geometry.is_recurrent(g):
                        continue
                    keep = list(ids[:-1])
                    self.block_pool.touch_ids(b for b in keep if b)
                    rb.held.extend(b for b in keep if b)
                    rb.tables[g] = keep
            self._requests[rid] = rb
        for g in range(len(self.geometry.groups)):
            if self.geometry.is_recurrent(g):
                want = 1
            else:
                want = cdiv(max(upto, ckpt.num_tokens if ckpt else 0), self.geometry.page_width(g))
            while len(rb.tables[g]) < want:
                (block,) = self.block_pool.get_new_blocks(1)
                rb.tables[g].append(block.block_id)
                rb.held.append(block.block_id)
        return SimKVCacheBlocks(tuple(list(t) for t in rb.tables))

    def release_reader(self, request_id: str) -> None:
        """Drop the reader pin taken at admission (after the workers copied the pages)."""
        ckpt = self._boundary_readers.pop(request_id, None)
        if ckpt is not None and self.boundary_checkpoints is not None:
            self.boundary_checkpoints.release(ckpt)

    def free(self, request: Any) -> None:
        """Release every reference ``request`` holds (blocks, reader pin, capture blocks)."""
        rid = request.request_id
        self.release_reader(rid)
        for plan in self._boundary_allocations.pop(rid, {}).values():
            self.block_pool.free_ids([*(c for _, c in plan.copies.values()), plan.auxiliary_block])
        rb = self._requests.pop(rid, None)
        if rb is not None:
            self.block_pool.free_ids(reversed(rb.held))

    # ---------------------------------------------------------------- local publication
    def plan_boundary_capture(self, request: Any, num_tokens: int, kind: str) -> CapturePlan | None:
        """Preallocate the capture pages of an endpoint reached in this step (sim helper).

        None when the cache is off, the request is unsupported, or the pool is short.
        """
        if self.boundary_checkpoints is None or not self.boundary_checkpoints.supports_request(
            request
        ):
            return None
        rb = self._requests.get(request.request_id)
        ngroups = len(self.geometry.groups)
        if rb is None or self.block_pool.get_num_free_blocks() < ngroups + 1:
            return None
        copies: dict[int, tuple[int, int]] = {}
        for g in range(ngroups):
            if self.geometry.is_recurrent(g):
                src = rb.tables[g][0]
            else:
                src = rb.tables[g][cdiv(num_tokens, self.geometry.page_width(g)) - 1]
            (dst,) = self.block_pool.get_new_blocks(1)
            copies[g] = (src, dst.block_id)
        (aux,) = self.block_pool.get_new_blocks(1)
        plan = CapturePlan(num_tokens, kind, copies, aux.block_id)
        self._boundary_allocations.setdefault(request.request_id, {})[num_tokens] = plan
        return plan

    def publish_boundary_checkpoint(
        self, request: Any, num_tokens: int, *, kind: str
    ) -> BoundaryCheckpoint | None:
        """Publish a locally captured endpoint: stage with ``num_ranks=1`` and ack rank 0."""
        cache = self.boundary_checkpoints
        plans = self._boundary_allocations.get(request.request_id, {})
        plan = plans.pop(num_tokens, None)
        if cache is None or plan is None:
            return None
        rb = self._requests[request.request_id]
        positions = self.boundary_checkpoint_page_positions(num_tokens)
        block_ids: list[tuple[int, ...]] = []
        for g, pos in enumerate(positions):
            ids = [NULL_BLOCK_ID] * (pos[-1] + 1)
            for p in pos[:-1]:
                ids[p] = rb.tables[g][p]
            ids[pos[-1]] = plan.copies[g][1]
            block_ids.append(tuple(ids))
        ckpt = BoundaryCheckpoint(
            cache.next_id(),
            num_tokens,
            tuple(block_ids),
            (plan.auxiliary_block,),
            self.geometry.draft_prefix_len(num_tokens),
            kind,
        )
        try:
            cache.stage(request, ckpt, 1)
            published = cache.acknowledge(ckpt.checkpoint_id, 0)
        finally:
            self.block_pool.free_ids([*(c for _, c in plan.copies.values()), plan.auxiliary_block])
        return ckpt if published else None

    # ---------------------------------------------------------------- external imports
    def _validate_reserve(
        self,
        request: Any,
        num_tokens: int,
        page_positions: Sequence[Sequence[int]],
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
    ) -> tuple[tuple[int, ...], ...]:
        if not 0 < num_tokens <= request.num_tokens:
            raise ValueError("num_tokens outside (0, request.num_tokens]")
        if not 0 <= draft_prefix_len <= num_tokens:
            raise ValueError("draft_prefix_len outside [0, num_tokens]")
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"unknown boundary checkpoint kind {kind!r}")
        if num_ranks < 1:
            raise ValueError("num_ranks must be at least 1")
        expected = self.boundary_checkpoint_page_positions(num_tokens)
        given = tuple(tuple(int(p) for p in g) for g in page_positions)
        if given != expected:
            raise ValueError("page_positions does not cover every live cache page")
        if sum(len(p) for p in expected) + 1 > self.block_pool.num_blocks - 1:
            raise ValueError("the restore would exceed the GPU pool")
        return expected

    def _reserve(
        self,
        request: Any,
        num_tokens: int,
        positions: tuple[tuple[int, ...], ...],
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
    ) -> BoundaryCheckpoint | None:
        cache = self.boundary_checkpoints
        if cache is None or not cache.supports_request(request):
            return None
        if not self.prefix_cache_lookup_enabled(request):
            return None
        need = sum(len(p) for p in positions) + 1
        if self.block_pool.get_num_free_blocks() < need:
            return None
        blocks = [b.block_id for b in self.block_pool.get_new_blocks(need)]
        it = iter(blocks)
        block_ids: list[tuple[int, ...]] = []
        for pos in positions:
            ids = [NULL_BLOCK_ID] * (pos[-1] + 1)
            for p in pos:
                ids[p] = next(it)
            block_ids.append(tuple(ids))
        aux = (next(it),)
        ckpt = BoundaryCheckpoint(
            cache.next_id(), num_tokens, tuple(block_ids), aux, draft_prefix_len, kind
        )
        try:
            cache.stage(request, ckpt, num_ranks)
        finally:
            self.block_pool.free_ids(reversed(blocks))
        self._external[ckpt.checkpoint_id] = request.request_id
        return ckpt

    def reserve_external_boundary_checkpoint(
        self,
        request: Any,
        num_tokens: int,
        page_positions: Sequence[Sequence[int]],
        *,
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
    ) -> BoundaryCheckpoint | None:
        """Allocate fresh pages and stage a private import for ``request``.

        See docs/design/vllm-boundary-api.md §2.3.
        """
        positions = self._validate_reserve(
            request, num_tokens, page_positions, draft_prefix_len, kind, num_ranks
        )
        return self._reserve(request, num_tokens, positions, draft_prefix_len, kind, num_ranks)

    def acknowledge_external_boundary_checkpoint(self, checkpoint_id: int, rank: int) -> bool:
        """Record ``rank``'s finished copy; True only on the call that publishes."""
        cache = self.boundary_checkpoints
        if cache is None or checkpoint_id not in self._external:
            return False
        published = cache.acknowledge(checkpoint_id, rank)
        if not cache.is_pending(checkpoint_id):
            owner = self._external.pop(checkpoint_id)
            if published:
                self._on_import_published(owner, checkpoint_id)
        return published

    def discard_external_boundary_checkpoint(self, checkpoint_id: int) -> None:
        """Release an unpublished import (every rank must have reported already)."""
        if self.boundary_checkpoints is None or checkpoint_id not in self._external:
            return
        self._external.pop(checkpoint_id)
        self.boundary_checkpoints.discard(checkpoint_id)
        self._on_import_discarded(checkpoint_id)

    def _on_import_published(self, request_id: str, checkpoint_id: int) -> None:
        """Hook for the admission allocator."""

    def _on_import_discarded(self, checkpoint_id: int) -> None:
        """Hook for the admission allocator."""

    def pending_external_checkpoints(self) -> dict[int, str]:
        """Sim helper: staged imports by checkpoint id → consumer request id."""
        return dict(self._external)

    # ---------------------------------------------------------------- maintenance
    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Explicit eviction path (invalid/failed blocks): invalidates dependents."""
        if self.boundary_checkpoints is None:
            return
        for b in block_ids:
            self.boundary_checkpoints.invalidate_block(b)

    def reset_prefix_cache(self) -> bool:
        """Clear published checkpoints; False while any page is referenced."""
        if self.block_pool.num_used_blocks > 0:
            return False
        if self.boundary_checkpoints is not None:
            self.boundary_checkpoints.clear()
        return True

    def take_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """Pending device block copies (none in the simulator)."""
        return []


class SimAdmissionKVCacheManager(SimKVCacheManager):
    """The newer allocator with restore-admission reservations [T].

    See docs/design/vllm-boundary-api.md §2.3 and §2.6 item 6 (its introduction explains [T]).

    Simplified: a reservation is a slot keyed by request id; after publication
    the consumer *owns* the restored pages (an extra pin) until it is admitted or
    releases. A capacity refusal enqueues a FIFO waiter. Credits are not modelled.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._admissions: dict[str, _Admission] = {}
        self._waiters: list[str] = []
        self._admission_context: tuple[int, int, bool] = (0, 0, True)

    def new_step_starts(self) -> None:
        """Start of a ``schedule()`` call."""
        self._admission_context = (0, 0, True)

    def reserve_external_boundary_checkpoint(
        self,
        request: Any,
        num_tokens: int,
        page_positions: Sequence[Sequence[int]],
        *,
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
        reserve_admission: bool = False,
    ) -> BoundaryCheckpoint | None:
        """As the legacy reserve; ``reserve_admission`` also reserves the consumer's slot."""
        positions = self._validate_reserve(
            request, num_tokens, page_positions, draft_prefix_len, kind, num_ranks
        )
        rid = request.request_id
        cache = self.boundary_checkpoints
        if (
            cache is None
            or not cache.supports_request(request)
            or not self.prefix_cache_lookup_enabled(request)
        ):
            return None  # not a capacity refusal: never queued as a waiter
        if reserve_admission and self._waiters and self._waiters[0] != rid:
            if rid not in self._waiters:
                self._waiters.append(rid)
            return None
        ckpt = self._reserve(request, num_tokens, positions, draft_prefix_len, kind, num_ranks)
        if reserve_admission:
            if ckpt is None:
                if rid not in self._waiters:
                    self._waiters.append(rid)
                return None
            if rid in self._waiters:
                self._waiters.remove(rid)
            old = self._admissions.get(rid)
            if old is not None and old.owned is not None and self.boundary_checkpoints is not None:
                self.boundary_checkpoints.release(old.owned)
            self._admissions[rid] = _Admission(ckpt.checkpoint_id)
        return ckpt

    def _on_import_published(self, request_id: str, checkpoint_id: int) -> None:
        adm = self._admissions.get(request_id)
        if (
            adm is not None
            and adm.checkpoint_id == checkpoint_id
            and self.boundary_checkpoints is not None
        ):
            adm.owned = self.boundary_checkpoints.acquire(checkpoint_id)

    def can_admit_external_boundary_request(self, request_id: str) -> bool:
        """False for a request that would take an earlier waiter's place."""
        if request_id in self._admissions:
            return True
        return not self._waiters or self._waiters[0] == request_id

    def external_boundary_admission_ready(self, request_id: str) -> bool:
        """Whether ``request_id`` owns a published, reserved restore."""
        adm = self._admissions.get(request_id)
        return adm is not None and adm.owned is not None

    def release_external_boundary_admission(self, request_id: str) -> None:
        """Drop slot, waiter position and ownership of a published restore (idempotent)."""
        adm = self._admissions.pop(request_id, None)
        if adm is not None and adm.owned is not None and self.boundary_checkpoints is not None:
            self.boundary_checkpoints.release(adm.owned)
        if request_id in self._waiters:
            self._waiters.remove(request_id)

    def external_boundary_reserved_blocks(self) -> int:
        """Blocks held for admission reservations (pending or owned)."""
        total = 0
        for adm in self._admissions.values():
            if adm.owned is not None:
                total += len(adm.owned.dependencies)
            elif adm.checkpoint_id is not None and self.boundary_checkpoints is not None:
                pending = self.boundary_checkpoints._pending.get(adm.checkpoint_id)
                if pending is not None:
                    total += len(pending.checkpoint.dependencies)
        return total

    def has_external_boundary_admission(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a reservation."""
        return request_id in self._admissions

    def has_pending_external_boundary_admissions(self) -> bool:
        """Whether any reservation or capacity waiter exists."""
        return bool(self._admissions or self._waiters)

    def set_external_boundary_admission_context(
        self, free_slots: int, reserved_blocks: int, has_scheduled_reqs: bool = True
    ) -> None:
        """Record the scheduler's step context (free running slots, reserved blocks)."""
        self._admission_context = (free_slots, reserved_blocks, has_scheduled_reqs)

    def external_boundary_wait_expired(self, request_id: str) -> bool:
        """Whether the bounded restore wait expired (never, in the simulator)."""
        return False

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: BoundaryCheckpoint | None = None,
    ) -> SimKVCacheBlocks | None:
        """As the legacy allocate; on admission ownership passes to the reader pin."""
        out = super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks
        )
        if out is not None and new_computed_blocks is not None:
            self.release_external_boundary_admission(request.request_id)
        return out

    def free(self, request: Any) -> None:
        """Release the request's blocks and its admission reservation."""
        super().free(request)
        self.release_external_boundary_admission(request.request_id)
