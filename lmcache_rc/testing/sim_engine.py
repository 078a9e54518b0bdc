"""``SimEngine``: a CPU simulated hybrid vLLM engine that drives a connector like vLLM does.

What it owns: the scheduler side of one engine (requests, the per-step call
order of ``docs/design/vllm-boundary-api.md`` §1.4 and the boundary hooks of §2.2, the
allocator of :mod:`lmcache_rc.testing.allocator`), N worker ranks
(:mod:`lmcache_rc.testing.ranks`, threads or processes, each with its own
WORKER-role connector and numpy page pool), rank-order aggregation of worker
metadata, endpoint capture and local publication (``instruction``, ``prompt``,
``response``), fault injection, per-request results and the idle invariant.

Why: lmcache-rc's connector is tested end to end without vLLM or a GPU: every
restored page is verified byte for byte against the toy model and every
continued generation must equal a cold run.

What it must never do: reach into the connector's private state; everything
goes through the hooks vLLM calls (fault injection wraps the copy worker the
connector builds through its documented ``worker_factory`` seam).
"""

from __future__ import annotations

import html
import json
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lmcache_rc.testing.allocator import (
    BoundaryCheckpoint,
    SimAdmissionKVCacheManager,
    SimKVCacheManager,
    SimRequest,
)
from lmcache_rc.testing.config import (
    SimKVTransferConfig,
    SimModelConfig,
    SimParallelConfig,
    SimSchedulerConfig,
    SimSpeculativeConfig,
    SimVllmConfig,
    create_connector,
    get_connector_class,
)
from lmcache_rc.testing.ranks import (
    FaultKind,
    FaultRule,
    NewRequestData,
    RankHost,
    RankOutput,
    RankRunner,
    RankSpec,
    ScheduledWork,
    StepInput,
)
from lmcache_rc.testing.toy_model import HybridGeometry, ToyHybridModel
from lmcache_rc.vllm.api import KVConnectorRole, SupportsHMA

__all__ = [
    "DEFAULT_IDENTITY",
    "EngineStats",
    "EngineStatus",
    "RequestResult",
    "SimEngine",
    "SimKVConnectorOutput",
]

DEFAULT_IDENTITY: Mapping[str, str] = {
    "target_revision": "1" * 40,
    "source_revision": "2" * 40,
    "draft_revision": "3" * 40,
}
"""A well-formed checkpoint identity (immutable-looking revisions) for tests."""

RankMode = Literal["thread", "spawn", "forkserver"]


def _table(rows: Mapping[str, Any], title: str) -> str:
    cells = "".join(
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
        f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
        for k, v in rows.items()
    )
    return f"<table><caption>{html.escape(title)}</caption>{cells}</table>"


