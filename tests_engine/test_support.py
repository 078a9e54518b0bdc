"""vLLM's own prefix-caching control, per model family on the installed build.

A family whose t2 output after a local prefix-cache hit (t1 then t2 in one
engine) differs from t2 computed from scratch is continued wrongly by vLLM
itself: no connector could restore it right, and no output comparison could
tell our errors from vLLM's. The connector's table of such families
(``lmcache_rc.vllm.support.KNOWN_WRONG``) must agree with what this measures,
and for a refused family the connector disables itself with one log line.
"""

from __future__ import annotations

from types import SimpleNamespace

import models
import pytest
from conftest import Engines, Sidecar, Transcript, Turn
from scenarios import OUT, TIE, block, tokens

from lmcache_rc.vllm import support

SEEDS = (300, 310, 320)


def control(engines: Engines, family: str) -> list[tuple[bool, int]]:
    """Per conversation: (identical, local hit) of t2 after t1 in one engine
    against t2 computed from scratch (the prefix cache reset in between)."""
    bs = block(family)
    firsts = [tokens(seed, 3 * bs + bs // 2, family) for seed in SEEDS]
    outs = engines.run(family, [[t] for t in firsts], fresh_batches=True)
    batches: list[list[list[int]]] = []
    resets: list[int] = []
    for seed, t1, turn in zip(SEEDS, firsts, outs.turns, strict=True):
        t2 = t1 + turn.output + tokens(seed + 1, 30, family)
        resets.extend([len(batches), len(batches) + 2])
        batches += [[t1], [t2], [t2]]
    run = engines.run(family, batches, reset_before=resets)
    results = []
    for k in range(len(SEEDS)):
        together, alone = run.batches[3 * k + 1][0], run.batches[3 * k + 2][0]
        assert together.cached > 0, "t2 got no local hit: the control proves nothing"
        assert alone.cached == 0
        results.append((agrees(family, together, alone), together.cached))
    return results


def agrees(family: str, got: Turn, ref: Turn) -> bool:
    """Identical, or parting only at a numeric tie (``scenarios.TIE``): the
    same rule the connector's outputs are held to."""
    if got.output == ref.output:
        return True
    at = next(k for k in range(len(got.output)) if got.output[k] != ref.output[k])
    gap = min(got.margins[at], ref.margins[at])
    return gap < TIE[models.FAMILIES[family].dtype]


@pytest.mark.parametrize("family", list(models.FAMILIES))
def test_vllm_prefix_caching_control_agrees_with_the_support_table(
    family: str, engines: Engines, transcript: Transcript
) -> None:
    results = control(engines, family)
    correct = all(same for same, _ in results)
    build = support.build_of()
    assert build is not None
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(model_type=models.FAMILIES[family].model_type)
        )
    )
    refused = support.refusal(config, build)
    transcript.note(
        f"{family} on vLLM {build[1]} ({build[0]}): vLLM's own prefix caching "
        f"{'continues correctly' if correct else 'continues WRONGLY'} "
        f"({sum(s for s, _ in results)} of {len(results)} identical; "
        f"local hits {[h for _, h in results]}); "
        f"connector {'refuses' if refused else 'serves'} it"
    )
    assert (refused is None) == correct, (family, results, refused)
    assert models.FAMILIES[family].continues_correctly == correct, (
        f"{family}: models.FAMILIES says continues_correctly="
        f"{models.FAMILIES[family].continues_correctly}, the control measured {correct}"
    )


@pytest.mark.parametrize(
    "family", [f for f, s in models.FAMILIES.items() if not s.continues_correctly]
)
def test_refused_family_disables_the_connector_with_one_line(
    family: str, sidecar: Sidecar, engines: Engines
) -> None:
    bs = block(family)
    t1 = tokens(330, 2 * bs + 3, family)
    first = engines.run(family, [[t1]], socket=sidecar.socket)
    t2 = t1 + first.turns[0].output + tokens(331, 20, family)
    second = engines.run(family, [[t2]], socket=sidecar.socket)
    assert second.turns[0].cached == 0
    assert sidecar.generations() == []
    lines = [ln for ln in second.stderr.splitlines() if "lmcache-rc connector disabled" in ln]
    assert len(lines) == 1, second.stderr[-3000:]
    assert f"model type {models.FAMILIES[family].model_type!r}" in lines[0]
    assert OUT > 0
