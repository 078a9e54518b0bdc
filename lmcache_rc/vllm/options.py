"""The connector's options: ``kv_connector_extra_config`` under ``lmcache_rc.``.

What it owns: every option name, kind, default, validation rule and
meaning, written once in :data:`OPTIONS`; :data:`OPTION_DEFAULTS`,
:class:`ConnectorOptions`, :func:`parse_options` and the option tables of
``docs/vllm.md`` (:func:`option_table`, via ``ci/gen_option_docs.py``) are
derived from it, shared by both modes and both roles. A typo is an error that names the
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
from lmcache_rc._native import TokenRoots
from lmcache_rc.config import default_socket_path, parse_duration
from lmcache_rc.worker import (
    DEFAULT_COPY_WORKERS,
    DEFAULT_MAX_COPIES_IN_FLIGHT,
    DEFAULT_RPC_TIMEOUT,
)

__all__ = [
    "DEPRECATED_OPTIONS",
    "OPTIONS",
    "OPTION_BY_NAME",
    "OPTION_DEFAULTS",
    "OPTION_PREFIX",
    "STORE_PROMPT",
    "VLLM_APIS",
    "ConnectorOptions",
    "InvalidConnectorConfig",
    "Option",
    "extra_config",
    "is_speculative",
    "option_table",
    "parse_options",
]

OPTION_PREFIX = "lmcache_rc."
"""Prefix of every option of this connector in ``kv_connector_extra_config``."""

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


def _bad(name: str, why: str) -> InvalidConnectorConfig:
    return InvalidConnectorConfig(f"kv_connector_extra_config option {OPTION_PREFIX}{name} {why}")


_KINDS: Mapping[str, type] = {
    "seconds": float,
    "integer": int,
    "choice": str,
    "boolean": bool,
    "socket": str,
    "identity": dict,
    "ratio": float,
}
"""Each option kind and the Python type its parsed value has."""


@dataclass(frozen=True)
class Option:
    """One row of :data:`OPTIONS`: everything written about one option."""

    name: str
    """Its name without the ``lmcache_rc.`` prefix."""
    kind: str
    """``seconds`` (a non-negative number), ``integer`` (in ``low..high``),
    ``choice`` (one of ``choices``), ``boolean``, ``ratio`` (a positive
    number), ``socket`` or ``identity`` (parsed by :func:`parse_options`
    itself)."""
    default: Any
    doc: str
    """What it means (both modes), for ``docs/vllm.md``."""
    low: int = 0
    high: int = 0
    choices: tuple[str, ...] = ()
    zero: str = ""
    """``seconds``: what 0 means (empty: 0 is refused)."""
    shown: str = ""
    """The default as the docs show it, when it is not the value itself."""
    upstream: str = ""
    """What it means in upstream mode, when not :attr:`doc`."""
    boundary: str = ""
    """What it means in boundary mode, when not :attr:`doc`."""

    @property
    def type(self) -> type:
        """The type of the parsed value."""
        return _KINDS[self.kind]

    def parse(self, value: Any) -> Any:
        """The validated value; :class:`InvalidConnectorConfig` naming the option."""
        name = self.name
        if self.kind == "seconds":
            if isinstance(value, str):
                # The one duration grammar (``30``, ``250ms``, ``5m``, ``1.5h``).
                try:
                    value = parse_duration(value)
                except ValueError as e:
                    raise _bad(name, f"must be a duration, got {value!r} ({e})") from None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(name, f"must be a number of seconds or a duration, got {value!r}")
            v = float(value)
            if not math.isfinite(v) or v < 0 or (v == 0 and not self.zero):
                raise _bad(name, f"must be a positive number of seconds, got {value!r}")
            return v
        if self.kind == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(name, f"must be an integer, got {value!r}")
            if not self.low <= value <= self.high:
                raise _bad(name, f"must be in {self.low}..{self.high}, got {value}")
            return value
        if self.kind == "choice":
            if not isinstance(value, str) or value not in self.choices:
                allowed = ", ".join(repr(a) for a in self.choices)
                raise _bad(name, f"must be one of {allowed}, got {value!r}")
            return value
        if self.kind == "boolean":
            if not isinstance(value, bool):
                raise _bad(name, f"must be true or false, got {value!r}")
            return value
        if self.kind == "ratio":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(name, f"must be a positive number, got {value!r}")
            r = float(value)
            if not math.isfinite(r) or r <= 0:
                raise _bad(name, f"must be a positive number, got {value!r}")
            return r
        raise TypeError(f"option {name} ({self.kind}) is parsed by parse_options")

    def shown_default(self) -> str:
        """The default as ``docs/vllm.md`` shows it."""
        if self.shown:
            return self.shown
        d = self.default
        if self.kind == "seconds":
            text = f"{d:g} s"
            return f"{text} (0 = {self.zero})" if self.zero else text
        if isinstance(d, bool):
            return f"`{str(d).lower()}`"
        if self.kind == "ratio":
            return f"{d:g}"
        if isinstance(d, str):
            return f"`{d}`"
        return str(d)

    def meaning(self, mode: str) -> str:
        """What it means in ``mode`` (``upstream`` or ``boundary``)."""
        special = self.upstream if mode == "upstream" else self.boundary
        return special or self.doc


OPTIONS: tuple[Option, ...] = (
    Option(
        "socket",
        "socket",
        None,
        "Unix socket of the sidecar",
        shown="the sidecar's default socket (`$XDG_RUNTIME_DIR/lmcache-rc/sidecar.sock`, "
        "else `/tmp/lmcache-rc-<uid>/sidecar.sock`)",
    ),
    Option(
        "checkpoint_identity",
        "identity",
        None,
        "the revisions of the weights (and of the draft model) stored states belong to",
        shown="**required**",
        upstream='`{"target_revision", "source_revision", "draft_revision"}` (a mapping, or '
        'the same as a JSON string); each 40/64 hex or `"auto"` (§A.3)',
        boundary='`{"target_revision", "source_revision", "draft_revision"}` (a mapping, or '
        "the same as a JSON string); see §B.3",
    ),
    Option(
        "vllm_api",
        "choice",
        "auto",
        "`auto`, `upstream` or `boundary`",
        choices=VLLM_APIS,
    ),
    Option(
        "store_prompt",
        "choice",
        "last",
        "`last`, `all` or `none` (§A.4)",
        choices=STORE_PROMPT,
        boundary="upstream mode only",
    ),
    Option(
        "store_response",
        "boolean",
        True,
        "store the state at the end of each finished request",
        boundary="upstream mode only",
    ),
    Option(
        "lookup_timeout",
        "seconds",
        60.0,
        "how long a request waits for the directory's answer before it recomputes",
    ),
    Option(
        "lookup_wait",
        "seconds",
        0.002,
        "how long, in all, the scheduler waits within one engine step for lookup answers "
        "before it moves on (an answer in time saves the request an engine step; a later "
        "one is taken at the next step)",
        zero="never wait",
        boundary="upstream mode only",
    ),
    Option(
        "begin_timeout",
        "seconds",
        60.0,
        "how long a store waits for the sidecar to accept it (BEGIN) before it is aborted",
    ),
    Option(
        "rpc_timeout",
        "seconds",
        DEFAULT_RPC_TIMEOUT,
        "timeout of each sidecar call (the scheduler's client and the workers' copy engines)",
    ),
    Option(
        "connect_timeout",
        "seconds",
        10.0,
        "how long the scheduler tries to connect to the sidecar at start-up",
    ),
    Option(
        "max_lookup_attempts",
        "integer",
        4,
        "lookups per request; after a failed restore the next lookup asks for a shorter checkpoint",
        low=1,
        high=64,
    ),
    Option(
        "copy_workers",
        "integer",
        DEFAULT_COPY_WORKERS,
        "copy threads per worker rank",
        low=1,
        high=64,
    ),
    Option(
        "max_copies_per_rank",
        "integer",
        DEFAULT_MAX_COPIES_IN_FLIGHT,
        "copies queued or running in each worker rank's copy engine (≥ `copy_workers`); "
        "the scheduler never has more tasks outstanding at the ranks, later ones (restores "
        "first) wait a step (`tasks_deferred`). Formerly `lmcache_rc.max_pending`, still "
        "accepted with a `FutureWarning` (giving both names is an error); not the sidecar's "
        "`--max-pending`",
        low=1,
        high=4096,
    ),
    Option(
        "chunk_tokens",
        "integer",
        TokenRoots.DEFAULT_CHUNK_TOKENS,
        "token-root hash unit (part of the stored format: every engine sharing a sidecar "
        "must use the same value)",
        low=1,
        high=65536,
    ),
    Option(
        "max_tasks",
        "integer",
        64,
        "copy tasks (stores + restores) outstanding per engine; beyond it stores are skipped",
        low=1,
        high=65536,
        boundary="copy tasks (stores + restores) outstanding per engine; beyond it stores are "
        "skipped and restores recompute",
    ),
    Option(
        "task_timeout",
        "seconds",
        300.0,
        "a restore not reported by every rank in time releases its request to recompute; "
        "its pages stay reserved until every rank reports",
        zero="never",
        upstream="boundary mode only (in upstream mode vLLM waits for every rank)",
    ),
    Option(
        "layout_timeout",
        "seconds",
        300.0,
        "how long the scheduler waits for every rank's page layout at start-up; after it "
        "the engine serves without the sidecar",
        zero="never",
    ),
    Option(
        "close_timeout",
        "seconds",
        180.0,
        "how long a worker's shutdown waits for its copies to drain; after it shutdown "
        "raises `UnsafeCopy` (the worker process must exit without unmapping) instead of "
        "hanging",
        zero="never",
    ),
    Option(
        "idle_flush",
        "seconds",
        0.05,
        "when the scheduler and every rank share one process (vLLM's uniprocess "
        "executor): after this long without an engine step, begun stores go straight to "
        'the ranks, so an idle engine publishes them (§A.4, "Stores of an idle or exiting '
        'engine")',
        zero="off",
        boundary="upstream mode only",
    ),
    Option(
        "kv_events_poll_interval",
        "seconds",
        0.1,
        "with vLLM's KV events on (`kv_events_config`): how often, at most, an engine that "
        "is stepping asks the sidecar's change feed what stopped being restorable (§A.9); "
        "without KV events nothing is polled",
        boundary="upstream mode only",
    ),
    Option(
        "kv_events_max_checkpoints",
        "integer",
        65536,
        "with KV events on: checkpoints an engine remembers announcing to routers; beyond "
        "it the oldest is withdrawn (a router then under-estimates, never over-estimates)",
        low=1,
        high=1 << 24,
        boundary="upstream mode only",
    ),
    Option(
        "skip_cheaper_recompute",
        "boolean",
        True,
        "skip a restore whose pages must first be loaded from a slow tier (L2, the shared "
        "tier) when that is estimated to take longer than recomputing its tokens "
        '(`restores_skipped_cheaper_to_recompute`; §A.4, "Restore only when it beats '
        'recomputing"); never without measured figures. `false`: always restore',
    ),
    Option(
        "recompute_threshold",
        "ratio",
        1.0,
        "a restore is skipped only when its estimated load time exceeds this many times "
        "the estimated recompute time (above 1: skip less, below 1: skip more)",
    ),
    Option(
        "prefill_seconds_per_token",
        "seconds",
        0.0,
        "what recomputing one prompt token costs this engine, for the skip rule",
        zero="measured from the engine's own steps",
    ),
)
"""Every option of the connector, in the order the docs list them: name,
kind (and so parser and type), default and meaning. The one written source:
:data:`OPTION_DEFAULTS`, :class:`ConnectorOptions`' defaults,
:func:`parse_options` and the option tables of ``docs/vllm.md`` (written by
``ci/gen_option_docs.py``, checked by ``ci/lint.sh``) all come from it."""

OPTION_BY_NAME: Mapping[str, Option] = {o.name: o for o in OPTIONS}

OPTION_DEFAULTS: Mapping[str, Any] = {o.name: o.default for o in OPTIONS}
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


def _default(name: str) -> Any:
    return OPTION_BY_NAME[name].default


@dataclass(frozen=True)
class ConnectorOptions:
    """The parsed ``lmcache_rc.*`` options: the typed view of :data:`OPTIONS`
    (every field past the revisions is the option of its name, its default
    the table's; a test checks they agree)."""

    socket: str
    target_revision: str
    source_revision: str
    draft_revision: str
    """Empty without speculative decoding."""
    vllm_api: str = _default("vllm_api")
    store_prompt: str = _default("store_prompt")
    store_response: bool = _default("store_response")
    lookup_timeout: float = _default("lookup_timeout")
    lookup_wait: float = _default("lookup_wait")
    begin_timeout: float = _default("begin_timeout")
    rpc_timeout: float = _default("rpc_timeout")
    connect_timeout: float = _default("connect_timeout")
    max_lookup_attempts: int = _default("max_lookup_attempts")
    copy_workers: int = _default("copy_workers")
    max_copies_per_rank: int = _default("max_copies_per_rank")
    chunk_tokens: int = _default("chunk_tokens")
    max_tasks: int = _default("max_tasks")
    task_timeout: float = _default("task_timeout")
    layout_timeout: float = _default("layout_timeout")
    close_timeout: float = _default("close_timeout")
    idle_flush: float = _default("idle_flush")
    kv_events_poll_interval: float = _default("kv_events_poll_interval")
    kv_events_max_checkpoints: int = _default("kv_events_max_checkpoints")
    skip_cheaper_recompute: bool = _default("skip_cheaper_recompute")
    recompute_threshold: float = _default("recompute_threshold")
    prefill_seconds_per_token: float = _default("prefill_seconds_per_token")


def option_table(mode: str) -> str:
    """The Markdown table of every option for ``mode`` (``upstream`` or
    ``boundary``), as ``docs/vllm.md`` carries it."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for o in OPTIONS:
        rows.append(f"| `{OPTION_PREFIX}{o.name}` | {o.shown_default()} | {o.meaning(mode)} |")
    return "\n".join(rows) + "\n"


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
    parsed = {
        o.name: o.parse(values.get(o.name, o.default))
        for o in OPTIONS
        if o.kind not in ("socket", "identity")
    }
    opts = ConnectorOptions(
        socket=os.fspath(socket),
        target_revision=target,
        source_revision=source,
        draft_revision=draft,
        **parsed,
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
