"""Shared pieces of the real-engine tests: families under test, token
sequences, and the check of record (outputs token-identical to a
connector-less engine in its own process)."""

from __future__ import annotations

import random
from typing import Any

import models
from conftest import EngineRun, Engines, Transcript, Turn

IDENTITY_FAMILIES = [f for f, spec in models.FAMILIES.items() if spec.continues_correctly]
"""Families vLLM's CPU build continues correctly from cached state (its own
prefix-caching control agrees, ``test_support.py``): tested for identity."""

MODES = {"inproc": False, "mp": True}
"""Engine modes: vLLM in this process, or its engine-core process."""

OUT = 16
"""Greedy output tokens per request."""


def tokens(seed: int, n: int, family: str) -> list[int]:
    """``n`` seeded random token ids of ``family``'s vocabulary (no special ids)."""
    rng = random.Random(seed)
    vocab = models.FAMILIES[family].vocab_size
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def block(family: str) -> int:
    """The block size vLLM chooses for ``family`` here (the checkpoint grain)."""
    return models.FAMILIES[family].block_size


TIE = {"bfloat16": 0.25, "float16": 0.1, "float32": 0.01}
"""Per model dtype, the log-probability gap (nats) under which two greedy
candidates are a numeric tie of the engine's own arithmetic (see
:func:`assert_identical`). bfloat16 logits of these tiny models are spaced
0.06-0.25 nats apart (8 significant bits), and decode-computed states differ
from prefill-computed ones by a few of their ulps."""


def reference(engines: Engines, family: str, prompts: list[list[int]], **kw: Any) -> list[Turn]:
    """Each prompt computed from scratch by a connector-less engine in a
    process of its own (one process for all, its prefix cache reset before
    each prompt): their turns, in order."""
    run = engines.run(family, [[p] for p in prompts], fresh_batches=True, **kw)
    for turn in run.turns:
        assert turn.cached == 0, "a fresh connector-less engine has nothing cached"
    return run.turns


def assert_identical(
    family: str,
    run: EngineRun,
    expected: list[Turn],
    what: str,
    *,
    exact: bool = False,
    transcript: Transcript | None = None,
) -> None:
    """The check of record: every request's output equals the reference's.

    A state restored from a checkpoint that vLLM computed by decode steps
    equals the reference's prefill-computed state only to rounding
    (``test_state_proof.py`` measures it: relative 1e-4 to 3e-2 in bfloat16,
    against > 1 for a state one token off), so where the reference's greedy
    choice was a near-tie the two may part. That is accepted only when
    ``exact`` is False and both engines' log-probability gap between their
    two best tokens at the first differing token is below :data:`TIE` for
    the family's dtype;
    everything before it must be identical, and the transcript records it.
    """
    assert len(run.turns) == len(expected), what
    for i, (turn, ref) in enumerate(zip(run.turns, expected, strict=True)):
        g, e = turn.output, ref.output
        if g == e:
            continue
        at = next(k for k in range(min(len(g), len(e))) if g[k] != e[k])
        gap = min(turn.margins[at], ref.margins[at]) if turn.margins and ref.margins else None
        tie = not exact and gap is not None and gap < TIE[models.FAMILIES[family].dtype]
        if transcript is not None:
            transcript.note(
                f"  {what}: request {i} parts from the reference at output token {at} "
                f"(best-two gap {gap} nats: {'a numeric tie' if tie else 'NOT a tie'})"
            )
        assert tie, (
            f"{what}: request {i} differs from the connector-less engine at token {at} "
            f"(best-two gap {gap} nats)\n{g}\n{e}"
        )


def log_run(transcript: Transcript, label: str, run: EngineRun) -> None:
    for i, turn in enumerate(run.turns):
        transcript.turn(f"{label}[{i}]" if len(run.turns) > 1 else label, turn)
