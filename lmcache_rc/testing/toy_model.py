"""A deterministic toy hybrid model: every page is a pure function of the tokens.

What it owns: the KV-cache group specs of a simulated hybrid model
(:class:`FullAttentionSpec`, :class:`SlidingWindowSpec`, :class:`MambaSpec`, named
as in vLLM so :func:`lmcache_rc.vllm.api.is_recurrent_group` classifies them), the
geometry that derives page positions from them (``docs/design/vllm-boundary-api.md`` §4,
the toy hybrid model, and §2.3), and the page contents: attention pages, recurrent state pages
and the auxiliary (draft) page are hash expansions of (rank shard, group,
position, token-prefix digest), and the next token is a hash of the recurrent
state and auxiliary bytes.

Why: because pages depend only on tokens, a restored page can be checked byte for
byte against recomputation, and a run that restores continues with exactly the
tokens a cold run produces (:meth:`ToyHybridModel.reference_generate`).

What it must never do: hold per-request state or touch a page pool.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "FullAttentionSpec",
    "HybridGeometry",
    "KVCacheSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "ToyHybridModel",
    "cdiv",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A full-attention KV group (target model); DCP-sharded when DCP > 1."""

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A sliding-window KV group (e.g. the DFlash draft); replicated across DCP ranks."""

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.sliding_window <= 0:
            raise ValueError("block_size and sliding_window must be positive")


@dataclass(frozen=True)
class MambaSpec:
    """A recurrent (Mamba/GDN/KDA) group: one state page per checkpoint, replicated across DCP."""

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec
"""Any simulated KV-cache group spec."""


@dataclass(frozen=True)
class HybridGeometry:
    """Shape of the simulated model and its parallel layout.

    ``groups`` are the KV-cache groups in engine order, all sharing one page pool
    of ``page_bytes`` per block. ``world_size = tensor_parallel_size * dcp``;
    rank ``r`` has TP rank ``r // dcp`` and DCP rank ``r % dcp``.
    ``speculative_method`` "mtp"/"eagle" makes the draft lag one token
    (``draft_prefix_len = n - 1``); anything else gives ``n``. The worker
    layout (:meth:`layout`) is derived from these fields; ``minimal_layout``
    reduces it to ``{"schema_version": 1, "page_bytes": N}`` and ``extra_layout``
    adds keys.
    """

    groups: tuple[KVCacheSpec, ...] = (FullAttentionSpec(16), MambaSpec(16))
    page_bytes: int = 256
    vocab_size: int = 1000
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    dcp: int = 1
    speculative_method: str | None = None
    hidden_size: int = 32
    dtype: str = "bfloat16"
    minimal_layout: bool = False
    extra_layout: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("at least one KV-cache group is required")
        if self.page_bytes < 16:
            raise ValueError("page_bytes must be at least 16")
        if self.tensor_parallel_size < 1 or self.dcp < 1:
            raise ValueError("parallel sizes must be positive")

    @property
    def world_size(self) -> int:
        """Number of worker ranks."""
        return self.tensor_parallel_size * self.dcp

    def page_width(self, group: int) -> int:
        """Scheduler-side tokens per page of ``group`` (B x DCP for DCP-sharded attention)."""
        spec = self.groups[group]
        if isinstance(spec, FullAttentionSpec):
            return spec.block_size * self.dcp
        return spec.block_size

    def is_recurrent(self, group: int) -> bool:
        """Whether ``group`` is a recurrent group."""
        return isinstance(self.groups[group], MambaSpec)

    def draft_prefix_len(self, num_tokens: int) -> int:
        """Draft KV coverage of a checkpoint of ``num_tokens``."""
        if self.speculative_method in ("mtp", "eagle", "eagle3"):
            return max(num_tokens - 1, 0)
        return num_tokens

    def page_positions(self, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Logical page positions per group of a checkpoint of ``num_tokens``.

        See docs/design/vllm-boundary-api.md §2.3.
        """
        if not 0 < num_tokens <= self.max_model_len:
            raise ValueError(f"num_tokens must be in (0, {self.max_model_len}], got {num_tokens}")
        out: list[tuple[int, ...]] = []
        for g, spec in enumerate(self.groups):
            width = self.page_width(g)
            count = cdiv(num_tokens, width)
            if isinstance(spec, MambaSpec):
                out.append((count - 1,))
                continue
            first = 0
            if isinstance(spec, SlidingWindowSpec):
                skipped = max(0, (num_tokens - 1) - spec.sliding_window + 1)
                first = min(skipped // width, count - 1)
            out.append(tuple(range(first, count)))
        return tuple(out)

    def layout(self) -> dict[str, Any]:
        """The address-free, capacity-free worker layout descriptor.

        See docs/design/vllm-boundary-api.md §2.5.

        ``schema_version``, ``page_bytes``, one byte view per group, the
        auxiliary fields, ``target_hidden`` and ``draft_hidden`` (MTP-style
        speculation only), packed from offset 0 of the auxiliary page; then
        ``extra_layout``. With ``minimal_layout`` only the first two keys.
        Raises ValueError when the auxiliary state does not fit one page.
        """
        desc: dict[str, Any] = {"schema_version": 1, "page_bytes": self.page_bytes}
        if not self.minimal_layout:
            hidden_bytes = self.hidden_size * 2
            aux: list[dict[str, Any]] = [
                {
                    "owner": "target",
                    "dtype": "int64",
                    "shape": [1],
                    "offset_bytes": 0,
                    "size_bytes": 8,
                },
            ]
            end = 8 + hidden_bytes
            draft: dict[str, Any] | None = None
            if self.speculative_method in ("mtp", "eagle", "eagle3"):
                aux.append(
                    {
                        "owner": "draft",
                        "dtype": "int64",
                        "shape": [1],
                        "offset_bytes": 8,
                        "size_bytes": 8,
                    }
                )
                end = 16 + hidden_bytes
                draft = {"shape": [self.hidden_size], "dtype": self.dtype, "offset_bytes": end}
                end += hidden_bytes
            if end > self.page_bytes:
                raise ValueError("auxiliary state does not fit one checkpoint page")
            desc["groups"] = [
                {
                    "layer": f"model.layers.{g}",
                    "views": [
                        {
                            "dtype": "uint8",
                            "shape": [self.page_bytes],
                            "strides_bytes": [1],
                            "offset_bytes": 0,
                            "kernel_pages_per_block": 1,
                        }
                    ],
                }
                for g in range(len(self.groups))
            ]
            desc["auxiliary_fields"] = aux
            desc["target_hidden"] = {
                "shape": [self.hidden_size],
                "dtype": self.dtype,
                "offset_bytes": int(aux[-1]["offset_bytes"]) + 8,
            }
            desc["draft_hidden"] = draft
        desc.update(self.extra_layout)
        return desc


def _digest(tokens: Sequence[int] | npt.NDArray[np.integer[Any]]) -> bytes:
    arr = np.asarray(tokens, dtype="<i8")
    return hashlib.blake2b(arr.tobytes(), digest_size=16).digest()


class ToyHybridModel:
    """Pure functions from tokens to page bytes and next tokens.

    Every page is ``page_bytes`` long. Pages of a group that is sharded on a
    rank differ between ranks (TP shards always, DCP shards for full attention);
    replicated pages are identical on the ranks that replicate them.
    """

    def __init__(self, geometry: HybridGeometry) -> None:
        self.geometry = geometry

    # ------------------------------------------------------------------ sharding
    def shard_id(self, rank: int, group: int | None) -> tuple[int, int]:
        """(TP rank, DCP rank or -1 when replicated) that distinguishes a rank's bytes."""
        g = self.geometry
        tp_rank, dcp_rank = divmod(rank, g.dcp)
        if group is not None and isinstance(g.groups[group], FullAttentionSpec):
            return tp_rank, dcp_rank
        return tp_rank, -1

    def _fill(self, tag: bytes) -> npt.NDArray[np.uint8]:
        data = hashlib.shake_256(tag).digest(self.geometry.page_bytes)
        return np.frombuffer(data, dtype=np.uint8)

    # ------------------------------------------------------------------ pages
    def attention_page(
        self, rank: int, group: int, position: int, tokens: Sequence[int]
    ) -> npt.NDArray[np.uint8]:
        """Page ``position`` of attention ``group`` once ``tokens`` (the whole prefix) were read.

        Only the tokens up to the end of that page matter, so a full page is the
        same for every longer prefix.
        """
        width = self.geometry.page_width(group)
        end = min((position + 1) * width, len(tokens))
        if end <= position * width:
            raise ValueError(f"page {position} of group {group} holds no token of the prefix")
        tp, dcp = self.shard_id(rank, group)
        tag = b"attn|%d|%d|%d|%d|%d|" % (tp, dcp, group, position, end) + _digest(tokens[:end])
        return self._fill(tag)

    def recurrent_page(self, rank: int, group: int, tokens: Sequence[int]) -> npt.NDArray[np.uint8]:
        """State page of recurrent ``group`` after reading ``tokens``."""
        tp, dcp = self.shard_id(rank, group)
        tag = b"state|%d|%d|%d|%d|" % (tp, dcp, group, len(tokens)) + _digest(tokens)
        return self._fill(tag)

    def auxiliary_page(self, rank: int, tokens: Sequence[int]) -> npt.NDArray[np.uint8]:
        """Auxiliary page (target/draft auxiliary state, hidden states) after ``tokens``."""
        tp, dcp = self.shard_id(rank, None)
        n = len(tokens)
        dpl = self.geometry.draft_prefix_len(n)
        tag = b"aux|%d|%d|%d|%d|" % (tp, dcp, n, dpl) + _digest(tokens)
        return self._fill(tag)

    def expected_checkpoint_pages(
        self, rank: int, tokens: Sequence[int]
    ) -> tuple[list[dict[int, npt.NDArray[np.uint8]]], npt.NDArray[np.uint8]]:
        """Expected pages of a checkpoint of ``tokens`` on ``rank``.

        Returns per group ``{position: bytes}`` (only the positions of
        :meth:`HybridGeometry.page_positions`) and the auxiliary page.
        """
        positions = self.geometry.page_positions(len(tokens))
        groups: list[dict[int, npt.NDArray[np.uint8]]] = []
        for g, pos in enumerate(positions):
            if self.geometry.is_recurrent(g):
                groups.append({pos[0]: self.recurrent_page(rank, g, tokens)})
            else:
                groups.append({p: self.attention_page(rank, g, p, tokens) for p in pos})
        return groups, self.auxiliary_page(rank, tokens)

    # ------------------------------------------------------------------ sampling
    def state_signature(self, rank: int, tokens: Sequence[int]) -> bytes:
        """The bytes the sampler reads: every recurrent page, else the last attention pages."""
        parts: list[bytes] = []
        for g in range(len(self.geometry.groups)):
            if self.geometry.is_recurrent(g):
                parts.append(self.recurrent_page(rank, g, tokens).tobytes())
        if not parts:
            for g in range(len(self.geometry.groups)):
                last = cdiv(len(tokens), self.geometry.page_width(g)) - 1
                parts.append(self.attention_page(rank, g, last, tokens).tobytes())
        return b"".join(parts)

    def next_token(self, state: bytes, auxiliary: bytes) -> int:
        """Greedy next token from the sampler-visible state bytes and the auxiliary bytes."""
        h = hashlib.blake2b(state + b"|" + auxiliary, digest_size=8).digest()
        return int.from_bytes(h, "little") % self.geometry.vocab_size

    def reference_generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Tokens a cold run generates for ``prompt`` (rank 0 samples, as in vLLM)."""
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt must not be empty")
        out: list[int] = []
        for _ in range(max_new_tokens):
            tok = self.next_token(
                self.state_signature(0, tokens), self.auxiliary_page(0, tokens).tobytes()
            )
            out.append(tok)
            tokens.append(tok)
        return out
