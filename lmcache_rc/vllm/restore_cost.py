"""Restore only when it beats recomputing: the skip rule of both modes.

What it owns (``docs/vllm.md``, "Restore only when it beats recomputing"):

* :func:`restore_seconds`: the time a restore takes to load its pages, from
  where they sit — the tiers of a ``find_located`` answer, each with the
  sidecar's measured figures (a page load's latency and rate, and how many
  loads the tier runs at once). A tier's loads run ``parallelism`` at a
  time, each paying its latency and moving its page's bytes, so loading
  ``pages`` pages of ``bytes`` bytes takes
  ``ceil(pages / parallelism) x (latency + bytes / pages / rate)``; the
  tiers' times add up. Pages in L1 cost nothing to load: their restore is
  the worker's memory copy, which overlaps the engine's step.
* :class:`PrefillMeter`: what recomputing one token costs this engine —
  configured (``lmcache_rc.prefill_seconds_per_token``) or measured from
  its own steps: each step's scheduled tokens (``build_connector_meta``)
  and the time until its output came back (``update_connector_output``),
  fitted as ``step = overhead + tokens x cost`` by exponentially weighted
  least squares; the slope is the cost of one more token (a recompute is
  extra tokens in steps that run anyway). When the steps do not pin the
  slope down (too few, too alike, too noisy), the average seconds per
  scheduled token is used instead: an overestimate, so it errs towards
  restoring.
* :class:`SkipRule`: skip a restore when
  ``restore_seconds > threshold x tokens x seconds_per_token``; without a
  figure for any tier the restore needs (nothing measured yet, an unknown
  tier) or without a per-token cost, never skip.

What it must never do: skip a restore on a guess (no measurement means
restore), or block.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "Decision",
    "PrefillMeter",
    "SkipRule",
    "TierLoad",
    "restore_seconds",
]

_LOADED_TIERS = ("l2", "shared")
"""Tiers whose pages a restore must load into L1 first (with figures)."""


@dataclass(frozen=True)
class TierLoad:
    """One tier of a ``find_located`` answer (its ``tiers`` entries)."""

    tier: str
    pages: int
    bytes: int
    samples: int = 0
    """Loads the sidecar measured (0: the figures below are unknown)."""
    latency_s: float = 0.0
    bytes_per_s: float = 0.0
    parallelism: int = 1

    @classmethod
    def from_reply(cls, entry: Mapping[str, Any]) -> TierLoad:
        """From the sidecar's dict (``latency_us``, ``bytes_per_s``, ...)."""
        return cls(
            tier=str(entry["tier"]),
            pages=int(entry["pages"]),
            bytes=int(entry["bytes"]),
            samples=int(entry.get("samples", 0)),
            latency_s=int(entry.get("latency_us", 0)) / 1e6,
            bytes_per_s=float(entry.get("bytes_per_s", 0)),
            parallelism=max(1, int(entry.get("parallelism", 1))),
        )


def restore_seconds(tiers: Iterable[TierLoad]) -> float | None:
    """Seconds to load a checkpoint's pages into L1 (see the module docs);
    None when a tier holding pages to load has no figures (nothing measured
    yet, or a tier this build does not know)."""
    total = 0.0
    for t in tiers:
        if t.pages <= 0 or t.tier == "l1":
            continue
        if t.tier not in _LOADED_TIERS or t.samples <= 0 or t.bytes_per_s <= 0:
            return None
        rounds = math.ceil(t.pages / t.parallelism)
        total += rounds * (t.latency_s + t.bytes / t.pages / t.bytes_per_s)
    return total


