"""A real vLLM 0.33 engine on CPU, minus the neural network.

What it owns: building vLLM's own ``Scheduler`` (the class the engine core
uses) from a tiny local hybrid model config (no hub access), the KV-cache
plan vLLM computes for it (``get_kv_cache_configs``), and per-rank KV tensors
allocated by vLLM's own ``allocate_kv_cache`` on the CPU. The connector under
test is loaded by vLLM's ``KVConnectorFactory`` from
``kv_connector_module_path``, once in the scheduler (by ``Scheduler`` itself)
and once per worker rank. Each step, every rank runs the connector hooks in
the V2 model runner's order (``vllm/v1/worker/gpu/kv_connector.py``) around a
deterministic toy forward, and rank outputs are merged by vLLM's
``KVOutputAggregator``.

The toy model (:class:`ToyModel`) is a real recurrent model over the KV cache:
the recurrent state of a request is *read from its Mamba block* (the block
``cdiv(n, block_size) - 1`` of the Mamba group, as vLLM's align mode keeps
it) and extended token by token; attention rows are written per position and
every row is verified when a token is sampled. So a restore that brings back
a wrong or missing page either raises :class:`CorruptCache` or changes the
generated tokens, which tests compare with :meth:`ToyModel.reference`.

What it must never do: reach into the connector's internals to make a test
pass, or bypass vLLM's scheduler to move a request along.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    group_kernel_blocks,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

VOCAB = 1000
EOS = VOCAB - 1
NUM_LAYERS = 4  # linear, full, linear, full (Qwen3-Next pattern)


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class CorruptCache(AssertionError):
    """The toy model read KV-cache bytes that are not what it wrote for these
    tokens: a restore brought back a wrong page."""


# --------------------------------------------------------------------------- the toy model


def _h(*parts: bytes) -> bytes:
    d = hashlib.sha256()
    for p in parts:
        d.update(len(p).to_bytes(4, "little"))
        d.update(p)
    return d.digest()


def _expand(seed: bytes, n: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(seed + counter.to_bytes(4, "little")).digest()
        counter += 1
    return bytes(out[:n])


class ToyModel:
    """Pure functions of the tokens: the prefix digest chain, what each layer
    writes, and the next token.

    ``D[0]`` is fixed and ``D[t+1] = H(D[t], token t)``. The recurrent state
    after ``n`` tokens stores ``D[n]`` in its first 32 bytes; the rest (and
    every attention row) is an expansion that depends on the layer and the
    rank, so a page restored to the wrong layer, rank or position is caught.
    """

    ZERO = bytes(32)

    @staticmethod
    def step(digest: bytes, token: int) -> bytes:
        """``D[t+1]`` from ``D[t]`` and token ``t``."""
        return _h(b"chain", digest, int(token).to_bytes(4, "little"))

    @classmethod
    def digest(cls, tokens: Sequence[int]) -> bytes:
        """``D[len(tokens)]``."""
        d = cls.ZERO
        for t in tokens:
            d = cls.step(d, t)
        return d

    @staticmethod
    def state(layer: str, rank: int, digest: bytes, size: int) -> bytes:
        """The recurrent state bytes of ``layer`` on ``rank`` after the prefix ``digest``."""
        return digest + _expand(_h(b"ssm", layer.encode(), bytes([rank]), digest), size - 32)

    @staticmethod
    def row(layer: str, rank: int, digest: bytes, size: int) -> bytes:
        """The attention row of ``layer`` on ``rank`` for the position whose prefix
        (including the position's own token) has ``digest``."""
        return _expand(_h(b"attn", layer.encode(), bytes([rank]), digest), size)

    @staticmethod
    def next_token(digest: bytes) -> int:
        """The token sampled after the prefix ``digest`` (never EOS)."""
        return 1 + int.from_bytes(_h(b"tok", digest)[:4], "little") % (VOCAB - 2)

    @classmethod
    def reference(cls, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """What a cold run generates for ``prompt`` (no cache involved)."""
        tokens = list(prompt)
        out: list[int] = []
        d = cls.digest(tokens)
        for _ in range(max_tokens):
            t = cls.next_token(d)
            out.append(t)
            d = cls.step(d, t)
        return out


# --------------------------------------------------------------------------- vLLM config


MODEL_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "layer_types": ["linear_attention", "full_attention"] * (NUM_LAYERS // 2),
    "full_attention_interval": 2,
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 1,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 0,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts_per_tok": 1,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
    "eos_token_id": EOS,
    "bos_token_id": 1,
    "tie_word_embeddings": False,
}


def write_model_dir(root: Path) -> Path:
    """A local model directory holding only ``config.json`` (no weights, no hub)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return root


@dataclass
class EngineSpec:
    """What one engine replica looks like."""

    model_dir: Path
    extra_config: dict[str, Any]
    world_size: int = 1
    block_size: int = 16
    num_blocks: int = 128
    max_model_len: int = 512
    max_num_batched_tokens: int = 256
    layout: str = "LBNHC"
    kernel_block_size: int | None = None
    """Attention kernel blocks smaller than vLLM's block (``kernel_block_sizes``):
    each block's KV view rows are several evenly strided kernel blocks."""
    async_scheduling: bool = False
    """vLLM's default engine loop: step k+1 is scheduled before step k's output
    is processed (``AsyncScheduler`` with a batch queue of two)."""
    retention_interval: int | None = 0
    """vLLM's ``--prefix-cache-retention-interval``: which Mamba boundary states
    it keeps (0: only semantic ones, N: also every N tokens, None: every block)."""
    connector: bool = True
    log_stats: bool = False
    """vLLM's statistics (``--disable-log-stats`` off): every step's
    ``SchedulerStats`` is kept in :attr:`Engine.scheduler_stats`."""
    failure_policy: str = "recompute"
    kv_events_endpoint: str | None = None
    """vLLM's ``kv_events_config`` with the ZMQ publisher on this endpoint
    (None: KV events off, vLLM's default)."""
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """``KVTransferConfig.engine_id``: one per engine, the same in the scheduler
    and every rank (vLLM copies one config into each)."""


def layer_specs(block_size: int) -> dict[str, Any]:
    """Per-layer KV-cache specs of the toy hybrid model, as a model runner's
    ``get_kv_cache_spec`` reports them (Mamba pages padded to the attention
    page size, as vLLM's hybrid config does)."""
    attn = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32
    )
    page = attn.page_size_bytes
    specs: dict[str, Any] = {}
    for i in range(NUM_LAYERS):
        if i % 2 == 0:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=block_size,
                shapes=((3, 64), (2, 16, 16)),
                dtypes=(torch.float32, torch.float32),
                page_size_padded=page,
                mamba_cache_mode="align",
            )
        else:
            specs[f"model.layers.{i}.self_attn"] = attn
    return specs


