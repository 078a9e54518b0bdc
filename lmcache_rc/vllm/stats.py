"""The connector's counters where vLLM operators look: vLLM's own connector-stats path.

What it owns: :class:`CheckpointConnectorStats` (vLLM's ``KVConnectorStats``:
what the scheduler side counted since the last step — lookups by outcome,
restores, tokens restored, stores by kind and why some were skipped — and
a few gauges of its state: tasks outstanding, pinned blocks, lookups in
flight, whether the sidecar answers), :class:`StatsFeed` (turns the scheduler
side's cumulative counters into those per-step deltas) and
:class:`CheckpointPromMetrics` (vLLM's ``KVConnectorPromMetrics``: two series
in the API server's ``/metrics``, ``vllm:lmcache_rc_events_total{event=…}``
and ``vllm:lmcache_rc_state{state=…}``, one child per counter or gauge name:
the names are a closed set written in this package's code, so the label's
cardinality is bounded).

How it travels (vLLM 0.32/0.33): after every step vLLM's scheduler calls the
connector's ``get_kv_connector_stats``, folds the result into the step's
``SchedulerStats`` as ``to_dict()``, and the API server rebuilds it with the
connector class's ``build_kv_connector_stats`` for its periodic log line
(``KV Transfer metrics: restores_done=…``, through ``reduce``) and feeds the
same dict to the ``build_prom_metrics`` object. Only plain dicts of strings
and numbers cross the process boundary.

What it must never do: block, raise into vLLM's step, or send a counter
that did not move (a step's payload holds only what changed in it; the
time spent in vLLM's calls changes on every step, so in practice every step
sends that much).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lmcache_rc.vllm.api import KVConnectorPromMetrics, KVConnectorStats

__all__ = [
    "COST_PREFIXES",
    "EVENTS_METRIC",
    "STATE_METRIC",
    "CheckpointConnectorStats",
    "CheckpointPromMetrics",
    "StatsFeed",
]

logger = logging.getLogger(__name__)

EVENTS_METRIC = "vllm:lmcache_rc_events"
"""Counter (``_total`` in the exposition): the connector's counters, label ``event``."""
STATE_METRIC = "vllm:lmcache_rc_state"
"""Gauge: the connector's state, label ``state``."""

COST_PREFIXES = ("hook_", "copy_", "copies_")
"""Counters of what the connector costs (not in the log line)."""

_COUNTERS = "counters"
_GAUGES = "gauges"


class CheckpointConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's counters of one or more steps (vLLM's ``KVConnectorStats``).

    ``data`` is ``{"counters": {name: increase}, "gauges": {name: value}}``:
    counters add up when folded (``aggregate``), gauges keep the latest value.
    """

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        data = data or {}
        # copies: folding must never change the payload it was built from
        super().__init__(
            data={
                _COUNTERS: dict(data.get(_COUNTERS) or {}),
                _GAUGES: dict(data.get(_GAUGES) or {}),
            }
        )

    @property
    def counters(self) -> dict[str, int]:
        """Counter increases."""
        counters: dict[str, int] = self.data[_COUNTERS]
        return counters

    @property
    def gauges(self) -> dict[str, float]:
        """Latest gauge values."""
        gauges: dict[str, float] = self.data[_GAUGES]
        return gauges

    def reset(self) -> None:
        """Forget everything (vLLM resets after each log interval)."""
        self.data: dict[str, Any] = {_COUNTERS: {}, _GAUGES: {}}

    def aggregate(self, other: KVConnectorStats) -> CheckpointConnectorStats:
        """Folds ``other`` in: counters summed, gauges replaced."""
        data = getattr(other, "data", None) or {}
        for name, value in (data.get(_COUNTERS) or {}).items():
            self.counters[name] = self.counters.get(name, 0) + value
        self.gauges.update(data.get(_GAUGES) or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        """One log line's values: counters that moved, then the gauges. The
        cost counters (time in vLLM's calls, copies by phase: ``hook_*``,
        ``copy_*``, ``copies_*``) are left to ``/metrics``: they would
        drown the line."""
        out: dict[str, int | float] = {
            k: v for k, v in sorted(self.counters.items()) if v and not k.startswith(COST_PREFIXES)
        }
        out.update(sorted(self.gauges.items()))
        return out

    def is_empty(self) -> bool:
        """Whether nothing changed (vLLM sends and logs nothing then)."""
        return not self.counters and not self.gauges


class StatsFeed:
    """Per-step deltas of a scheduler side's cumulative counters, and its
    gauges when they changed: what :meth:`take` returns is what happened
    since the previous call."""

    def __init__(self) -> None:
        self._counters: dict[str, int] = {}
        self._gauges: dict[str, float] = {}

    def take(
        self, counters: Mapping[str, int], gauges: Mapping[str, float]
    ) -> CheckpointConnectorStats | None:
        """The change since the last call, or None when nothing changed."""
        moved = {k: int(v) - self._counters.get(k, 0) for k, v in counters.items()}
        moved = {k: v for k, v in moved.items() if v}
        changed = {k: float(v) for k, v in gauges.items() if self._gauges.get(k) != float(v)}
        if not moved and not changed:
            return None
        self._counters.update({k: int(v) for k, v in counters.items()})
        self._gauges.update(changed)
        # every gauge rides along when anything changed: a scrape sees them together
        return CheckpointConnectorStats(
            {_COUNTERS: moved, _GAUGES: {k: float(v) for k, v in gauges.items()}}
        )


class CheckpointPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The connector's series in the API server's ``/metrics``:
    ``vllm:lmcache_rc_events_total{event}`` and ``vllm:lmcache_rc_state{state}``,
    with vLLM's engine labels."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._events = self._counter_cls(
            name=EVENTS_METRIC,
            documentation=(
                "lmcache-rc connector counters by event: lookups by outcome, restores "
                "started/done/failed, tokens restored, stores begun/committed by kind, "
                "stores skipped by reason (docs/vllm.md, Serving)"
            ),
            labelnames=[*self._labelnames, "event"],
        )
        self._state = self._gauge_cls(
            name=STATE_METRIC,
            documentation=(
                "lmcache-rc connector state: copy tasks outstanding, pinned blocks, "
                "lookups and BEGINs in flight, sidecar reachable (1/0)"
            ),
            labelnames=[*self._labelnames, "state"],
            multiprocess_mode="mostrecent",
        )
        self._children: dict[tuple[int, str, str], Any] = {}

    def _child(self, metric: Any, kind: str, engine: int, name: str) -> Any:
        key = (engine, kind, name)
        child = self._children.get(key)
        if child is None:
            labels = [*self.per_engine_labelvalues.get(engine, []), name]
            child = metric.labels(*labels)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Records one step's (or interval's) counters and gauges."""
        for name, value in (transfer_stats_data.get(_COUNTERS) or {}).items():
            if value > 0:
                self._child(self._events, "event", engine_idx, str(name)).inc(value)
        for name, value in (transfer_stats_data.get(_GAUGES) or {}).items():
            self._child(self._state, "state", engine_idx, str(name)).set(value)
