"""Simulated vLLM worker ranks: page pools, the toy forward, and the worker connector wrapper.

What it owns: :class:`RankRunner` (one rank: a numpy uint8 page pool
``[num_blocks, page_bytes]`` with the null block 0, a fake
``BoundaryCheckpointState``, its own WORKER-role connector, the toy forward that
writes pages, endpoint capture, byte-for-byte verification of every restored
bundle, and the worker call order of ``docs/design/vllm-boundary-api.md`` §1.4
step 2), the step messages the scheduler sends (:class:`StepInput`) and gets
back (:class:`RankOutput`), fault injection at the copy-worker boundary
(:class:`FaultRule`), and two ways to host ranks: threads of the calling process
or separate processes (``spawn``/``forkserver``), each process creating its own
connector.

Why: a rank is where vLLM hands page memory to the connector; simulating it
with real bytes lets tests prove that restores are exact and that copies never
touch pages they do not own.

What it must never do: share mutable step state between ranks (each rank
unpickles its own copy of the step, as vLLM's workers do).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import pickle
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from lmcache_rc.testing.allocator import BoundaryCheckpoint, CapturePlan, build_kv_cache_config
from lmcache_rc.testing.config import SimVllmConfig, create_connector, get_connector_class
from lmcache_rc.testing.toy_model import HybridGeometry, ToyHybridModel, cdiv
from lmcache_rc.vllm.api import KVConnectorRole

__all__ = [
    "FaultRule",
    "NewRequestData",
    "RankError",
    "RankOutput",
    "RankRunner",
    "RankSpec",
    "RestoreMismatch",
    "ScheduledWork",
    "SimBoundaryCheckpointState",
    "StepInput",
]

logger = logging.getLogger(__name__)

FaultKind = Literal["reject", "raise", "fail", "hold"]


class RestoreMismatch(AssertionError):
    """A restored page differs from recomputation (the simulator's central check)."""


class RankError(RuntimeError):
    """A rank failed while executing a command; carries the rank and its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"rank {rank}: {message}\n{remote_traceback}")
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class FaultRule:
    """One injected fault at a rank's copy worker (``submit``), matched by rank and direction.

    Kinds: ``reject`` (submit answers False: nothing started, the rank reports
    False), ``raise`` (submit raises: the connector reports that task False),
    ``fail`` (the copy runs but the rank reports False), ``hold`` (the task is
    wedged: not submitted until :meth:`RankRunner.release_held`). ``count``
    tasks are affected; ``rank``/``direction`` None match any.
    """

    kind: FaultKind
    rank: int | None = None
    direction: str | None = None
    count: int = 1

    def matches(self, rank: int, direction: str) -> bool:
        """Whether this rule applies to a task of ``direction`` on ``rank``."""
        return (self.rank is None or self.rank == rank) and (
            self.direction is None or self.direction == direction
        )


class _FaultState:
    def __init__(self) -> None:
        self.rules: list[list[Any]] = []  # [rule, remaining]
        self.lock = threading.Lock()
        self.injected: dict[str, int] = {}

    def set(self, rules: Sequence[FaultRule]) -> None:
        with self.lock:
            self.rules.extend([r, r.count] for r in rules)

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def take(self, rank: int, direction: str) -> FaultRule | None:
        with self.lock:
            for entry in self.rules:
                rule: FaultRule = entry[0]
                if entry[1] > 0 and rule.matches(rank, direction):
                    entry[1] -= 1
                    self.injected[rule.kind] = self.injected.get(rule.kind, 0) + 1
                    return rule
        return None


class FaultyCopyWorker:
    """Wraps a rank's ``CheckpointWorker`` and applies :class:`FaultRule` s at ``submit``.

    Without matching rules every call passes straight through.
    """

    def __init__(self, inner: Any, rank: int, faults: _FaultState) -> None:
        self.inner = inner
        self.rank = rank
        self._faults = faults
        self._lock = threading.Lock()
        self._synthetic: dict[str, bool] = {}
        self._force_false: set[str] = set()
        self._held: list[tuple[str, Any, str, Sequence[Sequence[int]], int | None]] = []
        self.submitted: list[tuple[str, str]] = []
        self._seen: set[str] = set()
        self.duplicate_submissions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(
        self,
        task_id: str,
        manifest: Any,
        direction: str,
        block_ids: Sequence[Sequence[int]],
        producer_event: int | None = None,
    ) -> bool:
        """Submit, or inject the first matching fault."""
        with self._lock:
            if task_id in self._seen:
                self.duplicate_submissions += 1
            self._seen.add(task_id)
            self.submitted.append((task_id, direction))
        rule = self._faults.take(self.rank, direction)
        if rule is None:
            return bool(self.inner.submit(task_id, manifest, direction, block_ids, producer_event))
        if rule.kind == "reject":
            with self._lock:
                self._synthetic[task_id] = False
            return False
        if rule.kind == "raise":
            raise RuntimeError(f"injected submission failure on rank {self.rank}")
        if rule.kind == "hold":
            with self._lock:
                self._held.append((task_id, manifest, direction, block_ids, producer_event))
            return True
        with self._lock:
            self._force_false.add(task_id)
        return bool(self.inner.submit(task_id, manifest, direction, block_ids, producer_event))

    def collect(self) -> dict[str, bool]:
        """Results since the last call, with injected outcomes applied."""
        out = dict(self.inner.collect())
        with self._lock:
            for task_id in list(out):
                if task_id in self._force_false:
                    self._force_false.discard(task_id)
                    out[task_id] = False
            out.update(self._synthetic)
            self._synthetic.clear()
        return out

    def held(self) -> int:
        """Number of wedged tasks."""
        with self._lock:
            return len(self._held)

    def release_held(self) -> int:
        """Submit every wedged task now; returns how many."""
        with self._lock:
            held, self._held = self._held, []
        for task_id, manifest, direction, block_ids, event in held:
            self.inner.submit(task_id, manifest, direction, block_ids, event)
        return len(held)

    def in_flight(self) -> int:
        """In-flight copies, wedged tasks included."""
        return int(self.inner.in_flight()) + self.held()

    def room(self) -> int:
        """Copies admitted now; wedged tasks hold their places."""
        return max(0, int(self.inner.room()) - self.held())

    def close(self, timeout: float | None = None) -> None:
        """Release wedged tasks, then drain and close the inner worker."""
        self.release_held()
        self.inner.close(timeout)


class SimBoundaryCheckpointState:
    """Fake ``BoundaryCheckpointState``: a host page pool and an address-free layout.

    See docs/design/vllm-boundary-api.md §2.5.
    """

    def __init__(self, pool: npt.NDArray[np.uint8], layout: Mapping[str, Any]) -> None:
        self._pool = pool
        self._layout = dict(layout)
        self.initialized_layout: dict[str, Any] | None = None

    def get_external_checkpoint_page_pool(self) -> npt.NDArray[np.uint8]:
        """The uint8 ``[num_blocks, page_bytes]`` pool (row 0 is the null block)."""
        return self._pool

    def get_external_checkpoint_layout(self) -> dict[str, Any]:
        """A fresh copy of the layout descriptor (never aliases internal state)."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._layout.items()}

    def initialize_external_checkpoint_layout(self, layout: Mapping[str, Any]) -> None:
        """Strict equality with :meth:`get_external_checkpoint_layout`, else ValueError."""
        if dict(layout) != self._layout:
            raise ValueError("external checkpoint layout is incompatible with this worker")
        self.initialized_layout = dict(layout)


# ============================================================================ messages


@dataclass
class NewRequestData:
    """A request admitted this step; ``boundary_checkpoint`` set when it restores."""

    request_id: str
    boundary_checkpoint: BoundaryCheckpoint | None = None


@dataclass
class ScheduledWork:
    """One request's work this step: compute ``num_tokens`` after ``num_computed_tokens``.

    ``tokens`` are the request's tokens up to the end of this step's work;
    ``sample`` asks for a next token; ``logits_only`` is the saved-logits step of
    a full-prompt hit (nothing computed, sample from the restored state).
    """

    request_id: str
    tokens: list[int]
    num_computed_tokens: int
    num_tokens: int
    block_tables: list[list[int]]
    sample: bool
    logits_only: bool = False
    captures: list[CapturePlan] = field(default_factory=list)


@dataclass
class StepInput:
    """The part of ``SchedulerOutput`` every rank receives (pickled once per rank)."""

    step: int
    scheduled_new_reqs: list[NewRequestData]
    work: list[ScheduledWork]
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    kv_connector_metadata: Any
    boundary_logits_only: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens scheduled this step (saved-logits steps count one)."""
        return sum(1 if w.logits_only else w.num_tokens for w in self.work)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Tokens per request."""
        return {w.request_id: (1 if w.logits_only else w.num_tokens) for w in self.work}


@dataclass
class RankOutput:
    """What one rank returns for a step."""

    rank: int
    sampled: dict[str, int]
    worker_meta: Any
    finished_sending: set[str] | None
    finished_recving: set[str] | None
    invalid_block_ids: set[int]
    pages_verified: int
    restores_verified: int
    forward: bool


@dataclass
class RankSpec:
    """Everything a rank needs to start (picklable for process ranks)."""

    rank: int
    geometry: HybridGeometry
    num_blocks: int
    vllm_config: SimVllmConfig
    use_boundary: bool
    connector_subclass: bool = True


# ============================================================================ runner


@dataclass
class _RankRequest:
    aux: bytes = b""


class RankRunner:
    """One simulated worker rank (see the module docstring)."""

    def __init__(self, spec: RankSpec) -> None:
        self.rank = spec.rank
        self.geometry = spec.geometry
        self.model = ToyHybridModel(spec.geometry)
        self.pool: npt.NDArray[np.uint8] = np.zeros(
            (spec.num_blocks, spec.geometry.page_bytes), dtype=np.uint8
        )
        self.state = SimBoundaryCheckpointState(self.pool, spec.geometry.layout())
        self.faults = _FaultState()
        self.copy_worker: FaultyCopyWorker | None = None
        self.requests: dict[str, _RankRequest] = {}
        self.connector: Any = None
        self.pages_verified = 0
        self.restores_verified = 0
        config = spec.vllm_config
        kvt = config.kv_transfer_config
        if kvt is not None and kvt.is_kv_transfer_instance:
            cls = get_connector_class(kvt)
            if spec.connector_subclass and hasattr(cls, "worker_factory"):
                cls = self._faulty_subclass(cls)
            kv_cache_config = build_kv_cache_config(spec.geometry, spec.num_blocks)
            self.connector = create_connector(
                config, KVConnectorRole.WORKER, kv_cache_config, cls=cls
            )
            # startup order (docs/design/vllm-boundary-api.md §1.1 and the
            # bind_boundary_checkpoint_state row of §2.2): register_kv_caches →
            # bind_boundary_checkpoint_state
            self.connector.register_kv_caches(
                {g.layer_names[0]: self.pool for g in kv_cache_config.kv_cache_groups}
            )
            if spec.use_boundary:
                bind = getattr(self.connector, "bind_boundary_checkpoint_state", None)
                if bind is not None:
                    bind(self.state)

    def _faulty_subclass(self, cls: type[Any]) -> type[Any]:
        runner = self
        base_factory: Callable[..., Any] | None = cls.worker_factory

        def factory(socket_path: str, **kwargs: Any) -> Any:
            if base_factory is not None:
                inner = base_factory(socket_path, **kwargs)
            else:
                module = importlib.import_module("lmcache_rc.worker")
                inner = module.CheckpointWorker(socket_path, **kwargs)
            runner.copy_worker = FaultyCopyWorker(inner, runner.rank, runner.faults)
            return runner.copy_worker

        return type(cls.__name__, (cls,), {"worker_factory": staticmethod(factory)})

    # ---------------------------------------------------------------- commands
    def command(self, name: str, arg: Any) -> Any:
        """Dispatch one command (the same set for thread and process hosting)."""
        if name == "step":
            step = pickle.loads(arg) if isinstance(arg, bytes) else arg
            return self.execute(step)
        if name == "faults":
            self.faults.set(arg)
            return None
        if name == "clear_faults":
            self.faults.clear()
            return None
        if name == "release_held":
            return 0 if self.copy_worker is None else self.copy_worker.release_held()
        if name == "read_page":
            return self.pool[int(arg)].tobytes()
        if name == "status":
            return self.status()
        if name == "shutdown":
            if self.connector is not None:
                self.connector.shutdown()
            return None
        raise ValueError(f"unknown rank command {name!r}")

    def status(self) -> dict[str, Any]:
        """In-flight copies, wedged tasks, requests and verification counters."""
        return {
            "rank": self.rank,
            "in_flight": 0 if self.copy_worker is None else self.copy_worker.in_flight(),
            "held": 0 if self.copy_worker is None else self.copy_worker.held(),
            "unsafe": bool(getattr(self.copy_worker, "is_unsafe", False)),
            "tasks_submitted": 0 if self.copy_worker is None else len(self.copy_worker.submitted),
            "submitted_task_ids": (
                [] if self.copy_worker is None else [t for t, _ in self.copy_worker.submitted]
            ),
            "duplicate_submissions": (
                0 if self.copy_worker is None else self.copy_worker.duplicate_submissions
            ),
            "requests": len(self.requests),
            "pages_verified": self.pages_verified,
            "restores_verified": self.restores_verified,
            "faults_injected": dict(self.faults.injected),
        }

    # ---------------------------------------------------------------- step
    def execute(self, step: StepInput) -> RankOutput:
        """Run one step in the worker call order of docs/design/vllm-boundary-api.md §1.4 step 2."""
        for rid in step.finished_req_ids | step.preempted_req_ids:
            self.requests.pop(rid, None)
        conn = self.connector
        meta = step.kv_connector_metadata
        forward = step.total_num_scheduled_tokens > 0
        verified_before = (self.pages_verified, self.restores_verified)
        if conn is not None:
            conn.handle_preemptions(meta)
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)
        sampled: dict[str, int] = {}
        finished_sending: set[str] | None = None
        finished_recving: set[str] | None = None
        invalid: set[int] = set()
        worker_meta: Any = None
        try:
            for new in step.scheduled_new_reqs:
                self.requests[new.request_id] = _RankRequest()
            restores = {n.request_id: n.boundary_checkpoint for n in step.scheduled_new_reqs}
            for work in step.work:
                ckpt = restores.get(work.request_id)
                if ckpt is not None:
                    self._restore(work, ckpt)
            if forward:
                for work in step.work:
                    sampled.update(self._forward(work))
                finish = getattr(conn, "finish_forward", None)
                if finish is not None:
                    finish()
            if conn is not None:
                if forward:
                    conn.wait_for_save()
                finished_sending, finished_recving = conn.get_finished(step.finished_req_ids)
                invalid = set(conn.get_block_ids_with_load_errors() or ())
                worker_meta = conn.build_connector_worker_meta()
        finally:
            if conn is not None:
                conn.clear_connector_metadata()
        return RankOutput(
            rank=self.rank,
            sampled=sampled,
            worker_meta=worker_meta,
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid,
            pages_verified=self.pages_verified - verified_before[0],
            restores_verified=self.restores_verified - verified_before[1],
            forward=forward,
        )

    def _restore(self, work: ScheduledWork, ckpt: BoundaryCheckpoint) -> None:
        """Verify every page of ``ckpt`` against recomputation, then copy on write."""
        n = ckpt.num_tokens
        tokens = work.tokens[:n]
        if len(tokens) != n:
            raise RestoreMismatch(f"restore of {n} tokens but only {len(tokens)} tokens known")
        expected_groups, expected_aux = self.model.expected_checkpoint_pages(self.rank, tokens)
        bad: list[str] = []
        for g, expected in enumerate(expected_groups):
            for pos, page in expected.items():
                block = ckpt.block_ids[g][pos]
                if block == 0:
                    bad.append(f"group {g} position {pos}: null block")
                elif not np.array_equal(self.pool[block], page):
                    bad.append(f"group {g} position {pos} (block {block})")
                self.pages_verified += 1
        aux_block = ckpt.auxiliary_block_ids[0]
        if not np.array_equal(self.pool[aux_block], expected_aux):
            bad.append(f"auxiliary page (block {aux_block})")
        self.pages_verified += 1
        if bad:
            raise RestoreMismatch(
                f"rank {self.rank}: restored checkpoint {ckpt.checkpoint_id} of request "
                f"{work.request_id} ({n} tokens) differs from recomputation: {', '.join(bad)}"
            )
        self.restores_verified += 1
        for g in range(len(self.geometry.groups)):
            table = work.block_tables[g]
            if self.geometry.is_recurrent(g):
                self.pool[table[0]] = self.pool[ckpt.block_ids[g][-1]]
            else:
                tail = cdiv(n, self.geometry.page_width(g)) - 1
                if table[tail] != ckpt.block_ids[g][tail]:
                    self.pool[table[tail]] = self.pool[ckpt.block_ids[g][tail]]
        self.requests.setdefault(work.request_id, _RankRequest()).aux = self.pool[
            aux_block
        ].tobytes()

    def _forward(self, work: ScheduledWork) -> dict[str, int]:
        req = self.requests.setdefault(work.request_id, _RankRequest())
        if work.num_tokens == 0 and not work.logits_only:
            return {}
        if not work.logits_only:
            c, k = work.num_computed_tokens, work.num_tokens
            end = c + k
            tokens = work.tokens[:end]
            for g in range(len(self.geometry.groups)):
                table = work.block_tables[g]
                if self.geometry.is_recurrent(g):
                    self.pool[table[0]] = self.model.recurrent_page(self.rank, g, tokens)
                    continue
                width = self.geometry.page_width(g)
                for p in range(c // width, cdiv(end, width)):
                    if table[p] == 0:
                        raise RuntimeError(f"write to a null page (group {g}, position {p})")
                    self.pool[table[p]] = self.model.attention_page(self.rank, g, p, tokens)
            req.aux = self.model.auxiliary_page(self.rank, tokens).tobytes()
            for plan in work.captures:
                if plan.num_tokens != end:
                    raise RuntimeError("a capture must end at the step's last token")
                for src, dst in plan.copies.values():
                    self.pool[dst] = self.pool[src]
                self.pool[plan.auxiliary_block] = np.frombuffer(req.aux, dtype=np.uint8)
        if not work.sample:
            return {}
        return {work.request_id: self._sample(work, req)}

    def _sample(self, work: ScheduledWork, req: _RankRequest) -> int:
        parts: list[bytes] = []
        n = len(work.tokens)
        for g in range(len(self.geometry.groups)):
            if self.geometry.is_recurrent(g):
                parts.append(self.pool[work.block_tables[g][0]].tobytes())
        if not parts:
            for g in range(len(self.geometry.groups)):
                last = cdiv(n, self.geometry.page_width(g)) - 1
                parts.append(self.pool[work.block_tables[g][last]].tobytes())
        return self.model.next_token(b"".join(parts), req.aux)


# ============================================================================ hosting


class RankHost:
    """A rank hosted in a thread pool or in its own process; commands are pipelined.

    ``start(cmd, arg)`` sends a command, ``finish()`` waits for its answer
    (raising :class:`RankError` on a failure inside the rank).
    """

    def __init__(self, spec: RankSpec, mode: str, executor: ThreadPoolExecutor | None) -> None:
        self.rank = spec.rank
        self.mode = mode
        self._future: Future[Any] | None = None
        self._runner: RankRunner | None = None
        self._executor = executor
        self._conn: Connection | None = None
        self._proc: Any = None
        if mode == "thread":
            self._runner = RankRunner(spec)
        else:
            ctx: Any = multiprocessing.get_context(mode)
            parent, child = ctx.Pipe()
            self._proc = ctx.Process(
                target=_rank_process_main,
                args=(child, pickle.dumps(spec)),
                name=f"lmcache-rc-sim-rank{spec.rank}",
                daemon=True,
            )
            self._proc.start()
            child.close()
            self._conn = parent

    def wait_ready(self) -> None:
        """Wait until a process rank built its runner (raises its startup error)."""
        if self._conn is not None:
            self._recv()

    @property
    def runner(self) -> RankRunner | None:
        """The in-process runner (thread mode only)."""
        return self._runner

    def _recv(self) -> Any:
        assert self._conn is not None
        try:
            status, payload, tb = self._conn.recv()
        except EOFError as e:
            raise RankError(self.rank, "rank process exited") from e
        if status == "error":
            raise RankError(self.rank, payload, tb)
        return payload

    def start(self, name: str, arg: Any = None) -> None:
        """Send a command without waiting."""
        if self._runner is not None:
            assert self._executor is not None
            self._future = self._executor.submit(self._runner.command, name, arg)
        else:
            assert self._conn is not None
            self._conn.send((name, arg))

    def finish(self) -> Any:
        """The answer to the last :meth:`start`."""
        if self._runner is not None:
            assert self._future is not None
            fut, self._future = self._future, None
            try:
                return fut.result()
            except RankError:
                raise
            except BaseException as e:
                raise RankError(
                    self.rank, f"{type(e).__name__}: {e}", traceback.format_exc()
                ) from e
        return self._recv()

    def call(self, name: str, arg: Any = None) -> Any:
        """``start`` then ``finish``."""
        self.start(name, arg)
        return self.finish()

    def close(self) -> None:
        """Shut the rank's connector down and end its process (if any)."""
        try:
            if self._proc is None or self._proc.is_alive():
                self.call("shutdown")
        except (BrokenPipeError, EOFError, ConnectionResetError) as e:
            raise RankError(self.rank, f"rank process lost during shutdown: {e}") from e
        finally:
            if self._proc is not None:
                assert self._conn is not None
                try:
                    self._conn.send(("exit", None))
                except (OSError, BrokenPipeError):
                    pass
                self._proc.join(timeout=30)
                if self._proc.is_alive():
                    self._proc.kill()
                    self._proc.join()
                self._conn.close()


def _rank_process_main(conn: Connection, spec_bytes: bytes) -> None:
    """Entry point of a rank process: build the runner, then serve commands."""
    try:
        runner = RankRunner(pickle.loads(spec_bytes))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ok", "ready", ""))
    while True:
        try:
            name, arg = conn.recv()
        except EOFError:
            return
        if name == "exit":
            return
        try:
            result = runner.command(name, arg)
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
            continue
        conn.send(("ok", result, ""))
