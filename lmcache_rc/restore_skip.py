"""``lmcache-rc restore-skip``: the skip rule on a slow shared tier, end to end.

Two embedded sidecars share one tier on a local directory (``file://``);
the second one reaches it through an injected latency per request (the
test-only ``shared_inject_latency``, 50 ms by default), like a distant
object store. Host A runs a simulated engine (:class:`~lmcache_rc.testing.SimEngine`,
the real connector in boundary mode) over one short and two long prompts
and uploads their checkpoints. Host B has nothing of its own and an engine
whose recompute cost is configured (``lmcache_rc.prefill_seconds_per_token``);
it runs each prompt again, extended, in this order: a long one (no load
has been measured yet, so it restores — and measures), the short one
(loading it costs at least one fetch latency, more than recomputing its few
tokens: skipped and recomputed), the other long one (loading costs a few
fetch latencies, recomputing costs much more: restored).

For each request it prints the checkpoint's tokens, pages and tier, the
connector's estimates (restore vs recompute) and its decision, the tokens
actually restored and recomputed, then the counts
(``restores_skipped_cheaper_to_recompute``, restores published) and host B's
measured shared-tier figures. Every restored page is verified by the
simulated ranks and every output compared with a recomputation (the
engine's own checks); :func:`run_restore_skip` raises if a decision is not
the expected one. ``docs/vllm.md`` ("Restore only when it beats
recomputing") explains the rule; ``docs/operations.md`` shows the output.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import lmcache_rc as rc

__all__ = ["SkipReport", "SkipRow", "main", "run_restore_skip"]

BLOCK = 256
"""Tokens per attention page of the simulated model (large, as hybrid models'
attention blocks are in vLLM: each page is one fetch)."""


@dataclass
class SkipRow:
    """One request on host B."""

    name: str
    prompt_tokens: int
    checkpoint_tokens: int
    """Tokens of the checkpoint found (what a restore would add)."""
    tier_bytes: dict[str, int]
    pages: int
    restore_s: float | None
    """The connector's estimate of loading the pages (None: nothing measured yet)."""
    recompute_s: float | None
    decision: str
    """``restore`` or ``recompute`` (skipped: cheaper to recompute)."""
    restored_tokens: int
    recomputed_tokens: int


@dataclass
class SkipReport:
    """What a run showed."""

    latency_s: float
    prefill_seconds_per_token: float
    rows: list[SkipRow] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    """The connector's counters on host B."""
    shared_figures: dict[str, int] = field(default_factory=dict)
    """Host B's ``shared_load_*`` status values."""

    def as_dict(self) -> dict[str, Any]:
        """Plain data."""
        return asdict(self)


def _wait_uploads(client: rc.Client, generations: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        st = client.status()
        done = st["shared_manifests_written"] + st["shared_manifests_present"]
        if done >= generations and st["shared_upload_queue"] == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"host A's uploads did not finish: {dict(st)}")
        time.sleep(0.02)


def _server(root: Path, name: str, shared: Path, latency: float) -> rc.Server:
    config = rc.ServerConfig(
        socket=str(root / f"{name}.sock"),
        l1_bytes=64 << 20,
        http_port=-1,
        shared_url=f"file://{shared}",
        shared_lookup_timeout=30.0,
        shared_inject_latency=latency,
    )
    return rc.Server.start(config, temp_socket=True)


