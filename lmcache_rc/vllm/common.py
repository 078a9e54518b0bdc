"""Scheduler-side pieces both modes share.

What it owns: the restore state machine's phases (:class:`RestorePhase`),
layout negotiation with the worker ranks (:class:`LayoutNegotiation`: every
rank reports one address-free layout; all must agree before any lookup or
store, because the layout is part of the namespace, I3), the namespace cache
per cache salt, the canonical JSON that payloads and layouts are compared
in, and which requests may use the sidecar at all (:func:`handles`).

What it must never do: talk to the sidecar or to vLLM's allocator.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import lmcache_rc as rc

__all__ = [
    "LayoutNegotiation",
    "RestorePhase",
    "canonical",
    "check_rank",
    "handles",
]

logger = logging.getLogger(__name__)


class RestorePhase(enum.StrEnum):
    """Where one request's restore stands (the values are what status reports)."""

    FINDING = "finding"
    """A FIND is in flight."""
    FOUND = "found"
    """Upstream: a usable checkpoint was found and offered to vLLM."""
    WAITING = "waiting-capacity"
    """Boundary: a manifest was chosen; the allocator had no room yet."""
    RESTORING = "restoring"
    """A RETRIEVE task owns the destination blocks."""
    PUBLISHED = "published"
    """Boundary: the import is published for this request; admit."""
    RETRY = "retry"
    """The restore failed; the next ask looks up again (a shorter checkpoint)."""
    DONE = "done"
    """Nothing (more) to restore."""


def canonical(value: Any) -> bytes:
    """Sorted-key, compact JSON: the form manifests carry layouts in."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def check_rank(rank: Any, world_size: int) -> None:
    """ValueError unless ``rank`` is an integer in ``0..world_size-1``."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"worker rank must be an integer, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"worker rank {rank} is outside 0..{world_size - 1}")


def handles(request: Any) -> bool:
    """Whether ``request`` may use the sidecar at all.

    LoRA requests never do (an adapter id does not authenticate adapter bytes,
    I3); multimodal requests and prompt embeddings neither (their placeholder
    tokens do not name the content).
    """
    if getattr(request, "lora_request", None) is not None:
        return False
    if getattr(request, "mm_features", None):
        return False
    return getattr(request, "prompt_embeds", None) is None


class LayoutNegotiation:
    """Collects one layout per rank; settles when all ``world_size`` agree, or
    fails after ``timeout`` seconds (then the engine serves without the sidecar).

    ``validate(rank, layout)`` checks one report (mode-specific); different
    reports are a ValueError (a bug or a misconfigured rank, never a miss).
    """

    def __init__(
        self,
        world_size: int,
        identity: Mapping[str, Any],
        *,
        timeout: float | None,
        clock: Callable[[], float],
        validate: Callable[[int, Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.world_size = world_size
        self._identity = {k: v for k, v in identity.items() if k != "layout"}
        self._clock = clock
        self._validate = validate
        self._deadline = None if timeout is None else clock() + timeout
        self.reports: dict[int, dict[str, Any]] = {}
        self.layout: dict[str, Any] | None = None
        self.failed = False
        self._namespaces: dict[str, str] = {}

    def take(self, rank: int, layout: Mapping[str, Any]) -> None:
        """One rank's report."""
        check_rank(rank, self.world_size)
        if self._validate is not None:
            self._validate(rank, layout)
        try:  # the JSON form, as manifests carry it (tuples become lists)
            plain: dict[str, Any] = json.loads(canonical(layout))
        except (TypeError, ValueError) as e:
            raise ValueError(f"rank {rank} reported a layout that is not plain JSON: {e}") from e
        known = self.reports.get(rank)
        if known is not None and known != plain:
            raise ValueError(f"rank {rank} reported a different worker layout")
        for other, theirs in self.reports.items():
            if theirs != plain:
                raise ValueError(
                    f"worker layouts differ between rank {other} and rank {rank}: every rank "
                    "must expose the same checkpoint page layout"
                )
        self.reports[rank] = plain
        if self.layout is None and len(self.reports) == self.world_size:
            self.layout = plain
            self._namespaces.clear()
            logger.info("checkpoint worker layout negotiated with %d ranks", self.world_size)

    def settled(self) -> bool:
        """False while layouts may still arrive; True once negotiated or given up."""
        if self.layout is not None or self.failed:
            return True
        if self._deadline is not None and self._clock() >= self._deadline:
            self.failed = True
            missing = sorted(set(range(self.world_size)) - set(self.reports))
            logger.error(
                "checkpoint worker layout not reported by ranks %s in time; serving without "
                "external checkpoints",
                missing,
            )
            return True
        return False

    def namespace(self, cache_salt: str | None) -> str:
        """The checkpoint namespace of requests with ``cache_salt`` (needs the layout)."""
        if self.layout is None:
            raise RuntimeError("the worker layout is not negotiated yet")
        salt = cache_salt or ""
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = rc.checkpoint_namespace({**self._identity, "layout": self.layout}, salt)
            self._namespaces[salt] = ns
        return ns