class PrefillMeter:
    """The engine's cost of computing one more token (see the module docs).

    ``configured`` > 0 is used as it is; otherwise steps are measured:
    :meth:`scheduled` when a step's metadata is built, :meth:`finished` when
    its output came back (oldest step first; steps with no tokens are not
    measured, nor steps beyond :attr:`MAX_PENDING` awaiting their output).
    """

    MIN_STEPS = 8
    """Steps measured before a measured cost is used."""
    WEIGHT = 0.05
    """Weight of a new step in the moving sums (about the last 20-60 steps count)."""
    MAX_PENDING = 64
    """Steps awaiting their output at most (older ones are forgotten)."""
    MIN_SPREAD = 0.25
    """The slope is used only when the steps' token counts vary by at least
    this fraction of their mean (their coefficient of variation) ..."""
    MIN_FIT = 0.5
    """... and the fit explains at least this share of the steps' variance (R²)."""

    def __init__(self, configured: float = 0.0) -> None:
        self._configured = configured
        self._pending: deque[tuple[float, int]] = deque(maxlen=self.MAX_PENDING)
        self._steps = 0
        # exponentially weighted sums: weight, tokens, seconds, tokens², tokens·seconds, seconds²
        self._w = self._x = self._y = self._xx = self._xy = self._yy = 0.0

    def scheduled(self, now: float, tokens: int | None) -> None:
        """A step with ``tokens`` scheduled tokens starts (its metadata is
        built). Steps without tokens are queued too (not measured), so that
        each output pairs with its own step."""
        if self._configured > 0 or tokens is None:
            return
        self._pending.append((now, max(0, int(tokens))))

    def finished(self, now: float) -> None:
        """The output of the oldest step in flight came back."""
        if not self._pending:
            return
        started, tokens = self._pending.popleft()
        self.observe(tokens, now - started)

    def observe(self, tokens: int, seconds: float) -> None:
        """One step of ``tokens`` tokens took ``seconds``."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return  # a clock that did not move measures nothing
        keep = 1.0 - self.WEIGHT
        x, y = float(tokens), float(seconds)
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y
        self._yy = keep * self._yy + y * y
        self._steps += 1

    @property
    def steps(self) -> int:
        """Steps measured."""
        return self._steps

    @property
    def source(self) -> str | None:
        """``configured``, ``measured``, or None (no cost known yet)."""
        if self._configured > 0:
            return "configured"
        return "measured" if self._steps >= self.MIN_STEPS else None

    def seconds_per_token(self) -> float | None:
        """The cost of one more token, or None while unknown."""
        if self._configured > 0:
            return self._configured
        if self._steps < self.MIN_STEPS or self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        if mx <= 0 or my <= 0:
            return None
        average = my / mx
        vx = self._xx / self._w - mx * mx
        vy = self._yy / self._w - my * my
        cov = self._xy / self._w - mx * my
        if vx > (self.MIN_SPREAD * mx) ** 2 and vy > 0 and cov > 0:
            if cov * cov / (vx * vy) >= self.MIN_FIT:
                return cov / vx
        return average

    def report(self) -> dict[str, Any]:
        """For status: the cost, where it comes from, steps measured."""
        return {
            "prefill_seconds_per_token": self.seconds_per_token(),
            "prefill_cost_source": self.source,
            "prefill_steps_measured": self._steps,
        }


@dataclass(frozen=True)
class Decision:
    """One weighed restore (kept for status and ``lmcache-rc bench restore-skip``)."""

    request_id: str
    tokens: int
    """Tokens the restore would add (the recompute it would save)."""
    tiers: dict[str, int]
    """Bytes per tier of the checkpoint."""
    pages: int
    """Pages of the checkpoint (every rank, every tier)."""
    restore_s: float | None
    """Estimated load time (None: no figures)."""
    recompute_s: float | None
    """Estimated recompute time (None: no per-token cost)."""
    skip: bool


class SkipRule:
    """Decides per request whether a restore beats recomputing (module docs).

    ``enabled`` False never skips (the connector then sends plain FINDs and
    never asks where pages sit). ``threshold``: skip when the restore is
    estimated to take more than this many times the recompute.
    """

    RECENT = 16
    """Decisions kept for status."""

    def __init__(self, *, enabled: bool, threshold: float, meter: PrefillMeter) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be positive, got {threshold}")
        self.enabled = enabled
        self.threshold = threshold
        self.meter = meter
        self.recent: deque[Decision] = deque(maxlen=self.RECENT)

    @classmethod
    def from_options(cls, options: Any) -> SkipRule:
        """From the connector's options (``skip_cheaper_recompute``,
        ``recompute_threshold``, ``prefill_seconds_per_token``)."""
        return cls(
            enabled=bool(options.skip_cheaper_recompute),
            threshold=float(options.recompute_threshold),
            meter=PrefillMeter(float(options.prefill_seconds_per_token)),
        )

    def decide(self, request_id: str, tokens: int, tiers: Iterable[TierLoad]) -> Decision:
        """Weighs restoring ``tokens`` tokens from ``tiers`` against recomputing them."""
        tiers = list(tiers)
        restore = restore_seconds(tiers)
        per_token = self.meter.seconds_per_token()
        recompute = None if per_token is None else tokens * per_token
        skip = (
            self.enabled
            and tokens > 0
            and restore is not None
            and recompute is not None
            and restore > self.threshold * recompute
        )
        held: dict[str, int] = {}
        for t in tiers:
            held[t.tier] = held.get(t.tier, 0) + t.bytes
        pages = sum(t.pages for t in tiers)
        decision = Decision(request_id, tokens, held, pages, restore, recompute, skip)
        self.recent.append(decision)
        return decision

    def report(self) -> dict[str, Any]:
        """For the connector's status."""
        return {
            "enabled": self.enabled,
            "threshold": self.threshold,
            **self.meter.report(),
            "recent": [asdict(d) for d in self.recent],
        }
