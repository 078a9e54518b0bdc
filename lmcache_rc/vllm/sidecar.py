"""The scheduler's sidecar client, made safe for the scheduler thread.

What it owns: the :class:`SidecarClient` protocol (the part of
:class:`lmcache_rc.Client` the scheduler side uses; test fakes implement
it), and :class:`NonBlockingSidecar`, which never lets the scheduler thread
wait on a connect: while the connection is down, calls fail at once with
``Unavailable`` (a miss, or a skipped store), one background thread
reconnects, and ABORTs are queued until the connection is back.

What it must never do: block the calling thread on the network beyond
sending one frame.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import lmcache_rc as rc

__all__ = ["NonBlockingSidecar", "SidecarClient", "SidecarDown", "SidecarFuture", "connect"]

logger = logging.getLogger(__name__)


class SidecarDown(rc.errors.Unavailable):
    """A call refused at once because the connection is down (the outage is
    logged once by :class:`NonBlockingSidecar`; callers count it, quietly)."""


class SidecarFuture(Protocol):
    """The part of ``rc._native.Future`` the bridge uses."""

    def done(self) -> bool:
        """Whether the reply (or the failure) is in."""
        ...

    def result(self, timeout: float | None = None) -> Any:
        """The reply, or raises the call's error."""
        ...


class SidecarClient(Protocol):
    """The part of :class:`lmcache_rc.Client` the bridge uses (fakes in tests)."""

    def find_async(self, roots: Iterable[rc.Prefix]) -> SidecarFuture:
        """Start a FIND for the longest listed prefix of ``roots``."""
        ...

    def begin_async(self, manifest: rc.Manifest) -> SidecarFuture:
        """Start a BEGIN (stage a generation)."""
        ...

    # Optional: ``find_located_async(roots)`` (a FIND that also answers
    # where the found pages sit, for the skip rule); fakes may lack it.

    def abort_async(self, generation: str) -> SidecarFuture:
        """Start an ABORT of a pending generation."""
        ...

    def changes_async(self, since: int, watch: list[str]) -> SidecarFuture:
        """Start a ``changes`` call (the change feed; KV events only)."""
        ...

    def close(self) -> None:
        """Close the connection."""
        ...


class NonBlockingSidecar:
    """Keeps reconnecting off the scheduler thread.

    ``rc.Client``'s ``*_async`` calls send on the caller's thread, and when the
    connection is gone they first reconnect there, which can take up to the
    connect timeout against a sidecar that accepts but does not answer. So
    while the client reports no live connection, calls fail at once with
    ``Unavailable`` (the bridge turns that into a miss or a skipped store),
    one background thread reconnects (at most one attempt per
    ``retry_interval`` seconds), and ABORTs are queued and sent once the
    connection is back. Clients without a ``connected`` attribute (test
    fakes) are used directly.
    """

    def __init__(self, client: SidecarClient, retry_interval: float = 1.0) -> None:
        self._client = client
        self._retry_interval = retry_interval
        self._lock = threading.Lock()
        self._reconnecting = False
        self._last_attempt = float("-inf")
        self._aborts: deque[str] = deque(maxlen=4096)
        self._down_since: float | None = None
        self._refused = 0
        """Lookups and stores refused at once during the current outage."""
        self.outages = 0
        """Times the connection was found down (each logged once)."""

    @property
    def available(self) -> bool:
        """Whether calls go to the sidecar now (False during an outage)."""
        connected = getattr(self._client, "connected", None)
        return connected is None or bool(connected)

    def _live(self) -> bool:
        if self.available:
            if self._down_since is not None:
                down = time.monotonic() - self._down_since
                logger.warning(
                    "lmcache-rc: the sidecar is reachable again after %.1f s (%d lookups and "
                    "stores were served without it meanwhile)",
                    down,
                    self._refused,
                )
                self._down_since = None
            self._flush_aborts()
            return True
        if self._down_since is None:
            # one line per outage: requests go on, recomputed, and are not logged each
            self._down_since = time.monotonic()
            self._refused = 0
            self.outages += 1
            logger.warning(
                "lmcache-rc: lost the connection to the sidecar; requests are served without "
                "it (recomputed, nothing stored) while it reconnects in the background"
            )
        self._start_reconnect()
        return False

    def _start_reconnect(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._reconnecting or now - self._last_attempt < self._retry_interval:
                return
            self._reconnecting = True
            self._last_attempt = now
        threading.Thread(target=self._reconnect, name="lmcache-rc-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        try:
            # Any blocking call connects; capabilities is the cheapest.
            self._client.capabilities()  # type: ignore[attr-defined]
            logger.debug("reconnected to the lmcache-rc sidecar")
        except Exception as e:  # the outage was logged once; attempts are not
            logger.debug("the lmcache-rc sidecar is still unreachable: %s", e)
        finally:
            with self._lock:
                self._reconnecting = False

    def _flush_aborts(self) -> None:
        while self._aborts:
            generation = self._aborts.popleft()
            try:
                self._client.abort_async(generation)
            except Exception as e:  # the sidecar drops abandoned pending generations itself
                logger.warning("queued ABORT of %s could not be sent: %s", generation, e)

    def _down(self, what: str) -> SidecarDown:
        return SidecarDown(
            f"{what}: no live connection to the lmcache-rc sidecar (reconnecting in the background)"
        )

    def find_async(self, roots: Iterable[rc.Prefix]) -> SidecarFuture:
        """FIND, or ``Unavailable`` at once while disconnected."""
        if not self._live():
            self._refused += 1
            raise self._down("checkpoint lookup")
        return self._client.find_async(roots)

    @property
    def supports_located(self) -> bool:
        """Whether the client offers ``find_located_async``."""
        return callable(getattr(self._client, "find_located_async", None))

    def find_located_async(self, roots: Iterable[rc.Prefix]) -> SidecarFuture:
        """FIND_LOCATED, or ``Unavailable`` at once while disconnected."""
        if not self._live():
            self._refused += 1
            raise self._down("checkpoint lookup")
        future: SidecarFuture = self._client.find_located_async(roots)  # type: ignore[attr-defined]
        return future

    def begin_async(self, manifest: rc.Manifest) -> SidecarFuture:
        """BEGIN, or ``Unavailable`` at once while disconnected."""
        if not self._live():
            self._refused += 1
            raise self._down("checkpoint store")
        return self._client.begin_async(manifest)

    def abort_async(self, generation: str) -> SidecarFuture | None:
        """ABORT now, or queued until the connection is back (None)."""
        if not self._live():
            self._aborts.append(generation)
            return None
        return self._client.abort_async(generation)

    def changes_async(self, since: int, watch: list[str]) -> SidecarFuture:
        """The change feed, or ``Unavailable`` at once while disconnected."""
        if not self._live():
            raise self._down("change feed")
        return self._client.changes_async(since, watch)

    def report_engine_async(self, engine: str, counters: dict[str, int]) -> SidecarFuture | None:
        """Sends the engine's counters (``report_engine``); None when the
        connection is down or the client cannot (a report is never queued)."""
        send = getattr(self._client, "report_engine_async", None)
        if send is None or not self.available:
            return None
        future: SidecarFuture = send(engine, counters)
        return future

    def close(self) -> None:
        """Closes the client."""
        self._client.close()


def connect(socket_path: str, rpc_timeout: float, connect_timeout: float) -> rc.Client:
    """The default client factory: an :class:`lmcache_rc.Client` (connects now)."""
    return rc.Client(socket_path, timeout=rpc_timeout, connect_timeout=connect_timeout)
