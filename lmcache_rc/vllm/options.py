"""The connector's options: ``kv_connector_extra_config`` under ``lmcache_rc.``.

What it owns: every option name, default and validation rule
(:data:`OPTION_DEFAULTS`, :class:`ConnectorOptions`, :func:`parse_options`),
shared by both modes and both roles. A typo is an error that names the
option; keys without the prefix belong to other connectors and are ignored.

What it must never do: import vLLM, or accept a value it would later
reinterpret (no silent fallbacks to defaults).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_rc import errors
from lmcache_rc.config import default_socket_path

__all__ = [
    "DEPRECATED_OPTIONS",
    "OPTION_DEFAULTS",
    "OPTION_PREFIX",
    "STORE_PROMPT",
    "VLLM_APIS",
    "ConnectorOptions",
    "InvalidConnectorConfig",
    "extra_config",
    "is_speculative",
    "parse_options",
]

OPTION_PREFIX = "lmcache_rc."
"""Prefix of every option of this connector in ``kv_connector_extra_config``."""

OPTION_DEFAULTS: Mapping[str, Any] = {
    "socket": None,  # None: lmcache_rc.config.default_socket_path()
    "checkpoint_identity": None,  # required
    "lookup_timeout": 60.0,
    "begin_timeout": 60.0,
    "rpc_timeout": 30.0,
    "connect_timeout": 10.0,
    "max_lookup_attempts": 4,
    "copy_workers": 2,
    "max_copies_per_rank": 16,
    "chunk_tokens": 4096,
    "max_tasks": 64,
    "task_timeout": 300.0,
    "layout_timeout": 300.0,
    "close_timeout": 180.0,
    "idle_flush": 0.05,
    "vllm_api": "auto",
    "store_prompt": "last",
    "store_response": True,
}
"""Every option (without the ``lmcache_rc.`` prefix) and its default."""

DEPRECATED_OPTIONS: Mapping[str, tuple[str, str]] = {
    "max_pending": (
        "max_copies_per_rank",
        "it bounds the copies queued or running per worker rank; the sidecar's "
        "--max-pending is another setting",
    ),
}
"""Old option names (without the prefix) still accepted, each with a
``FutureWarning``: the option each is now, and why it was renamed.
``max_pending`` shared its name with ``lmcache-rc serve --max-pending``
(generations pending publication in the sidecar's directory)."""

VLLM_APIS = ("auto", "boundary", "upstream")
"""Values of ``lmcache_rc.vllm_api``."""

STORE_PROMPT = ("last", "all", "none")
"""Values of ``lmcache_rc.store_prompt``."""

_REVISION = re.compile(r"(?:[0-9a-f]{40}|[0-9a-f]{64})")
_IDENTITY_KEYS = ("target_revision", "source_revision", "draft_revision")


class InvalidConnectorConfig(errors.InvalidInput):
    """An option in ``kv_connector_extra_config`` is missing, malformed or unknown.

    The message names the option (``lmcache_rc.<name>``). Also a ValueError.
    """


@dataclass(frozen=True)
class ConnectorOptions:
    """The parsed ``lmcache_rc.*`` options (defaults in :data:`OPTION_DEFAULTS`)."""

    socket: str
    target_revision: str
    source_revision: str
    draft_revision: str
    """Empty without speculative decoding."""
    lookup_timeout: float = 60.0
    begin_timeout: float = 60.0
    rpc_timeout: float = 30.0
    connect_timeout: float = 10.0
    max_lookup_attempts: int = 4
    copy_workers: int = 2
    max_copies_per_rank: int = 16
    """Copies queued or running in each worker rank's transfer engine (its
    admission bound, at least ``copy_workers``); the scheduler never has more
    tasks outstanding at the ranks. Formerly ``max_pending``."""
    chunk_tokens: int = 4096
    max_tasks: int = 64
    task_timeout: float = 300.0
    """0 disables the restore task timeout."""
    layout_timeout: float = 300.0
    """0 waits for the worker layouts forever."""
    close_timeout: float = 180.0
    """How long a worker's shutdown waits for its copies to drain before it
    raises ``UnsafeCopy`` (the process must then exit); 0 waits forever."""
    idle_flush: float = 0.05
    """Upstream mode, scheduler and ranks in one process: seconds without an
    engine step after which begun stores go straight to the ranks, so an idle
    engine publishes them (``lmcache_rc.vllm.local``); 0 leaves them for the
    next step (a rank's shutdown still hands them over)."""
    vllm_api: str = "auto"
    """``auto``, ``boundary`` (the fork's boundary checkpoints) or ``upstream``
    (stock vLLM 0.33 connector hooks)."""
    store_prompt: str = "last"
    """Upstream mode: which Mamba boundaries of a prompt are stored —
    ``last`` (the last block boundary at or below the prompt length),
    ``all`` (every block boundary; shared prefixes such as system prompts
    restore across requests) or ``none``."""
    store_response: bool = True
    """Upstream mode: store the state at the end of each finished request
    (what the next turn of a conversation continues from)."""


def _bad(name: str, why: str) -> InvalidConnectorConfig:
    return InvalidConnectorConfig(f"kv_connector_extra_config option {OPTION_PREFIX}{name} {why}")


def _number(name: str, value: Any, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"must be a number of seconds, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise _bad(name, f"must be a positive number of seconds, got {value!r}")
    return v


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"must be in {low}..{high}, got {value}")
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise _bad(name, f"must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}")
    return value


def _identity(value: Any, speculative: bool) -> tuple[str, str, str]:
    name = "checkpoint_identity"
    if value is None:
        raise _bad(
            name,
            "is required: a mapping with the immutable target_revision and source_revision "
            "(and draft_revision with speculative decoding), each 40 or 64 lowercase hex digits",
        )
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _bad(name, f"is not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise _bad(name, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in _IDENTITY_KEYS)
    if unknown:
        raise _bad(name, f"has unknown keys {unknown} (allowed: {list(_IDENTITY_KEYS)})")
    revisions: dict[str, str] = {}
    for key in _IDENTITY_KEYS:
        rev = value.get(key)
        if rev == "auto":
            revisions[key] = rev  # resolved by lmcache_rc.vllm.identity at start-up
            continue
        if rev in (None, ""):
            if key == "draft_revision" and not speculative:
                revisions[key] = ""
                continue
            why = " (speculative decoding is configured)" if key == "draft_revision" else ""
            raise _bad(f"{name}.{key}", f"is required{why}")
        if not isinstance(rev, str) or not _REVISION.fullmatch(rev):
            raise _bad(
                f"{name}.{key}",
                f'must be an immutable revision (40 or 64 lowercase hex digits) or "auto", '
                f"got {rev!r}; branch or tag names such as 'main' can change content",
            )
        revisions[key] = rev
    # Without speculation the draft has no state in a bundle: it is not identity.
    draft = revisions["draft_revision"] if speculative else ""
    return revisions["target_revision"], revisions["source_revision"], draft


def parse_options(extra_config: Mapping[str, Any] | None, *, speculative: bool) -> ConnectorOptions:
    """Validates the ``lmcache_rc.*`` entries of ``kv_connector_extra_config``.

    Keys without the prefix belong to other connectors and are ignored;
    unknown ``lmcache_rc.*`` keys are refused (a typo must not silently fall
    back to a default). A name of :data:`DEPRECATED_OPTIONS` is read as its
    new name with a ``FutureWarning``; giving both names is refused. Raises
    :class:`InvalidConnectorConfig` naming the option.
    """
    extra = dict(extra_config or {})
    values: dict[str, Any] = {}
    for key, value in extra.items():
        if not isinstance(key, str) or not key.startswith(OPTION_PREFIX):
            continue
        name = key[len(OPTION_PREFIX) :]
        if name in DEPRECATED_OPTIONS:
            new, why = DEPRECATED_OPTIONS[name]
            if OPTION_PREFIX + new in extra:
                raise InvalidConnectorConfig(
                    f"kv_connector_extra_config options {key} and {OPTION_PREFIX}{new} are "
                    f"both set; {key} is the deprecated name of {OPTION_PREFIX}{new}: keep "
                    "only the new one"
                )
            warnings.warn(
                f"kv_connector_extra_config option {key} is deprecated: use "
                f"{OPTION_PREFIX}{new} ({why})",
                FutureWarning,
                stacklevel=2,
            )
            name = new
        if name not in OPTION_DEFAULTS:
            raise InvalidConnectorConfig(
                f"unknown kv_connector_extra_config option {key!r} "
                f"(known: {', '.join(OPTION_PREFIX + k for k in OPTION_DEFAULTS)})"
            )
        values[name] = value
    socket = values.get("socket")
    if socket is None:
        socket = default_socket_path()
    elif not isinstance(socket, str | os.PathLike) or not str(socket):
        raise _bad("socket", f"must be a non-empty path, got {socket!r}")
    target, source, draft = _identity(values.get("checkpoint_identity"), speculative)

    def get(name: str) -> Any:
        return values.get(name, OPTION_DEFAULTS[name])

    opts = ConnectorOptions(
        socket=os.fspath(socket),
        target_revision=target,
        source_revision=source,
        draft_revision=draft,
        lookup_timeout=_number("lookup_timeout", get("lookup_timeout")),
        begin_timeout=_number("begin_timeout", get("begin_timeout")),
        rpc_timeout=_number("rpc_timeout", get("rpc_timeout")),
        connect_timeout=_number("connect_timeout", get("connect_timeout")),
        max_lookup_attempts=_integer("max_lookup_attempts", get("max_lookup_attempts"), 1, 64),
        copy_workers=_integer("copy_workers", get("copy_workers"), 1, 64),
        max_copies_per_rank=_integer("max_copies_per_rank", get("max_copies_per_rank"), 1, 4096),
        chunk_tokens=_integer("chunk_tokens", get("chunk_tokens"), 1, 65536),
        max_tasks=_integer("max_tasks", get("max_tasks"), 1, 65536),
        task_timeout=_number("task_timeout", get("task_timeout"), zero_ok=True),
        layout_timeout=_number("layout_timeout", get("layout_timeout"), zero_ok=True),
        close_timeout=_number("close_timeout", get("close_timeout"), zero_ok=True),
        idle_flush=_number("idle_flush", get("idle_flush"), zero_ok=True),
        vllm_api=_choice("vllm_api", get("vllm_api"), VLLM_APIS),
        store_prompt=_choice("store_prompt", get("store_prompt"), STORE_PROMPT),
        store_response=_boolean("store_response", get("store_response")),
    )
    if opts.max_copies_per_rank < opts.copy_workers:
        raise _bad(
            "max_copies_per_rank",
            f"({opts.max_copies_per_rank}) must be at least lmcache_rc.copy_workers "
            f"({opts.copy_workers})",
        )
    return opts


def is_speculative(vllm_config: Any) -> bool:
    """Whether speculative decoding is configured (``draft_revision`` is then identity)."""
    return getattr(vllm_config, "speculative_config", None) is not None


def extra_config(vllm_config: Any) -> Mapping[str, Any]:
    """``kv_connector_extra_config`` of ``vllm_config`` (ValueError without a KV config)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        raise ValueError("kv_transfer_config must be set for LMCacheRecurrentCheckpointConnector")
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    if not isinstance(extra, Mapping):
        raise InvalidConnectorConfig("kv_connector_extra_config must be a mapping")
    return extra
