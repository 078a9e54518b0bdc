"""The checkpoint identity of an engine (invariant I3), and ``"auto"`` revisions.

What it owns: which facts of a vLLM engine enter the namespace
(:func:`checkpoint_identity`), and how the two revisions users find hardest
to get right are derived when the option says ``"auto"``:

* ``target_revision``: the commit of the Hugging Face cache snapshot the
  weights were loaded from (a model path ``…/snapshots/<40 hex>/``, or a hub
  id whose snapshot is in the local cache, or a 40-hex ``--revision``);
* ``source_revision``: a SHA-256 over the file hashes the installed vLLM
  wheel recorded at install time (its ``RECORD``), so two installs of the
  same vLLM agree; a file patched in place afterwards is not seen (pass an
  explicit revision for a patched install).

Anything else must be explicit; the errors say how to find the value.

What it must never do: guess. A value that cannot be proven immutable is an
error, never a fallback to a name that can move.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from pathlib import Path
from typing import Any

from lmcache_rc.vllm.options import OPTION_PREFIX, ConnectorOptions, InvalidConnectorConfig

__all__ = [
    "PRECISION_ENV_VARS",
    "checkpoint_identity",
    "resolve_draft_revision",
    "resolve_source_revision",
    "resolve_target_revision",
    "snapshot_revision",
    "vllm_distribution_digest",
]

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")

PRECISION_ENV_VARS: tuple[str, ...] = (
    "VLLM_ATTENTION_BACKEND",
    "VLLM_BATCH_INVARIANT",
    "VLLM_USE_DEEP_GEMM",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_USE_FLASHINFER_MOE_FP4",
    "VLLM_USE_FLASHINFER_MOE_FP8",
    "VLLM_FLASHINFER_MOE_BACKEND",
    "VLLM_MXFP4_USE_MARLIN",
    "VLLM_USE_TRTLLM_ATTENTION",
    "VLLM_GLM53_VISION_MXFP8",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)
"""Environment variables that change numerics; their values (unset: null) are
part of the checkpoint identity, so engines that compute differently never
share checkpoints."""


def checkpoint_identity(vllm_config: Any, options: ConnectorOptions) -> dict[str, Any]:
    """The namespace identity of this engine, without the worker layout.

    Revisions, runtime and model config hashes, the precision environment and
    the parallel geometry (``docs/design/identity.md``); ``"auto"`` revisions
    are resolved here (:func:`resolve_target_revision`,
    :func:`resolve_source_revision`). The scheduler side adds
    ``layout`` once every rank reported the same one, and the request's cache
    salt goes into :func:`lmcache_rc.checkpoint_namespace` separately.
    """
    pc = vllm_config.parallel_config
    return {
        "target_revision": resolve_target_revision(options.target_revision, vllm_config),
        "source_revision": resolve_source_revision(options.source_revision),
        "draft_revision": resolve_draft_revision(options.draft_revision, vllm_config),
        "runtime_config_hash": str(vllm_config.compute_hash()),
        "model_config_hash": str(vllm_config.model_config.compute_hash()),
        "precision_environment": {name: os.environ.get(name) for name in PRECISION_ENV_VARS},
        "parallel": {
            "tp": int(getattr(pc, "tensor_parallel_size", 1)),
            "dcp": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
            "cp_interleave": int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1),
        },
    }


def snapshot_revision(model: str, revision: str | None = None) -> str | None:
    """The 40-hex commit behind ``model``, or None when it cannot be proven.

    A local path is what vLLM loads, whatever ``revision`` says: it proves a
    commit only when it lies inside a Hugging Face cache snapshot
    (``…/snapshots/<40 hex>/``), and a ``revision`` that names another commit
    is a contradiction (None). A hub id is proven by a 40-hex ``revision``, or
    by the snapshot the local cache resolves it to (``local_files_only``).
    """
    text = str(model)
    path = Path(text)
    if path.exists():
        for candidate in (str(path.resolve()), text):
            match = _SNAPSHOT.search(candidate.replace(os.sep, "/") + "/")
            if match is not None:
                commit = match.group(1)
                if revision and _COMMIT.fullmatch(revision) and revision != commit:
                    return None
                return commit
        return None
    if revision and _COMMIT.fullmatch(revision):
        return revision
    try:
        from huggingface_hub import snapshot_download  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    try:
        local = snapshot_download(text, revision=revision, local_files_only=True)
    except Exception:
        return None
    match = _SNAPSHOT.search(str(local).replace(os.sep, "/") + "/")
    return match.group(1) if match else None


def _auto_error(key: str, why: str, how: str) -> InvalidConnectorConfig:
    return InvalidConnectorConfig(
        f"kv_connector_extra_config option {OPTION_PREFIX}checkpoint_identity.{key} is "
        f'"auto" but {why}; {how}'
    )


def resolve_target_revision(value: str, vllm_config: Any) -> str:
    """``value``, or for ``"auto"`` the weights' snapshot commit."""
    if value != "auto":
        return value
    mc = vllm_config.model_config
    model = str(getattr(mc, "model", ""))
    found = snapshot_revision(model, getattr(mc, "revision", None))
    if found is None:
        raise _auto_error(
            "target_revision",
            f"the model {model!r} is not a Hugging Face cache snapshot (…/snapshots/<40 hex>/) "
            "and no such snapshot is in the local cache",
            "pass the weights' commit explicitly (the directory name under snapshots/, "
            "`huggingface-cli scan-cache -v`, or the repository's commit on the hub)",
        )
    return found


def resolve_draft_revision(value: str, vllm_config: Any) -> str:
    """``value``, or for ``"auto"`` the draft model's snapshot commit."""
    if value != "auto":
        return value
    spec = getattr(vllm_config, "speculative_config", None)
    model = getattr(spec, "model", None) if spec is not None else None
    if model is None:
        model = getattr(vllm_config.model_config, "model", "")  # MTP: the target's own weights
    found = snapshot_revision(str(model), getattr(spec, "revision", None))
    if found is None:
        raise _auto_error(
            "draft_revision",
            f"the draft model {model!r} is not a Hugging Face cache snapshot",
            "pass the draft weights' commit explicitly",
        )
    return found


def vllm_distribution_digest(distribution: str = "vllm") -> str | None:
    """SHA-256 (64 hex) over the sorted ``path,hash`` lines of the installed
    distribution's ``RECORD``; None when it is not installed from a wheel
    (no RECORD, or files without hashes, as in an editable install)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = dist.files or []
    lines: list[str] = []
    for f in files:
        if f.hash is None:
            if str(f).endswith((".pyc", "RECORD", "INSTALLER", "REQUESTED", "direct_url.json")):
                continue
            return None
        lines.append(f"{f},{f.hash.mode}={f.hash.value}")
    if not lines:
        return None
    digest = hashlib.sha256()
    digest.update(f"{distribution}=={dist.version}\n".encode())
    for line in sorted(lines):
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def resolve_source_revision(value: str) -> str:
    """``value``, or for ``"auto"`` the digest of the installed vLLM."""
    if value != "auto":
        return value
    found = vllm_distribution_digest()
    if found is None:
        raise _auto_error(
            "source_revision",
            "the installed vLLM has no wheel RECORD with file hashes (an editable or "
            "source install)",
            "pass the commit of your vLLM source tree explicitly (`git rev-parse HEAD` in it)",
        )
    return found