def make_vllm_config(spec: EngineSpec, rank: int = 0) -> VllmConfig:
    """vLLM's own config objects for one rank of the toy engine on CPU."""
    model = ModelConfig(
        model=str(spec.model_dir),
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=spec.max_model_len,
    )
    cache = CacheConfig(
        block_size=spec.block_size,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        num_gpu_blocks_override=spec.num_blocks,
        prefix_cache_retention_interval=spec.retention_interval,
    )
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=spec.async_scheduling,
    )
    kv = None
    if spec.connector:
        kv = KVTransferConfig(
            kv_connector="LMCacheRecurrentCheckpointConnector",
            kv_connector_module_path="lmcache_rc.connector",
            kv_role="kv_both",
            kv_load_failure_policy=spec.failure_policy,
            kv_connector_extra_config=dict(spec.extra_config),
            engine_id=spec.engine_id,
        )
    parallel = ParallelConfig(tensor_parallel_size=1)
    events = None
    if spec.kv_events_endpoint is not None:
        events = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec.kv_events_endpoint
        )
    config = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        device_config=DeviceConfig("cpu"),
        parallel_config=parallel,
        kv_transfer_config=kv,
        kv_events_config=events,
    )
    # vLLM's CPU platform reports no hybrid-allocator support; the scheduler
    # and the KV plan are platform-independent, so switch it on as a GPU would.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    # One worker per rank of a TP group: the connector reads both fields.
    config.parallel_config.world_size = spec.world_size
    config.parallel_config.tensor_parallel_size = spec.world_size
    config.parallel_config.rank = rank
    return config