def run_restore_skip(
    *,
    latency: float = 0.05,
    prefill_seconds_per_token: float = 0.001,
    short_tokens: int = 16,
    long_tokens: int = 2048,
    workdir: str | None = None,
    skip: bool = True,
    check: bool = True,
) -> SkipReport:
    """Runs the scenario of the module docs; returns what host B did.

    With ``check`` (the default) a decision other than restore, recompute,
    restore for the three requests raises ``AssertionError``; the defaults
    make the gap so wide that the decisions do not depend on timing (the
    short prefix's recompute is a third of one fetch latency, the long
    one's restore a few latencies against seconds of recompute). ``skip``
    False turns the rule off on host B (``lmcache_rc.skip_cheaper_recompute``):
    then every request restores.
    """
    from lmcache_rc.testing import FullAttentionSpec, HybridGeometry, MambaSpec, SimEngine

    geometry = HybridGeometry(
        groups=(FullAttentionSpec(BLOCK), MambaSpec(BLOCK)), page_bytes=16 << 10
    )
    prompts = {
        "long-1": [(7 * i + 1) % 900 for i in range(long_tokens)],
        "short": [(11 * i + 5) % 900 for i in range(short_tokens)],
        "long-2": [(13 * i + 3) % 900 for i in range(long_tokens)],
    }
    extension = [901, 902, 903, 904, 905, 906, 907, 908]
    report = SkipReport(latency, prefill_seconds_per_token)
    with tempfile.TemporaryDirectory(prefix="lmcache-rc-skip-", dir=workdir) as tmp:
        root = Path(tmp)
        shared = root / "shared"
        shared.mkdir()
        host_a = _server(root, "a", shared, 0.0)
        try:
            with rc.Client(host_a.socket_path) as client:
                engine = SimEngine(
                    host_a.socket_path, geometry=geometry, num_blocks=64, max_num_batched_tokens=512
                )
                try:
                    for name, prompt in prompts.items():
                        engine.generate(f"a-{name}", prompt, 2)
                    engine.assert_idle()
                finally:
                    engine.close()
                _wait_uploads(client, client.status()["generations"])
        finally:
            host_a.stop()
        host_b = _server(root, "b", shared, latency)
        try:
            engine = SimEngine(
                host_b.socket_path,
                geometry=geometry,
                num_blocks=64,
                max_num_batched_tokens=512,
                extra_config={
                    "lmcache_rc.prefill_seconds_per_token": prefill_seconds_per_token,
                    "lmcache_rc.skip_cheaper_recompute": skip,
                },
            )
            try:
                for name, prompt in prompts.items():
                    result = engine.generate(f"b-{name}", prompt + extension, 2)
                    cost = engine.connector.report_status()["restore_cost"]
                    recent = cost["recent"][-1] if cost["recent"] else {}
                    if skip and recent.get("request_id") != f"b-{name}":
                        raise AssertionError(f"no restore was weighed for {name}: {cost}")
                    if recent.get("skip") and result.restored_tokens:
                        raise AssertionError(f"{name} restored after its restore was skipped")
                    report.rows.append(
                        SkipRow(
                            name=name,
                            prompt_tokens=len(prompt) + len(extension),
                            checkpoint_tokens=int(recent.get("tokens", 0)),
                            tier_bytes=dict(recent.get("tiers", {})),
                            pages=int(recent.get("pages", 0)),
                            restore_s=recent.get("restore_s"),
                            recompute_s=recent.get("recompute_s"),
                            decision=(
                                "recompute"
                                if recent.get("skip") or not result.restored_tokens
                                else "restore"
                            ),
                            restored_tokens=result.restored_tokens,
                            recomputed_tokens=result.recomputed_tokens,
                        )
                    )
                engine.assert_idle()
                report.counters = dict(engine.connector.report_status()["counters"])
            finally:
                engine.close()
            status = host_b.status()
            report.shared_figures = {
                k: v
                for k, v in status.items()
                if k.startswith("shared_load_") and isinstance(v, int)
            }
        finally:
            host_b.stop()
    if check:
        decisions = [row.decision for row in report.rows]
        expected = ["restore", "recompute", "restore"] if skip else ["restore"] * 3
        if decisions != expected:
            raise AssertionError(f"unexpected decisions {decisions}: {report.as_dict()}")
    return report


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def print_report(report: SkipReport, out: TextIO = sys.stdout) -> None:
    """The table and the counts, as ``docs/operations.md`` shows them."""
    print(
        f"shared tier with {report.latency_s * 1000:g} ms injected latency per request; "
        f"recompute cost {report.prefill_seconds_per_token * 1000:g} ms per token",
        file=out,
    )
    print(
        f"{'request':<8} {'prompt':>6} {'ckpt':>6} {'pages':>5} {'tier':<7} "
        f"{'est. restore':>12} {'est. recompute':>14}  {'decision':<9} "
        f"{'restored':>8} {'recomputed':>10}",
        file=out,
    )
    for row in report.rows:
        tier = "+".join(sorted(row.tier_bytes)) or "-"
        print(
            f"{row.name:<8} {row.prompt_tokens:>6} {row.checkpoint_tokens:>6} {row.pages:>5} "
            f"{tier:<7} {_seconds(row.restore_s):>12} {_seconds(row.recompute_s):>14}  "
            f"{row.decision:<9} {row.restored_tokens:>8} {row.recomputed_tokens:>10}",
            file=out,
        )
    c = report.counters
    print(
        "counts: restores_skipped_cheaper_to_recompute="
        f"{c.get('restores_skipped_cheaper_to_recompute', 0)} "
        f"restores_published={c.get('restores_published', 0)} "
        f"tokens_recomputed_instead={c.get('tokens_recomputed_instead', 0)}",
        file=out,
    )
    f = report.shared_figures
    print(
        f"host B measured: shared_load_latency_us={f.get('shared_load_latency_us', 0)} "
        f"shared_load_bytes_per_s={f.get('shared_load_bytes_per_s', 0)} "
        f"shared_load_samples={f.get('shared_load_samples', 0)}",
        file=out,
    )


def main(*, as_json: bool = False, out: TextIO = sys.stdout) -> int:
    """``lmcache-rc restore-skip``: runs the scenario with its defaults and
    prints it (0, or 1 when a decision was not the expected one)."""
    import json

    try:
        report = run_restore_skip()
    except AssertionError as e:
        print(f"lmcache-rc restore-skip: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(report.as_dict(), indent=1), file=out)
    else:
        print_report(report, out)
    return 0
