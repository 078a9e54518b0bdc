"""Configuration of the checkpoint sidecar: :class:`ServerConfig`.

Every setting is declared once, with its kind, default and documentation, in
``rust/core/src/config.rs``; :class:`ServerConfig` is that declaration as a
Python class (``lmcache_rc._native.ServerConfig``). Every setting is also a
``lmcache-rc serve`` flag (underscores become dashes; generated from
:meth:`ServerConfig.fields`) and an environment variable
``LMCACHE_RC_<SETTING>`` (upper case, read by :meth:`ServerConfig.from_env`).

The class is strict and immutable: an unknown setting or a value of the wrong
type raises :class:`~lmcache_rc.errors.InvalidType` (a ``TypeError``), a value
out of range :class:`~lmcache_rc.errors.InvalidInput` (a ``ValueError``).
Sizes are written ``8G``, ``512MiB`` or ``1.5GiB`` (every unit binary) in flags,
variables and ``ServerConfig(l1_bytes="8G")`` alike; durations ``30``, ``30s``,
``5m`` or ``36h`` (:func:`parse_duration`; plain numbers are seconds), and
read back as seconds. Defaults need no flags: the
socket lives under the user's runtime directory, the directory in memory
(``--checkpoint-index-path`` makes it durable; missing folders above it are
created, 0700), and the shared-memory pool takes at most a quarter of the
available memory (up to 1 GiB). The pool has no name: it is an
anonymous memfd the sidecar hands to each client over its socket, so two
servers on one host never collide (``shm_name`` is accepted for old
configurations, ignored, and warned about).
"""

from __future__ import annotations

import os
from pathlib import Path

from lmcache_rc import _native
from lmcache_rc._native import ServerConfig

__all__ = [
    "ServerConfig",
    "default_index_path",
    "default_l1_bytes",
    "default_socket_path",
    "human_size",
    "parse_duration",
]


def default_socket_path() -> str:
    """The sidecar socket used when none is configured."""
    return _native.default_socket_path()


def default_l1_bytes() -> int:
    """A quarter of the available memory, at most 1 GiB, at least 16 MiB."""
    return _native.default_l1_bytes()


def human_size(n: int) -> str:
    """A size for people in binary units (``8.0 GiB``, ``100 bytes``), as
    the core's messages print sizes. Sizes are *read* in the grammar of
    ``docs/configuration.md`` (``8G``, ``512MiB``)."""
    return _native.human_size(n)


def parse_duration(text: str) -> float:
    """Seconds in a duration: a number of seconds (``30``, ``2.5``) or a
    number with a unit ``ms``, ``s``, ``m``, ``h``, ``d`` or ``w`` (``30s``,
    ``5m``, ``36h``, ``1.5d``). Every duration setting — flags, variables,
    ``ServerConfig(...)``, ``shared gc --older-than`` — reads this grammar,
    parsed once by the core (``parse_duration`` in ``rust/core/src/units.rs``).
    Raises :class:`~lmcache_rc.errors.InvalidInput` (a ``ValueError``)."""
    return _native.parse_duration(text)


def default_index_path() -> str:
    """A durable directory location under the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "lmcache-rc" / "checkpoints.sqlite")