@dataclass
class KVPlan:
    """The KV-cache plan vLLM computes for the toy model."""

    worker: KVCacheConfig
    scheduler: KVCacheConfig
    layout: Any
    block_size: int
    hash_block_size: int


def plan_kv_cache(config: VllmConfig, spec: EngineSpec) -> KVPlan:
    """``EngineCore._initialize_kv_caches`` for the toy model, on vLLM's functions."""
    specs = layer_specs(spec.block_size)
    layout = resolve_kv_cache_layout(config, [[spec.layout]], list(specs.values()))
    groups = get_global_kv_cache_groups(config, [specs])
    memory = spec.num_blocks * 64 * 1024
    configs = get_kv_cache_configs(config, [specs], [memory], groups)
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, config)
    alignment = resolve_cache_hit_alignment_tokens(
        scheduler_config, config, block_size, hash_block_size
    )
    for c in (*configs, scheduler_config):
        c.hash_block_size = hash_block_size
        c.cache_hit_alignment_tokens = alignment
        c.kv_cache_layout = config.cache_config.kv_cache_layout
    return KVPlan(configs[0], scheduler_config, layout, block_size, hash_block_size)


# --------------------------------------------------------------------------- worker ranks


@dataclass
class _WorkerRequest:
    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int = 0
    prompt_len: int = 0


class FaultyCopy(RuntimeError):
    """Raised into a worker connector's copy path by a test."""


@dataclass
class RankStats:
    """What one rank did (for assertions)."""

    steps: int = 0
    rows_verified: int = 0
    states_read: int = 0
    prompt_computed: dict[str, int] = field(default_factory=dict)
    """Per request: prompt positions this rank's model computed (the rest
    came from a cache: vLLM's local prefix cache or a restore)."""