@dataclass
class SimKVConnectorOutput:
    """``KVConnectorOutput`` aggregated across ranks in rank order.

    See docs/design/vllm-boundary-api.md §1.4 step 3.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any | None = None
    kv_cache_events: Any | None = None
    kv_connector_worker_meta: Any | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int = 0
    failed_recving: set[str] | None = None

    def is_empty(self) -> bool:
        """True when nothing at all was reported."""
        return not (
            self.finished_sending
            or self.finished_recving
            or self.kv_connector_stats
            or self.kv_cache_events
            or self.kv_connector_worker_meta
            or self.invalid_block_ids
        )


@dataclass
class RequestResult:
    """What happened to one request.

    ``restored_tokens``: tokens the connector says came from an import published
    for this request (``boundary_checkpoint_external_tokens``);
    ``local_hit_tokens``: the whole local hit (restored or published locally);
    ``recomputed_tokens``: prompt-side tokens the model computed at admission
    (``num_tokens - local_hit_tokens``).
    """

    request_id: str
    prompt_tokens: list[int]
    output_tokens: list[int] = field(default_factory=list)
    restored_tokens: int = 0
    local_hit_tokens: int = 0
    recomputed_tokens: int = 0
    finish_reason: str | None = None
    published: list[tuple[str, int]] = field(default_factory=list)
    stores_offered: int = 0
    admitted_step: int | None = None
    finished_step: int | None = None
    parked_steps: int = 0
    preemptions: int = 0

    @property
    def finished(self) -> bool:
        """Whether the request finished (length or abort)."""
        return self.finish_reason is not None

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return asdict(self)

    def _repr_html_(self) -> str:
        rows = self.as_dict()
        rows["prompt_tokens"] = f"{len(self.prompt_tokens)} tokens"
        return _table(rows, f"request {self.request_id}")


@dataclass
class EngineStats:
    """Counters of one engine since construction."""

    steps: int = 0
    connector_only_steps: int = 0
    tokens_scheduled: int = 0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    parked: int = 0
    local_publications: int = 0
    stores_offered: int = 0
    restores_verified: int = 0
    pages_verified: int = 0
    saved_logits_steps: int = 0
    preemptions: int = 0


@dataclass
class EngineStatus:
    """A snapshot for tests and notebooks (``_repr_html_``)."""

    stats: EngineStats
    waiting: list[str]
    running: list[str]
    free_blocks: int
    num_blocks: int
    published_checkpoints: int
    pending_checkpoints: int
    has_pending_push_work: bool
    ranks: list[dict[str, Any]]
    connector: dict[str, Any] | None
    sidecar: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return asdict(self)

    def _repr_html_(self) -> str:
        parts = [
            _table(
                {
                    "waiting": ", ".join(self.waiting) or "-",
                    "running": ", ".join(self.running) or "-",
                    "free blocks": f"{self.free_blocks} / {self.num_blocks - 1}",
                    "published checkpoints": self.published_checkpoints,
                    "pending checkpoints": self.pending_checkpoints,
                    "pending push work": self.has_pending_push_work,
                },
                "SimEngine",
            ),
            _table(asdict(self.stats), "engine counters"),
        ]
        for r in self.ranks:
            parts.append(_table(r, f"rank {r.get('rank')}"))
        if self.sidecar is not None:
            flat = {k: v for k, v in self.sidecar.items() if not isinstance(v, dict)}
            parts.append(_table(flat, "sidecar"))
        if self.connector is not None:
            text = json.dumps(self.connector, indent=1, default=str)
            parts.append(f"<details><summary>connector</summary><pre>{html.escape(text)}</pre>")
            parts.append("</details>")
        return "".join(parts)


class SimEngine:
    """A simulated hybrid vLLM engine with ``world_size`` worker ranks.

    ``socket_path`` is the lmcache-rc sidecar; with ``connector=None`` the engine
    runs without a KV connector (local boundary checkpoints only) and needs no
    sidecar. ``checkpoint_identity`` goes to
    ``kv_connector_extra_config["lmcache_rc.checkpoint_identity"]``;
    ``extra_config`` adds further ``lmcache_rc.*`` options.

    ``rank_mode`` "thread" hosts ranks in threads of this process; "spawn" or
    "forkserver" starts one process per rank, each building its own connector.
    ``admission_api`` selects the newer allocator with restore-admission
    reservations (False: the legacy allocator, exercising the fallback).
    ``clock`` (monotonic seconds) replaces the connector's clock when given.

    Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        socket_path: str | None,
        *,
        world_size: int = 1,
        geometry: HybridGeometry | None = None,
        num_blocks: int = 256,
        checkpoint_identity: Mapping[str, str] | None = None,
        connector: str | None = "LMCacheRecurrentCheckpointConnector",
        connector_module_path: str = "lmcache_rc.connector",
        extra_config: Mapping[str, Any] | None = None,
        rank_mode: RankMode = "thread",
        admission_api: bool = False,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        boundary_checkpoints: bool = True,
        clock: Callable[[], float] | None = None,
        idle_sleep: float = 0.0005,
    ) -> None:
        if geometry is None:
            geometry = HybridGeometry(tensor_parallel_size=world_size)
        if geometry.world_size != world_size:
            raise ValueError(
                f"geometry has {geometry.world_size} ranks (tp x dcp) but world_size={world_size}"
            )
        if connector is not None and not socket_path:
            raise ValueError("a sidecar socket_path is required with a connector")
        self.socket_path = socket_path
        self.geometry = geometry
        self.model = ToyHybridModel(geometry)
        self.world_size = world_size
        self.num_blocks = num_blocks
        self.idle_sleep = idle_sleep
        self.stats = EngineStats()
        kvt: SimKVTransferConfig | None = None
        if connector is not None:
            extra: dict[str, Any] = {
                "lmcache_rc.socket": socket_path,
                "lmcache_rc.checkpoint_identity": dict(checkpoint_identity or DEFAULT_IDENTITY),
            }
            extra.update(extra_config or {})
            kvt = SimKVTransferConfig(
                kv_connector=connector,
                kv_connector_module_path=connector_module_path,
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            )
        self.vllm_config = SimVllmConfig(
            model_config=SimModelConfig(
                max_model_len=geometry.max_model_len,
                dtype=geometry.dtype,
                hidden_size=geometry.hidden_size,
            ),
            parallel_config=SimParallelConfig(
                tensor_parallel_size=geometry.tensor_parallel_size,
                decode_context_parallel_size=geometry.dcp,
            ),
            scheduler_config=SimSchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
            ),
            speculative_config=(
                SimSpeculativeConfig(method=geometry.speculative_method)
                if geometry.speculative_method
                else None
            ),
            kv_transfer_config=kvt,
            boundary_checkpoints_requested=boundary_checkpoints,
        )
        use_boundary = self.vllm_config.use_request_boundary_checkpoints
        self.use_boundary = use_boundary
        self._requests: dict[str, SimRequest] = {}
        self._waiting: list[SimRequest] = []
        self._running: list[SimRequest] = []
        self._results: dict[str, RequestResult] = {}
        self.history: list[RequestResult] = []
        self._finished_since_last: set[str] = set()
        self._logits_only: list[SimRequest] = []
        self._new_this_step: set[str] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._result_counts: dict[tuple[str, int], int] = {}
        self._ranks: list[RankHost] = []
        self.connector: Any = None
        self._closed = False
        try:
            # 1. workers first (construction order of docs/design/vllm-boundary-api.md §1.1),
            # each with its own connector
            if rank_mode == "thread":
                self._executor = ThreadPoolExecutor(
                    max_workers=world_size, thread_name_prefix="lmcache-rc-sim-rank"
                )
            for r in range(world_size):
                spec = RankSpec(
                    rank=r,
                    geometry=geometry,
                    num_blocks=num_blocks,
                    vllm_config=self.vllm_config.for_rank(r),
                    use_boundary=use_boundary,
                )
                self._ranks.append(RankHost(spec, rank_mode, self._executor))
            for host in self._ranks:
                host.wait_ready()
            # 2. the scheduler: allocator, then its connector
            manager_cls = SimAdmissionKVCacheManager if admission_api else SimKVCacheManager
            self.manager = manager_cls(
                geometry, num_blocks, enable_boundary_checkpoints=use_boundary
            )
            if kvt is not None:
                cls = get_connector_class(kvt)
                if clock is not None:
                    cls = type(cls.__name__, (cls,), {"clock": staticmethod(clock)})
                self.connector = create_connector(
                    self.vllm_config, KVConnectorRole.SCHEDULER, self.manager.kv_cache_config, cls
                )
                self.connector.bind_gpu_block_pool(self.manager.block_pool)
                if self.manager.boundary_checkpoints is not None:
                    bind = getattr(self.connector, "bind_boundary_checkpoint_cache", None)
                    if bind is not None:
                        bind(self.manager)
        except BaseException:
            self.close()
            raise

    # ================================================================ lifecycle
    def __enter__(self) -> SimEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut down the connectors (scheduler first, then every rank) and the ranks."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        if self.connector is not None:
            try:
                self.connector.shutdown()
            except BaseException as e:
                errors.append(e)
        for host in self._ranks:
            try:
                host.close()
            except BaseException as e:
                errors.append(e)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if errors:
            raise errors[0]

    # ================================================================ requests
    def add_request(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        max_new_tokens: int = 8,
        *,
        cache_salt: str | None = None,
        lora_request: Any | None = None,
        instruction_boundary: int | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> SimRequest:
        """Queue a request (``Scheduler.add_request`` → ``connector.on_new_request``).

        A request id may be reused once the earlier request with that id finished.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is still active")
        if not prompt_tokens:
            raise ValueError("prompt_tokens must not be empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if len(prompt_tokens) + max_new_tokens > self.geometry.max_model_len:
            raise ValueError("prompt + max_new_tokens exceeds max_model_len")
        if instruction_boundary is not None and not 0 < instruction_boundary < len(prompt_tokens):
            raise ValueError("instruction_boundary must fall inside the prompt")
        req = SimRequest(
            request_id,
            [int(t) for t in prompt_tokens],
            max_new_tokens,
            cache_salt=cache_salt,
            lora_request=lora_request,
            instruction_boundary=instruction_boundary,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
        )
        self._requests[request_id] = req
        self._waiting.append(req)
        result = RequestResult(request_id, list(req.prompt_token_ids))
        self._results[request_id] = result
        self.history.append(result)
        self.stats.requests_added += 1
        if self.connector is not None:
            self.connector.on_new_request(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        """Abort an active request (``finish_requests``); False if it is not active."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._free_request(req, "abort")
        self.stats.requests_aborted += 1
        return True

    def result(self, request_id: str) -> RequestResult:
        """The latest result recorded under ``request_id``."""
        return self._results[request_id]

    def is_active(self, request_id: str) -> bool:
        """Whether ``request_id`` is waiting or running."""
        return request_id in self._requests

    def has_requests(self) -> bool:
        """``Scheduler.has_requests()``: active requests or pending connector work."""
        if self._waiting or self._running or self._logits_only:
            return True
        return bool(self.connector is not None and self.connector.has_pending_push_work())

    def generate(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        max_new_tokens: int = 8,
        *,
        drain: bool = True,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> RequestResult:
        """Run one request to completion and (``drain``) until the engine is idle."""
        self.add_request(request_id, prompt_tokens, max_new_tokens, **kwargs)
        result = self._results[request_id]
        self.run_until(lambda: result.finished, timeout=timeout)
        if drain:
            self.run_until_idle(timeout=timeout)
        return result

    # ================================================================ driving
    def run_until(self, predicate: Callable[[], bool], *, timeout: float = 60.0) -> int:
        """Step until ``predicate()`` holds; returns the steps taken.

        TimeoutError (with the engine status) after ``timeout`` wall seconds;
        RuntimeError if the engine goes idle first.
        """
        deadline = time.monotonic() + timeout
        steps = 0
        while not predicate():
            if not self.has_requests():
                raise RuntimeError("engine is idle but the condition does not hold")
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not reached in {timeout}s: {self.status()}")
            self.step()
            steps += 1
        return steps

    def run_until_idle(self, *, timeout: float = 60.0) -> int:
        """Step until :meth:`has_requests` is False; returns the steps taken."""
        return self.run_until(lambda: not self.has_requests(), timeout=timeout)

    def step(self) -> StepInput | None:
        """One engine step: schedule, execute on every rank, aggregate, update."""
        if not self.has_requests():
            return None
        out = self._schedule()
        outputs = self._execute(out)
        kv_out = self._aggregate(outputs)
        self._update_from_output(out, outputs[0], kv_out)
        self.stats.steps += 1
        if out.total_num_scheduled_tokens == 0:
            self.stats.connector_only_steps += 1
            if self.idle_sleep > 0:
                time.sleep(self.idle_sleep)  # let sidecar replies and copies progress
        return out

    # ================================================================ schedule
    def _schedule(self) -> StepInput:
        mgr = self.manager
        mgr.new_step_starts()
        ctx = getattr(mgr, "set_external_boundary_admission_context", None)
        if ctx is not None:
            free_slots = self.vllm_config.scheduler_config.max_num_seqs - len(self._running)
            ctx(free_slots, 0, bool(self._running))
        finished, self._finished_since_last = self._finished_since_last, set()
        new_reqs: list[NewRequestData] = []
        work: list[ScheduledWork] = []
        self._new_this_step = set()
        if self._logits_only:
            # full-prompt hit: an isolated saved-logits step for that request only
            req = self._logits_only.pop(0)
            work.append(
                ScheduledWork(
                    req.request_id,
                    list(req.all_token_ids),
                    req.num_computed_tokens,
                    0,
                    mgr.request_block_tables(req.request_id),
                    sample=True,
                    logits_only=True,
                    captures=[],
                )
            )
            self.stats.saved_logits_steps += 1
            return self._finish_schedule(new_reqs, work, finished, logits_only=True)
        budget = self.vllm_config.scheduler_config.max_num_batched_tokens
        preempted: set[str] = set()
        for req in list(self._running):
            if budget <= 0:
                break
            if req not in self._running or req.num_computed_tokens >= req.num_tokens:
                continue
            k = self._chunk(req, req.num_computed_tokens, budget)
            while mgr.allocate_slots(req, k) is None:
                victim = self._running[-1]  # lowest priority: the latest admitted
                if victim is req:
                    break
                self._preempt(victim, preempted)
            else:
                work.append(self._work(req, req.num_computed_tokens, k))
                budget -= k
        for req in list(self._waiting):
            if budget <= 0 or len(self._running) >= self.vllm_config.scheduler_config.max_num_seqs:
                break
            if req.request_id in preempted:
                continue  # not re-admitted in the step that preempted it
            admitted = self._try_admit(req, budget, new_reqs, work)
            if admitted is None:
                self._results[req.request_id].parked_steps += 1
                self.stats.parked += 1
                continue
            budget -= admitted
        return self._finish_schedule(
            new_reqs, work, finished, logits_only=False, preempted=preempted
        )

    def _preempt(self, req: SimRequest, preempted: set[str]) -> None:
        """vLLM preemption: free the blocks (no ``request_finished``), recompute later."""
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.boundary_checkpoint = None
        self._running.remove(req)
        if req in self._logits_only:
            self._logits_only.remove(req)
        self._waiting.insert(0, req)
        preempted.add(req.request_id)
        self._results[req.request_id].preemptions += 1
        self.stats.preemptions += 1

    def _chunk(self, req: SimRequest, computed: int, budget: int) -> int:
        k = min(req.num_tokens - computed, budget)
        ib = req.instruction_boundary
        if ib is not None and computed < ib < computed + k:
            k = ib - computed
        return k

    def _try_admit(
        self,
        req: SimRequest,
        budget: int,
        new_reqs: list[NewRequestData],
        work: list[ScheduledWork],
    ) -> int | None:
        """The waiting-loop body of docs/design/vllm-boundary-api.md §1.4 step 1.

        None = the request stays waiting.
        """
        mgr, conn = self.manager, self.connector
        if req.num_computed_tokens == 0 and mgr.boundary_checkpoints is not None:
            if conn is not None and not conn.poll_boundary_checkpoint(req):
                return None
        can_admit = getattr(mgr, "can_admit_external_boundary_request", None)
        if can_admit is not None and not can_admit(req.request_id):
            return None
        _blocks, n_local, _ = mgr.get_computed_blocks(req)
        ext = 0
        if conn is not None:
            fn = getattr(conn, "boundary_checkpoint_external_tokens", None)
            ext = int(fn(req)) if fn is not None else 0
            if not 0 <= ext <= n_local:
                raise AssertionError(
                    f"boundary_checkpoint_external_tokens={ext} outside [0, {n_local}]"
                )
            matched, _is_async = conn.get_num_new_matched_tokens(req, n_local)
            if matched is None:
                return None
            if matched:
                raise NotImplementedError("the simulator does not load ordinary external chunks")
        ckpt: BoundaryCheckpoint | None = req.boundary_checkpoint
        full_hit = ckpt is not None and n_local == req.num_tokens
        k = 0 if full_hit else self._chunk(req, n_local, budget)
        allocated = mgr.allocate_slots(req, k, n_local, ckpt)
        if allocated is None:
            return None
        if conn is not None:
            conn.update_state_after_alloc(req, allocated, ext)
        req.num_computed_tokens = n_local
        self._waiting.remove(req)
        self._running.append(req)
        result = self._results[req.request_id]
        if result.admitted_step is None:  # first admission (not a re-admission after preemption)
            result.restored_tokens = ext
            result.local_hit_tokens = n_local
            result.recomputed_tokens = req.num_tokens - n_local
            result.admitted_step = self.stats.steps
        new_reqs.append(NewRequestData(req.request_id, ckpt))
        self._new_this_step.add(req.request_id)
        if full_hit:
            work.append(
                ScheduledWork(
                    req.request_id,
                    list(req.all_token_ids),
                    n_local,
                    0,
                    mgr.request_block_tables(req.request_id),
                    sample=False,
                )
            )
            self._logits_only.append(req)
            return 0
        work.append(self._work(req, n_local, k))
        return k

    def _work(self, req: SimRequest, computed: int, k: int) -> ScheduledWork:
        end = computed + k
        sample = end == req.num_tokens
        captures = []
        kinds: list[tuple[str, int]] = []
        if req.instruction_boundary is not None and end == req.instruction_boundary:
            kinds.append(("instruction", end))
        if computed < req.num_prompt_tokens == end:
            kinds.append(("prompt", end))
        if sample and len(req.output_token_ids) + 1 >= req.max_new_tokens:
            if not kinds or kinds[-1][1] != end:
                kinds.append(("response", end))
        if self.manager.boundary_checkpoints is not None:
            for kind, n in kinds:
                plan = self.manager.plan_boundary_capture(req, n, kind)
                if plan is not None:
                    captures.append(plan)
        return ScheduledWork(
            req.request_id,
            list(req.all_token_ids[:end]),
            computed,
            k,
            self.manager.request_block_tables(req.request_id),
            sample=sample,
            captures=captures,
        )

    def _finish_schedule(
        self,
        new_reqs: list[NewRequestData],
        work: list[ScheduledWork],
        finished: set[str],
        *,
        logits_only: bool,
        preempted: set[str] | None = None,
    ) -> StepInput:
        out = StepInput(
            step=self.stats.steps,
            scheduled_new_reqs=new_reqs,
            work=work,
            finished_req_ids=finished,
            preempted_req_ids=set(preempted or ()),
            kv_connector_metadata=None,
            boundary_logits_only=logits_only,
        )
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.stats.tokens_scheduled += out.total_num_scheduled_tokens
        return out

    # ================================================================ execute
    def _execute(self, out: StepInput) -> list[RankOutput]:
        blob = pickle.dumps(out)  # every rank unpickles its own copy, as vLLM's workers do
        for host in self._ranks:
            host.start("step", blob)
        results: list[RankOutput] = []
        first_error: BaseException | None = None
        for host in self._ranks:
            try:
                results.append(host.finish())
            except BaseException as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        for r in results:
            self.stats.pages_verified += r.pages_verified
            self.stats.restores_verified += r.restores_verified
            self._record_results(r)
        return results

    def _record_results(self, out: RankOutput) -> None:
        """Count task results per (task, rank) when the worker metadata exposes them.

        Read-only duck typing on a ``results: {task_id: {rank: bool}}`` attribute;
        used by :meth:`idle_problems` to check "exactly one result per (task,
        rank)" and "every submitted task reported".
        """
        results = getattr(out.worker_meta, "results", None)
        if not isinstance(results, Mapping):
            return
        for task_id, ranks in results.items():
            if not isinstance(ranks, Mapping):
                continue
            for rank in ranks:
                key = (str(task_id), int(rank))
                self._result_counts[key] = self._result_counts.get(key, 0) + 1

    def _aggregate(self, outputs: Sequence[RankOutput]) -> SimKVConnectorOutput:
        """``KVOutputAggregator.aggregate``: left fold of worker metadata in rank order."""
        kv = SimKVConnectorOutput()
        acc: Any = None
        for o in outputs:
            kv.invalid_block_ids |= o.invalid_block_ids
            if o.worker_meta is not None:
                acc = o.worker_meta if acc is None else acc.aggregate(o.worker_meta)
        kv.kv_connector_worker_meta = acc
        counts: dict[str, int] = {}
        for o in outputs:
            for rid in o.finished_recving or ():
                counts[rid] = counts.get(rid, 0) + 1
        done = {rid for rid, c in counts.items() if c == len(outputs)}
        kv.finished_recving = done or None
        return kv

    # ================================================================ update
    def _update_from_output(
        self, out: StepInput, rank0: RankOutput, kv_out: SimKVConnectorOutput
    ) -> None:
        mgr, conn = self.manager, self.connector
        for w in out.work:
            req = self._requests.get(w.request_id)
            if req is None:
                continue
            result = self._results[w.request_id]
            if not w.logits_only:
                req.num_computed_tokens += w.num_tokens
            for plan in w.captures:
                ckpt = mgr.publish_boundary_checkpoint(req, plan.num_tokens, kind=plan.kind)
                if ckpt is None:
                    continue
                self.stats.local_publications += 1
                result.published.append((plan.kind, plan.num_tokens))
                if conn is not None:
                    store = getattr(conn, "store_boundary_checkpoint", None)
                    if store is not None:
                        store(req, ckpt)
                        result.stores_offered += 1
                        self.stats.stores_offered += 1
            if w.sample:
                token = rank0.sampled[w.request_id]
                req.output_token_ids.append(token)
                result.output_tokens.append(token)
                if len(req.output_token_ids) >= req.max_new_tokens:
                    self._free_request(req, "length")
        for rid in self._new_this_step:
            mgr.release_reader(rid)  # the workers copied the restored pages
        if conn is not None:
            conn.update_connector_output(kv_out)
            conn.take_events()

    def _free_request(self, req: SimRequest, reason: str) -> None:
        mgr, conn = self.manager, self.connector
        rid = req.request_id
        if conn is not None and self._requests.get(rid) is req:
            tables = (
                mgr.request_block_tables(rid)
                if rid in mgr._requests
                else [[] for _ in self.geometry.groups]
            )
            if isinstance(conn, SupportsHMA):
                delay, _params = conn.request_finished_all_groups(req, tuple(tables))
            else:
                delay, _params = conn.request_finished(req, tables[0])
            if delay:
                raise NotImplementedError("the simulator does not defer block frees")
        mgr.free(req)
        if req in self._waiting:
            self._waiting.remove(req)
        if req in self._running:
            self._running.remove(req)
        if req in self._logits_only:
            self._logits_only.remove(req)
        self._requests.pop(rid, None)
        self._finished_since_last.add(rid)
        result = self._results[rid]
        result.finish_reason = reason
        result.finished_step = self.stats.steps
        self.stats.requests_finished += 1

    # ================================================================ faults
    def inject_fault(
        self,
        kind: FaultKind,
        *,
        rank: int | None = None,
        direction: str | None = None,
        count: int = 1,
    ) -> None:
        """Make the next ``count`` matching copy tasks misbehave (see :class:`FaultRule`)."""
        rule = FaultRule(kind, rank, direction, count)
        for host in self._ranks:
            if rank is None or host.rank == rank:
                host.call("faults", [rule])

    def clear_faults(self) -> None:
        """Remove every unused fault rule."""
        for host in self._ranks:
            host.call("clear_faults")

    def held_tasks(self) -> int:
        """Copy tasks currently wedged by ``hold`` faults, over all ranks."""
        return sum(int(h.call("status")["held"]) for h in self._ranks)

    def release_held(self) -> int:
        """Submit every wedged task now; returns how many were released."""
        return sum(int(h.call("release_held")) for h in self._ranks)

    def pending_imports(self) -> dict[int, str]:
        """Staged (unpublished) imports: checkpoint id → consumer request id."""
        return self.manager.pending_external_checkpoints()

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """The allocator's explicit eviction path (``evict_blocks``)."""
        self.manager.evict_blocks(block_ids)

    def evict_pending_import(self, request_id: str) -> list[int]:
        """Evict one destination page of each pending import of ``request_id``."""
        cache = self.manager.boundary_checkpoints
        evicted: list[int] = []
        if cache is None:
            return evicted
        for cid, rid in self.pending_imports().items():
            if rid == request_id:
                block = min(cache._pending[cid].checkpoint.dependencies)
                self.manager.evict_blocks([block])
                evicted.append(block)
        return evicted

    # ================================================================ inspection
    def read_page(self, rank: int, block_id: int) -> bytes:
        """The bytes of ``block_id`` in ``rank``'s page pool."""
        return bytes(self._ranks[rank].call("read_page", block_id))

    def rank_runner(self, rank: int) -> RankRunner:
        """The in-process runner of ``rank`` (thread mode only)."""
        runner = self._ranks[rank].runner
        if runner is None:
            raise RuntimeError("ranks run in separate processes")
        return runner

    def sidecar_status(self) -> dict[str, Any] | None:
        """``rc.Client(socket).status()``, or None without a connector."""
        if self.connector is None or not self.socket_path:
            return None
        import lmcache_rc as rc

        client = rc.Client(self.socket_path)
        try:
            return dict(client.status())
        finally:
            client.close()

    def status(self) -> EngineStatus:
        """A snapshot of engine, ranks, connector and sidecar."""
        cache = self.manager.boundary_checkpoints
        report = getattr(self.connector, "report_status", None)
        return EngineStatus(
            stats=EngineStats(**asdict(self.stats)),
            waiting=[r.request_id for r in self._waiting],
            running=[r.request_id for r in self._running],
            free_blocks=self.manager.block_pool.get_num_free_blocks(),
            num_blocks=self.num_blocks,
            published_checkpoints=0 if cache is None else len(cache),
            pending_checkpoints=0 if cache is None else len(cache._pending),
            has_pending_push_work=bool(
                self.connector is not None and self.connector.has_pending_push_work()
            ),
            ranks=[h.call("status") for h in self._ranks],
            connector=report() if report is not None else None,
            sidecar=self.sidecar_status(),
        )

    def _repr_html_(self) -> str:
        return self.status()._repr_html_()

    def idle_problems(self, *, sidecar: bool = True, timeout: float = 5.0) -> list[str]:
        """Every violated idle invariant (empty when idle); see :meth:`assert_idle`."""
        problems: list[str] = []
        if self._waiting or self._running or self._logits_only:
            problems.append(f"active requests: {sorted(self._requests)}")
        if self.connector is not None and self.connector.has_pending_push_work():
            problems.append("connector has pending push work")
        cache = self.manager.boundary_checkpoints
        if cache is not None and cache._pending:
            problems.append(f"staged checkpoints: {sorted(cache._pending)}")
        if self.manager.pending_external_checkpoints():
            problems.append(f"pending imports: {self.manager.pending_external_checkpoints()}")
        used = self.manager.block_pool.num_used_blocks
        if used:
            pinned = [b.block_id for b in self.manager.block_pool.blocks[1:] if b.ref_cnt > 0]
            problems.append(f"{used} referenced blocks: {pinned[:16]}")
        reserved = getattr(self.manager, "external_boundary_reserved_blocks", None)
        if reserved is not None and reserved():
            problems.append(f"{reserved()} blocks reserved for admissions")
        waiting = getattr(self.manager, "has_pending_external_boundary_admissions", None)
        if waiting is not None and waiting():
            problems.append("admission reservations or waiters remain")
        for h in self._ranks:
            st = h.call("status")
            if st["in_flight"] or st["held"]:
                problems.append(f"rank {st['rank']}: {st['in_flight']} copies in flight")
            if st["unsafe"]:
                problems.append(f"rank {st['rank']}: copy worker is unsafe")
            if st["duplicate_submissions"]:
                problems.append(f"rank {st['rank']}: a copy task was submitted twice")
            if self._result_counts:
                missing = [
                    t
                    for t in st["submitted_task_ids"]
                    if (t, st["rank"]) not in self._result_counts
                ]
                if missing:
                    problems.append(f"rank {st['rank']}: tasks never reported: {missing[:4]}")
        repeated = sorted(k for k, c in self._result_counts.items() if c > 1)
        if repeated:
            problems.append(f"(task, rank) reported more than once: {repeated[:4]}")
        if sidecar and self.connector is not None:
            deadline = time.monotonic() + timeout
            while True:
                st = self.sidecar_status() or {}
                bad = {
                    k: st.get(k, 0)
                    for k in ("store_leases", "retrieve_leases", "pins", "pending")
                    if st.get(k, 0)
                }
                if not bad or time.monotonic() > deadline:
                    break
                time.sleep(0.01)  # the sidecar finishes leases asynchronously
            if bad:
                problems.append(f"sidecar not idle: {bad}")
        return problems

    def assert_idle(self, *, sidecar: bool = True) -> None:
        """The idle invariant: no requests, pins, staged checkpoints, in-flight tasks,
        admission reservations; the sidecar has no leases, pins or pending generations.
        """
        problems = self.idle_problems(sidecar=sidecar)
        if problems:
            raise AssertionError("engine is not idle: " + "; ".join(problems))
