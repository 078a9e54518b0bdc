"""What crosses between the scheduler and the worker ranks inside vLLM's
connector metadata, in both modes.

What it owns: :class:`CheckpointConnectorMetadata` (scheduler → every rank,
once per step: the copy tasks admitted in that step) and
:class:`CheckpointWorkerMetadata` (each rank → scheduler: its page layout,
once, and one boolean per task), folded across ranks by vLLM's
``KVOutputAggregator`` through :meth:`CheckpointWorkerMetadata.aggregate`.

What it must never do: count a rank twice (a duplicate is a protocol error),
or carry page bytes (only manifests and block ids travel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_rc.vllm.api import (
    CheckpointEngineTask,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["CheckpointConnectorMetadata", "CheckpointWorkerMetadata"]


class CheckpointConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler → every worker rank, once per step: the copy tasks admitted in
    this step. Each task appears in exactly one step's metadata (see
    docs/design/transfers.md#the-connectors-task-protocol)."""

    def __init__(self, tasks: Sequence[CheckpointEngineTask] = (), step: int = 0) -> None:
        self.tasks: tuple[CheckpointEngineTask, ...] = tuple(tasks)
        self.step = step
        """The scheduler side's step number (upstream mode; 0 when not counted):
        a rank that ran this step's ``wait_for_save`` has finished its forward."""

    def __repr__(self) -> str:
        return (
            f"CheckpointConnectorMetadata(step={self.step}, "
            f"tasks={[t.task_id for t in self.tasks]})"
        )


class CheckpointWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker ranks → scheduler: layouts reported once per rank, and one boolean
    result per (task, rank), folded across ranks with :meth:`aggregate`.

    Rank identity is kept exactly: a rank appearing twice for a layout or for
    the same task is a protocol error (ValueError), never counted twice.
    """

    def __init__(
        self,
        layouts: Mapping[int, Mapping[str, Any]] | None = None,
        results: Mapping[str, Mapping[int, bool]] | None = None,
    ) -> None:
        self.layouts: dict[int, dict[str, Any]] = {
            int(r): dict(v) for r, v in (layouts or {}).items()
        }
        self.results: dict[str, dict[int, bool]] = {
            str(t): {int(r): bool(ok) for r, ok in ranks.items()}
            for t, ranks in (results or {}).items()
        }

    def aggregate(self, other: KVConnectorWorkerMetadata) -> CheckpointWorkerMetadata:
        """A new object holding both ranks' reports (neither input changes).

        Raises ValueError when ``other`` repeats a rank's layout or a rank's
        result for one task, or is not a :class:`CheckpointWorkerMetadata`.
        """
        if not isinstance(other, CheckpointWorkerMetadata):
            raise ValueError(
                f"cannot aggregate CheckpointWorkerMetadata with {type(other).__name__}"
            )
        merged = CheckpointWorkerMetadata(self.layouts, self.results)
        for rank, layout in other.layouts.items():
            if rank in merged.layouts:
                raise ValueError(f"worker metadata reports the layout of rank {rank} twice")
            merged.layouts[rank] = dict(layout)
        for task_id, ranks in other.results.items():
            into = merged.results.setdefault(task_id, {})
            for rank, ok in ranks.items():
                if rank in into:
                    raise ValueError(
                        f"worker metadata reports rank {rank} twice for task {task_id}"
                    )
                into[rank] = ok
        return merged

    def __repr__(self) -> str:
        return f"CheckpointWorkerMetadata(layouts={sorted(self.layouts)}, results={self.results})"