class ToyWorker:
    """One worker rank: KV tensors allocated by vLLM, the connector built by
    vLLM's factory (role WORKER), and the toy forward.

    ``step`` follows ``ActiveKVConnector`` (vLLM's V2 model runner): bind
    metadata, start sync loads, forward, ``finish_forward``, start async
    loads, ``wait_for_save``, ``get_transfer_results``,
    ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``,
    ``clear_connector_metadata``.
    """

    def __init__(self, spec: EngineSpec, plan: KVPlan, rank: int) -> None:
        self.rank = rank
        self.spec = spec
        self.config = make_vllm_config(spec, rank)
        self.config.cache_config.kv_cache_layout = plan.layout.name
        self.kv_config = copy.deepcopy(plan.worker)
        self.block_size = plan.block_size
        groups = self.kv_config.kv_cache_groups
        kernel = None
        if spec.kernel_block_size is not None:
            kernel = [
                int(g.kv_cache_spec.block_size)
                if isinstance(g.kv_cache_spec, MambaSpec)
                else spec.kernel_block_size
                for g in groups
            ]
        self.kv_caches = allocate_kv_cache(
            self.kv_config, torch.device("cpu"), plan.layout, kernel_block_sizes=kernel
        )
        # The toy model addresses vLLM blocks (kernel blocks grouped back).
        self._views = {
            name: group_kernel_blocks(view, self.kv_config.num_blocks)
            for name, view in self.kv_caches.items()
        }
        self.mamba_groups = [
            g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, MambaSpec)
        ]
        self.attn_groups = [g for g in range(len(groups)) if g not in self.mamba_groups]
        self.group_layers = [list(grp.layer_names) for grp in groups]
        self.requests: dict[str, _WorkerRequest] = {}
        self.stats = RankStats()
        self.connector: Any = None
        if spec.connector:
            self.connector = KVConnectorFactory.create_connector(
                self.config, KVConnectorRole.WORKER, self.kv_config
            )
            self.connector.register_kv_caches(self.kv_caches)

    # ------------------------------------------------------------------ bytes

    def _state_view(self, layer: str, block: int) -> torch.Tensor:
        return self._views[layer][block].reshape(-1).view(torch.uint8)

    def _row(self, layer: str, block: int, slot: int) -> torch.Tensor:
        view = self._views[layer]
        if view.dim() == 5:  # [B, kernel blocks per block, H, N, C]
            tokens = int(view.shape[3])
            return view[block, slot // tokens, :, slot % tokens, :]
        return view[block, :, slot, :]

    def _write_row(self, layer: str, block: int, slot: int, data: bytes) -> None:
        view = self._row(layer, block, slot)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(view.dtype)
        view.copy_(src.reshape(view.shape))

    def _read_row(self, layer: str, block: int, slot: int) -> bytes:
        view = self._row(layer, block, slot)
        return view.contiguous().view(torch.uint8).numpy().tobytes()

    def _row_bytes(self, layer: str) -> int:
        row = self._row(layer, 0, 0)
        return int(row.numel() * row.element_size())

    def _state_bytes(self, layer: str) -> int:
        spec = self.kv_config.kv_cache_groups[self.mamba_groups[0]].kv_cache_spec
        return int(spec.real_page_size_bytes)

    # ------------------------------------------------------------------ forward

    def _forward(self, rid: str, start: int, count: int) -> int | None:
        req = self.requests[rid]
        bs = self.block_size
        end = start + count
        # the recurrent state at `start`, read from the Mamba group's block
        if start == 0:
            digest = ToyModel.ZERO
        else:
            digest = b""
            for g in self.mamba_groups:
                block = req.block_ids[g][cdiv(start, bs) - 1]
                for layer in self.group_layers[g]:
                    data = bytes(self._state_view(layer, block)[: self._state_bytes(layer)].numpy())
                    d = data[:32]
                    if data != ToyModel.state(layer, self.rank, d, len(data)):
                        raise CorruptCache(
                            f"rank {self.rank} request {rid}: recurrent state of {layer} at "
                            f"{start} tokens (block {block}) is not a state this model wrote"
                        )
                    if digest and d != digest:
                        raise CorruptCache(
                            f"rank {self.rank} request {rid}: recurrent layers disagree at {start}"
                        )
                    digest = d
                    self.stats.states_read += 1
        if start < req.prompt_len:
            done = self.stats.prompt_computed.get(rid, 0)
            self.stats.prompt_computed[rid] = done + min(end, req.prompt_len) - start
        # extend token by token, writing attention rows
        for t in range(start, end):
            digest = ToyModel.step(digest, req.tokens[t])
            for g in self.attn_groups:
                block = req.block_ids[g][t // bs]
                for layer in self.group_layers[g]:
                    self._write_row(
                        layer,
                        block,
                        t % bs,
                        ToyModel.row(layer, self.rank, digest, self._row_bytes(layer)),
                    )
        for g in self.mamba_groups:
            block = req.block_ids[g][cdiv(end, bs) - 1]
            for layer in self.group_layers[g]:
                state = ToyModel.state(layer, self.rank, digest, self._state_bytes(layer))
                view = self._state_view(layer, block)
                view[: len(state)] = torch.frombuffer(bytearray(state), dtype=torch.uint8)
        req.num_computed = end
        if end < len(req.tokens):
            return None  # a prefill chunk: nothing to sample yet
        self._verify_attention(rid, end)
        token = ToyModel.next_token(digest)
        req.tokens.append(token)
        return token

    def _verify_attention(self, rid: str, n: int) -> None:
        """Every attention row of the first ``n`` positions is what this model
        writes for them (rows restored by the connector included)."""
        req = self.requests[rid]
        bs = self.block_size
        digest = ToyModel.ZERO
        for t in range(n):
            digest = ToyModel.step(digest, req.tokens[t])
            for g in self.attn_groups:
                block = req.block_ids[g][t // bs]
                for layer in self.group_layers[g]:
                    want = ToyModel.row(layer, self.rank, digest, self._row_bytes(layer))
                    if self._read_row(layer, block, t % bs) != want:
                        raise CorruptCache(
                            f"rank {self.rank} request {rid}: attention row {t} of {layer} "
                            f"(block {block}) is wrong"
                        )
                    self.stats.rows_verified += 1

    # ------------------------------------------------------------------ one step

    def _apply(self, out: Any) -> None:
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        for new in out.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            # a request resumed after preemption arrives as new, with every token so far
            known = getattr(new, "prefill_token_ids", None)
            self.requests[new.req_id] = _WorkerRequest(
                tokens=list(known) if known else list(prompt),
                block_ids=[list(b) for b in new.block_ids],
                num_computed=new.num_computed_tokens,
                prompt_len=len(prompt),
            )
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req = self.requests[rid]
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                req.block_ids = [list(b) for b in (new_ids or ())]
                tokens = cached.all_token_ids.get(rid)
                if tokens is not None:
                    req.tokens = list(tokens)
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    req.block_ids[g].extend(ids)
            req.num_computed = cached.num_computed_tokens[i]

    def step(self, out: Any) -> ModelRunnerOutput:
        """Run one scheduler output on this rank."""
        self.stats.steps += 1
        self._apply(out)
        c = self.connector
        if c is not None:
            meta = out.kv_connector_metadata
            c.handle_preemptions(meta)
            c.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                c.start_load_kv(None, scheduler_output=out)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, count in out.num_scheduled_tokens.items():
            token = self._forward(rid, self.requests[rid].num_computed, count)
            req_ids.append(rid)
            sampled.append([] if token is None else [token])
        kv_out = None
        if c is not None:
            c.finish_forward()
            if not out.has_sync_kv_loads:
                c.start_load_kv(None, scheduler_output=out)
            c.wait_for_save()
            results = c.get_transfer_results(out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                kv_connector_stats=c.get_kv_connector_stats(),
                kv_connector_worker_meta=c.build_connector_worker_meta(),
            )
            c.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def inject_fault(self, kind: str, count: int = 1, delay: float = 0.0) -> None:
        """The rank connector's documented fault hook."""
        self.connector.inject_fault(kind, count, delay)

    def in_flight(self) -> int:
        """Copies queued or running on this rank."""
        side = None if self.connector is None else self.connector.worker_side
        return 0 if side is None else int(side.in_flight())

    def shutdown(self) -> None:
        """The worker connector's shutdown (drains copies)."""
        if self.connector is not None:
            self.connector.shutdown()


# --------------------------------------------------------------------------- the engine


@dataclass
class Finished:
    """One request's end: generated tokens and how its prompt was served."""

    request_id: str
    prompt: list[int]
    output: list[int]
    local_hit_tokens: int = 0
    external_hit_tokens: int = 0


class Engine:
    """One replica: vLLM's scheduler plus ``world_size`` toy worker ranks
    (threads of this process; see :mod:`tests_vllm.procs` for processes)."""

    def __init__(self, spec: EngineSpec, ranks: Sequence[Any] | None = None) -> None:
        self.spec = spec
        self.config = make_vllm_config(spec, 0)
        self.plan = plan_kv_cache(self.config, spec)
        init_none_hash(get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo))
        self.hasher = get_request_block_hasher(
            self.plan.hash_block_size,
            get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo),
            self.config.num_hash_lookahead_tokens,
        )
        self.ranks: list[Any] = (
            list(ranks)
            if ranks is not None
            else [ToyWorker(spec, self.plan, r) for r in range(spec.world_size)]
        )
        scheduler_cls = self.config.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(
            vllm_config=self.config,
            kv_cache_config=self.plan.scheduler,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=self.plan.block_size,
            hash_block_size=self.plan.hash_block_size,
            log_stats=spec.log_stats,
        )
        self.connector = self.scheduler.connector
        self.scheduler_stats: list[Any] = []
        self.aggregator = (
            KVOutputAggregator.from_connector(self.connector, spec.world_size)
            if self.connector is not None and spec.world_size > 1
            else None
        )
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Finished] = {}
        self.closed = False
        self._prompts: dict[str, list[int]] = {}
        self.steps = 0
        self.before_step: list[Callable[[Engine], None]] = []
        self._queue: deque[tuple[Any, Any]] = deque()

    # ------------------------------------------------------------------ requests

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> Request:
        """Submit a request: ``max_tokens`` are generated, fewer when the model
        samples one of ``stop_token_ids`` (a stop the scheduler cannot foresee,
        like EOS in a chat)."""
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0.0,
            stop_token_ids=list(stop_token_ids),
        )
        params.update_from_generation_config({}, EOS)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=self.hasher,
        )
        self._prompts[request_id] = list(prompt)
        self.outputs[request_id] = []
        self.scheduler.add_request(req)
        return req

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests the way the engine core does."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ stepping

    def _execute(self, out: Any) -> Any:
        results = [rank.step(out) for rank in self.ranks]
        if self.aggregator is not None:
            return self.aggregator.aggregate(results, 0)
        return results[0]

    def _update(self, out: Any, merged: Any) -> None:
        engine_outputs = self.scheduler.update_from_output(out, merged)
        for outs in engine_outputs.values():
            if outs.scheduler_stats is not None:
                self.scheduler_stats.append(outs.scheduler_stats)
            for o in outs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = Finished(
                        o.request_id,
                        self._prompts[o.request_id],
                        list(self.outputs[o.request_id]),
                    )

    def step(self) -> Any:
        """One engine step: schedule, run every rank, aggregate, update. With
        async scheduling it follows ``EngineCore.step_with_batch_queue``: a new
        batch is scheduled (and run) while the previous one's output is not yet
        processed; outputs are processed one step late."""
        for hook in list(self.before_step):
            hook(self)
        self.steps += 1
        if not self.spec.async_scheduling:
            out = self.scheduler.schedule()
            self._update(out, self._execute(out))
            return out
        out = None
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            self._queue.appendleft((out, self._execute(out)))
            if len(self._queue) < 2 and (
                out.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()
            ):
                return out
        elif not self._queue:
            return None
        old, merged = self._queue.pop()
        self._update(old, merged)
        return out if out is not None else old

    def prompt_from_cache(self, request_id: str) -> int:
        """Prompt tokens of ``request_id`` that rank 0 did not compute (served by
        vLLM's local prefix cache or restored through the connector)."""
        computed = self.ranks[0].stats.prompt_computed.get(request_id, 0)
        return len(self._prompts[request_id]) - computed

    def busy(self) -> bool:
        """Whether the engine core would keep stepping (``has_requests``, or a
        batch whose output is not processed yet)."""
        return bool(self.scheduler.has_requests()) or bool(self._queue)

    def run(self, timeout: float = 120.0) -> None:
        """Step until idle, as the engine core loop does (it keeps stepping while
        requests or connector work remain); idle steps sleep a millisecond."""
        deadline = time.monotonic() + timeout
        while self.busy():
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout} s")
            out = self.step()
            if out is None or not out.total_num_scheduled_tokens:
                time.sleep(0.001)

    def step_until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Step until ``done()`` holds; AssertionError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout} s")
            out = self.step()
            if out is None or not out.total_num_scheduled_tokens:
                time.sleep(0.001)

    def generate(
        self, request_id: str, prompt: Sequence[int], max_tokens: int, **kw: Any
    ) -> list[int]:
        """Submit one request and run until the engine is idle."""
        self.add(request_id, prompt, max_tokens, **kw)
        self.run()
        return self.finished[request_id].output

    # ------------------------------------------------------------------ state

    def free_blocks(self) -> int:
        """Free blocks in vLLM's block pool."""
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def total_blocks(self) -> int:
        """Blocks in the pool minus the null block."""
        return int(self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1

    def shutdown(self) -> None:
        """Shut the scheduler connector and every rank down (as vLLM's engine
        core does: the workers first). Once is enough; later calls do nothing."""
        if self.closed:
            return
        self.closed = True
        for rank in self.ranks:
            rank.shutdown()
        self.scheduler.shutdown()


# --------------------------------------------------------------------------- ranks as processes


def _rank_main(conn: Any, spec: EngineSpec, plan: KVPlan, rank: int) -> None:
    """A worker rank in its own process: builds its :class:`ToyWorker` and
    answers ``(method, args)`` calls until told to stop."""
    try:
        worker = ToyWorker(spec, plan, rank)
    except BaseException as e:  # report start-up failures to the parent
        conn.send(("error", repr(e)))
        return
    conn.send(("ready", None))
    while True:
        method, args = conn.recv()
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            if method == "step":
                result: Any = worker.step(*args)
            elif method == "inject_fault":
                result = worker.connector.inject_fault(*args)
            elif method == "stats":
                result = worker.stats
            elif method == "in_flight":
                side = worker.connector.worker_side
                result = 0 if side is None else side.in_flight()
            elif method == "shutdown":
                result = worker.shutdown()
            else:
                raise ValueError(f"unknown call {method}")
            conn.send(("ok", result))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class ProcessRank:
    """A :class:`ToyWorker` in a spawned process (as vLLM's multiprocess
    executor runs ranks): scheduler outputs and model-runner outputs cross
    the process boundary pickled, like vLLM's own."""

    def __init__(self, spec: EngineSpec, plan: KVPlan, rank: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_rank_main, args=(child, spec, plan, rank), daemon=True)
        self._proc.start()
        status, detail = self._conn.recv()
        if status != "ready":
            raise RuntimeError(f"rank {rank} failed to start: {detail}")
        self.rank = rank

    def _call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"rank {self.rank} {method}: {result}")
        return result

    def step(self, out: Any) -> ModelRunnerOutput:
        """One scheduler output on the remote rank."""
        result: ModelRunnerOutput = self._call("step", out)
        return result

    def inject_fault(self, kind: str, count: int = 1, delay: float = 0.0) -> None:
        """The rank connector's fault hook."""
        self._call("inject_fault", kind, count, delay)

    @property
    def stats(self) -> RankStats:
        """The remote rank's counters."""
        stats: RankStats = self._call("stats")
        return stats

    def in_flight(self) -> int:
        """Copies queued or running on the remote rank."""
        return int(self._call("in_flight"))

    def shutdown(self) -> None:
        """Shut the rank's connector down and end the process."""
        if not self._proc.is_alive():
            return
        try:
            self._call("shutdown")
            self._call("stop")
        finally:
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()


def process_engine(spec: EngineSpec) -> Engine:
    """An :class:`Engine` whose ranks are processes."""
    config = make_vllm_config(spec, 0)
    plan = plan_kv_cache(config, spec)
    ranks = [ProcessRank(spec, plan, r) for r in range(spec.world_size)]
    return Engine(spec, ranks=ranks)
