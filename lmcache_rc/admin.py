"""The sidecar's HTTP admin API, as its operator calls it.

A running sidecar with the HTTP admin API on writes ``<socket>.admin.json``
beside its Unix socket (mode 0600, so only the sidecar's user can read it;
removed on a clean stop): ``{"url": "http://127.0.0.1:PORT", "token": "..."}``.
The read-only routes (``GET /status``, ``GET /metrics``) are open on loopback;
``POST /clear`` needs ``Authorization: Bearer <token>``, and the token changes
at every start. :func:`read_admin_file` finds the API from the socket path and
:func:`clear` makes the call; ``lmcache-rc clear`` uses both.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_rc import errors
from lmcache_rc._native import Server
from lmcache_rc.results import ClearReport

__all__ = ["AdminAccessError", "AdminEndpoint", "admin_file_for", "clear", "read_admin_file"]


class AdminAccessError(errors.CheckpointError):
    """The admin file cannot be read or is malformed, or the sidecar refused
    the bearer token (HTTP 401): nothing was changed."""


@dataclass(frozen=True)
class AdminEndpoint:
    """Where a sidecar's HTTP admin API listens and the token it accepts."""

    url: str
    token: str = field(repr=False)


def admin_file_for(socket: str | os.PathLike[str]) -> Path:
    """The admin file of a sidecar listening on ``socket``
    (``<socket>.admin.json``; the one rule lives in the Rust core)."""
    return Path(Server.admin_file_for(socket))


def read_admin_file(socket: str | os.PathLike[str]) -> AdminEndpoint | None:
    """The admin endpoint of the sidecar on ``socket``, or None when it runs
    without the HTTP API (no admin file). Raises :class:`AdminAccessError`
    when the file exists but cannot be read (another user's sidecar) or is
    not an admin file."""
    path = admin_file_for(socket)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AdminAccessError(
            f"cannot read the sidecar's admin file {path}: {exc.strerror or exc}; "
            "run as the user that runs `lmcache-rc serve`"
        ) from exc
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("url"), str)
        or not isinstance(data.get("token"), str)
        or not data["url"].startswith("http://")
    ):
        raise AdminAccessError(f"{path} is not an lmcache-rc admin file (want url and token)")
    return AdminEndpoint(url=data["url"], token=data["token"])


def _opener() -> urllib.request.OpenerDirector:
    """An opener that ignores ``http_proxy`` and friends: the admin API is
    local, and a proxy must never see the bearer token."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def clear(
    endpoint: AdminEndpoint,
    force: bool | None = None,
    all_tiers: bool = False,
    timeout: float = 60.0,
) -> ClearReport:
    """``POST /clear`` with the bearer token; returns what was cleared, as
    the socket's ``clear()`` does.

    ``force`` None leaves it to the sidecar's default (forced); a forced clear
    while leases are live raises :class:`lmcache_rc.errors.LeasesLive` (409).
    An unreachable API raises :class:`lmcache_rc.errors.Unavailable`.
    """
    query: dict[str, str] = {}
    if force is not None:
        query["force"] = "true" if force else "false"
    if all_tiers:
        query["all_tiers"] = "true"
    url = f"{endpoint.url}/clear"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    request = urllib.request.Request(
        url,
        data=b"",
        method="POST",
        headers={"Authorization": f"Bearer {endpoint.token}"},
    )
    try:
        with _opener().open(request, timeout=timeout) as response:
            body: Any = json.load(response)
    except urllib.error.HTTPError as exc:
        raise _http_error(exc) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise errors.Unavailable(
            f"no HTTP admin API at {endpoint.url} ({reason}); is `lmcache-rc serve` running?"
        ) from exc
    cleared = body.get("cleared") if isinstance(body, dict) else None
    if not isinstance(cleared, dict):
        raise errors.ProtocolError(f"unexpected reply from {url}: {body!r}")
    try:
        return ClearReport(
            l1_objects=int(cleared["l1_objects"]),
            l1_bytes=int(cleared["l1_bytes"]),
            l2_objects=int(cleared["l2_objects"]),
            retired_generations=int(cleared["retired_generations"]),
            kept_objects=int(cleared["kept_objects"]),
        )
    except (KeyError, TypeError, ValueError):
        raise errors.ProtocolError(f"unexpected reply from {url}: {body!r}") from None


def _http_error(exc: urllib.error.HTTPError) -> errors.CheckpointError:
    """The exception for an error reply: its JSON ``message`` under the class
    that matches the status code."""
    try:
        payload = json.loads(exc.read().decode("utf-8", "replace"))
        message = str(payload.get("message", payload))
    except (ValueError, AttributeError, OSError):
        message = str(exc.reason)
    if exc.code == 409:
        return errors.LeasesLive(message)
    if exc.code == 400:
        return errors.InvalidInput(message)
    if exc.code == 401:
        return AdminAccessError(f"not authorized: {message}")
    return errors.CheckpointError(f"HTTP {exc.code}: {message}")
