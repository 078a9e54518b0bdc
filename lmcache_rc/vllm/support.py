"""Model families a vLLM build is known to continue wrongly from a cached state.

Why: a checkpoint can only be as right as the engine's continuation from it.
Where vLLM itself gives different outputs after its *own* prefix-cache hit
than after computing the same prompt from scratch, a restore would too, and
no test could tell our errors from vLLM's. The real-engine suite
(``tests_engine/test_support.py``) runs that control — t1 then t2 in one engine
against t2 alone — for every family it exercises on the installed build, and
fails when this table disagrees with what it measured.

What it owns: :data:`KNOWN_WRONG` and :func:`refusal`, which the connector
consults once at construction: a match disables it with one log line naming
the model type, the build and the reason (``docs/vllm.md``, support matrix).

What it must never do: refuse on a guess (each entry names the control that
showed it), or import vLLM at module import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KNOWN_WRONG", "KnownWrong", "build_of", "refusal"]


@dataclass(frozen=True)
class KnownWrong:
    """Model types one vLLM build continues wrongly from cached state."""

    model_types: tuple[str, ...]
    platform: str
    """``"cpu"`` (vLLM's CPU build) or ``"cuda"``."""
    versions: tuple[str, ...]
    """``vllm.__version__`` prefixes (``"0.32."``)."""
    why: str


KNOWN_WRONG: tuple[KnownWrong, ...] = (
    KnownWrong(
        model_types=("lfm2", "lfm2_moe"),
        platform="cpu",
        versions=("0.32.",),
        why=(
            "vLLM's CPU build computes the short-conv models wrongly: their outputs differ "
            "from transformers' and change with the block size, and its own prefix caching "
            "continues them differently from a recomputation, so a restored checkpoint "
            "would too"
        ),
    ),
)
"""What the real-engine suite's prefix-caching control measured, per build."""


def build_of() -> tuple[str, str] | None:
    """``(platform, version)`` of the installed vLLM, or None without one."""
    try:
        import vllm  # type: ignore[import-not-found, unused-ignore]
        from vllm.platforms import (  # type: ignore[import-not-found, unused-ignore]
            current_platform,
        )
    except Exception:
        return None
    platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_type or "")
    return platform, str(getattr(vllm, "__version__", ""))


def refusal(vllm_config: Any, build: tuple[str, str] | None = None) -> str | None:
    """Why the connector must not run for this model on this vLLM build, or None."""
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    model_type = str(getattr(hf_config, "model_type", "") or "")
    if not model_type:
        return None
    build = build if build is not None else build_of()
    if build is None:
        return None
    platform, version = build
    for entry in KNOWN_WRONG:
        if (
            model_type in entry.model_types
            and platform == entry.platform
            and any(version.startswith(v) for v in entry.versions)
        ):
            return (
                f"model type {model_type!r} is not supported on vLLM {version} ({platform}): "
                f"{entry.why} (docs/vllm.md, support matrix)"
            )
    return None
