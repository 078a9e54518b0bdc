"""The ``lmcache-rc`` command line (also ``python -m lmcache_rc``).

Sub-commands:

- ``serve``: run the checkpoint sidecar in the foreground until SIGTERM/SIGINT
  (then drain and exit 0). Every :class:`~lmcache_rc.config.ServerConfig` setting
  is a flag (``--l1-bytes``...; generated, with its help, from
  ``ServerConfig.fields()``) and an environment variable (``LMCACHE_RC_L1_BYTES``).
- ``status [--json]``, ``inspect [--json]``: talk to a running sidecar over
  its socket.
- ``clear [--force | --no-force] [--all-tiers] [--json]``: drop cached pages.
  Forced unless ``--no-force`` (the reference's default; refused, exit 4,
  while leases are live). Goes through the sidecar's HTTP admin API with the
  bearer token of its admin file ``<socket>.admin.json`` when it has one (see
  :mod:`lmcache_rc.admin`), else over the socket.
- ``identity``: print the namespace, token roots and generation id of a prompt.
- ``demo``: run a self-contained multi-turn workload on the simulated engine
  against an embedded sidecar, restart it, and verify every restore byte for
  byte (see :mod:`lmcache_rc.demo`).
- ``bench``: the transfer engine's store/restore throughput against memcpy
  (see :mod:`lmcache_rc.bench`).
- ``trace generate chat|agentic [--seed N] [--sessions N] [-o FILE]``: write a
  synthetic multi-turn trace (JSON lines); ``trace replay FILE|chat|agentic
  [--policy lru|cost|both] [--l1 SIZE --l2 SIZE | --sizes L1:L2,...]``: replay
  it against embedded sidecars and compare eviction policies by tokens
  restored, prefill compute saved and bytes written (see
  :mod:`lmcache_rc.trace`).
- ``serve-bench --url URL``: a multi-turn load (concurrent conversations that
  share system prompts) against an OpenAI-compatible vLLM server: time to first
  token, prefill tokens computed, hit rate and throughput (see
  :mod:`lmcache_rc.serving`).
- ``restore-skip [--json]``: the skip rule on a shared tier with an
  injected 50 ms latency: short prefixes recomputed, long ones restored,
  with the estimates, decisions and counts (see :mod:`lmcache_rc.restore_skip`).
- ``shared gc --shared-url URL --older-than DURATION [--json]``: remove old
  manifests from the shared tier, then the pages no remaining manifest names
  (see :mod:`lmcache_rc.shared`).

Exit codes (also in ``docs/operations.md``): 0 success, 1 operation failed,
2 bad input (a usage error: a flag, an ``LMCACHE_RC_*`` variable, a setting),
3 sidecar unreachable, 4 refused (e.g. a forced clear while leases are live),
130 interrupted (Ctrl-C), 141 output closed early (``lmcache-rc status | head``).
No traceback reaches the terminal for any of these; an unexpected failure
prints one line and exits 1 (``LMCACHE_RC_DEBUG=1`` shows its traceback).
Sizes are printed in binary units (``8.0 GiB``); ``--json`` keeps raw integers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import lmcache_rc as rc
from lmcache_rc import admin
from lmcache_rc.config import ServerConfig, human_size
from lmcache_rc.results import ClearReport

SAMPLE_IDENTITY: dict[str, Any] = {
    "target_revision": "0123456789abcdef0123456789abcdef01234567",
    "draft_revision": "",
    "source_revision": "89abcdef0123456789abcdef0123456789abcdef",
    "layout": {"page_bytes": 4096, "groups": [{"kind": "attention", "block_size": 16}]},
    "parallel": {"tp": 1, "dcp": 1},
}
SAMPLE_TEXT = "You are a helpful assistant. Summarise the following document."


class UsageError(ValueError):
    """Bad input on the command line (exit 2): the message names the flag
    and shows an accepted value."""


TOKENS_EXAMPLE = "--tokens '[1, 2, 3]'"


def _parse_tokens(text: str) -> list[int]:
    """``--tokens``: a JSON list of integer token ids."""
    try:
        tokens = json.loads(text)
    except ValueError:
        tokens = None
    if not isinstance(tokens, list):
        raise UsageError(
            f"--tokens must be a JSON list of token ids (integers), e.g. {TOKENS_EXAMPLE}; "
            f"got {text!r}"
        )
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int):
            raise UsageError(
                f"--tokens: token ids must be integers, got {json.dumps(token)} at index {i} "
                f"(e.g. {TOKENS_EXAMPLE})"
            )
    return tokens


def _parse_identity(text: str) -> Any:
    """``--identity``: a JSON object (checked further by the core)."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(
            f"--identity must be a JSON object such as {json.dumps(SAMPLE_IDENTITY)}; "
            f"it is not JSON ({exc})"
        ) from None


def _text_tokens(text: str) -> list[int]:
    """Toy tokenizer for the sample: one token per UTF-8 byte (stable, no downloads)."""
    return list(text.encode("utf-8"))


def _identity_report(args: argparse.Namespace) -> dict[str, Any]:
    identity = _parse_identity(args.identity) if args.identity else SAMPLE_IDENTITY
    tokens = _parse_tokens(args.tokens) if args.tokens is not None else _text_tokens(args.text)
    namespace = rc.checkpoint_namespace(identity, args.salt)
    roots = rc.TokenRoots.build(namespace, tokens, args.chunk_tokens)
    report: dict[str, Any] = {
        "namespace": namespace,
        "num_tokens": len(roots),
        "chunk_tokens": roots.chunk_tokens,
        "roots": [
            {
                "start_tokens": r.start_tokens,
                "prefix_hash": r.prefix_hash.hex(),
                "tail_len": len(r.tail_tokens),
            }
            for r in roots.roots
        ],
    }
    if len(roots):
        prefix = roots.prefix(len(roots))
        payload = json.dumps({"schema_version": 1}, separators=(",", ":")).encode()
        report["generation"] = rc.checkpoint_generation(prefix, payload)
    return report


def _cmd_identity(args: argparse.Namespace) -> int:
    report = _identity_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"namespace:   {report['namespace']}")
    print(f"tokens:      {report['num_tokens']} (chunk {report['chunk_tokens']})")
    for i, r in enumerate(report["roots"]):
        print(
            f"root {i}:      start {r['start_tokens']}, tail {r['tail_len']} tokens, "
            f"prefix hash {r['prefix_hash'][:16]}..."
        )
    if "generation" in report:
        print(f"generation:  {report['generation']}  (whole prompt, payload {{schema_version:1}})")
    return 0


_KIND_HINTS = {
    "bytes": "a size: bytes, or a number with a binary unit K/KiB, M/MiB, G/GiB, T/TiB, e.g. 8GiB",
    "seconds": "a duration: seconds, or a number with a unit ms/s/m/h/d/w, e.g. 30s, 5m, 2.5",
}


def human_duration(seconds: int) -> str:
    """An uptime for people: ``45s``, ``3m 05s``, ``2h 03m``, ``4d 01h``."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def _flag_parser(name: str, kind: str) -> Callable[[str], object]:
    """Parses a flag's text as the setting ``name`` (argparse ``type=``); a
    bad value is an argparse error naming the flag, with an example."""

    def parse(text: str) -> object:
        try:
            return ServerConfig.parse(name, text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = kind
    return parse


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig setting, help from its documentation. A flag
    not given is absent from the namespace: the environment, then the
    setting's default, apply."""
    for name, kind, optional, doc in ServerConfig.fields():
        hints = [h for h in (_KIND_HINTS.get(kind), "or none" if optional else None) if h]
        hint = f" ({'; '.join(hints)})" if hints else ""
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=_flag_parser(name, kind),
            default=argparse.SUPPRESS,
            metavar="DURATION" if kind == "seconds" else kind.upper(),
            help=doc + hint,
        )


def _config_from(args: argparse.Namespace) -> ServerConfig:
    """Defaults, then the environment, then the flags given (``none`` unsets)."""
    given = {name: getattr(args, name) for name, *_ in ServerConfig.fields() if hasattr(args, name)}
    unset = {name: None for name, value in given.items() if value is None}
    return ServerConfig.from_env(**given).replace(**unset)


def _stop_text(report: dict[str, Any]) -> str:
    """A shutdown report (``Server.stop()``) as one sentence."""
    if report.get("drained", True):
        text = "every lease finished"
    else:
        text = f"{report.get('live_leases', 0)} lease(s) still live after the drain timeout"
    error = report.get("close_error")
    return text + (f"; closing the service failed: {error}" if error else "")


def _cmd_serve(args: argparse.Namespace) -> int:
    # The core logs start-up progress (L2 scan) and warnings at INFO and above.
    logging.basicConfig(level=logging.INFO, format="lmcache-rc: %(message)s")
    config = _config_from(args)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        print(f"lmcache-rc: {signal.Signals(signum).name} received, draining...", flush=True)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"lmcache-rc {rc.__version__}: starting sidecar", flush=True)
    server = rc.Server.start(config, temp_socket=False)
    caps = rc.Client(server.socket_path).capabilities()
    print(f"  socket      {server.socket_path}", flush=True)
    print(
        f"  shm pool    {human_size(caps['pool_size'])} (memfd {caps['pool_id']})",
        flush=True,
    )
    print(f"  directory   {config.checkpoint_index_path or 'in memory (not durable)'}", flush=True)
    l2 = config.l2_path
    if l2:
        cap = "unlimited" if config.l2_bytes is None else f"at most {human_size(config.l2_bytes)}"
        print(f"  l2          {l2} ({cap})", flush=True)
    else:
        print("  l2          none (RAM only)", flush=True)
    print(f"  shared      {config.shared_url or 'none'}", flush=True)
    if server.http_url:
        print(f"  http admin  {server.http_url}", flush=True)
    print("ready", flush=True)
    while not stop.wait(0.5):
        pass
    report = dict(server.stop())
    if report.get("close_error"):
        print(f"lmcache-rc: stopped: {_stop_text(report)}", file=sys.stderr, flush=True)
        return 1
    print(f"lmcache-rc: stopped cleanly ({_stop_text(report)})", flush=True)
    return 0


def _socket(args: argparse.Namespace) -> str:
    """The sidecar's socket: ``--socket``, else the environment or default."""
    socket: str = args.socket or ServerConfig.from_env().socket
    return socket


def _client(args: argparse.Namespace) -> rc.Client:
    return rc.Client(_socket(args))


# The facts `status` prints first, in this order (the rest are counters).
_STATUS_FACTS = (
    ("version", "version"),
    ("uptime", "uptime_seconds"),
    ("socket", "socket"),
    ("pool size", "l1_capacity"),
    ("pool used", "l1_bytes"),
    ("index", "checkpoint_index_path"),
    ("l2 path", "l2_path"),
)


def _is_size(key: str) -> bool:
    """Whether a status value counts bytes (printed in binary units)."""
    return key.endswith(("_bytes", "_capacity")) or "_bytes_" in key


def _status_value(key: str, value: Any) -> str:
    if value is None:
        return "none"
    if key == "uptime_seconds":
        return human_duration(value)
    if key == "checkpoint_index_path" and not value:
        return "in memory (not durable)"
    if isinstance(value, int) and key.endswith("_bytes_per_s"):
        return f"{human_size(value)}/s" if value else "0 (not measured)"
    if isinstance(value, int) and _is_size(key):
        return human_size(value)
    return str(value)


COST_PREFIXES = ("hook_", "copy_", "copies_")
"""The connector's cost counters (``lmcache_rc.vllm.stats.COST_PREFIXES``,
not imported here: that module imports vLLM, which `status` must not wait for)."""


def _engines(client: Any) -> list[dict[str, Any]]:
    """The attached engines' last reports (none from a sidecar too old to keep them)."""
    try:
        return [dict(e) for e in client.engines()]
    except rc.errors.ProtocolError:
        return []


def _print_engines(engines: list[dict[str, Any]], width: int) -> None:
    """Each engine's counters that explain its restores (the cost counters,
    ``hook_*``/``copy_*``, only in ``--json``)."""
    print()
    print(f"{'engines':<{width}}  {len(engines) or 'none'} reporting")
    for engine in engines:
        print(f"  {engine['engine']} (reported {engine['age_ms'] / 1000:.1f} s ago)")
        shown = [
            f"{k} {v}"
            for k, v in sorted(engine["counters"].items())
            if v and not k.startswith(COST_PREFIXES)
        ]
        line = "   "
        for item in shown:
            if len(line) + len(item) > 98:
                print(line)
                line = "   "
            line += f" {item},"
        if shown:
            print(line.rstrip(","))


def _cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    status: dict[str, Any] = dict(client.status())
    engines = _engines(client)
    if args.json:
        print(json.dumps({**status, "engines": engines}, sort_keys=True))
        return 0
    facts = [(label, _status_value(key, status.get(key))) for label, key in _STATUS_FACTS]
    if status.get("l2_path"):
        facts.append(("l2 used", _status_value("l2_bytes", status.get("l2_bytes", 0))))
    shown = {key for _, key in _STATUS_FACTS} | {"misses"}
    counters = {k: v for k, v in status.items() if k not in shown}
    width = max(len(k) for k in [*counters, *(label for label, _ in facts)])
    for label, text in facts:
        print(f"{label:<{width}}  {text}")
    print()
    for key, value in sorted(counters.items()):
        print(f"{key:<{width}}  {_status_value(key, value)}")
    misses: dict[str, int] = status.get("misses") or {}
    if misses:
        print(f"{'misses':<{width}}")
        for reason, count in sorted(misses.items()):
            print(f"  {reason:<{width - 2}}  {count}")
    else:
        print(f"{'misses':<{width}}  none")
    _print_engines(engines, width)
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    socket = _socket(args)
    endpoint = admin.read_admin_file(socket)
    # Reach the sidecar (and learn whether it has a disk tier) before saying
    # what is being cleared.
    has_l2 = bool(rc.Client(socket).status().get("l2_path"))
    what = "RAM (L1)"
    if args.all_tiers:
        what += " and disk (L2)" if has_l2 else " (no disk tier (L2) is configured)"
    how = "kept: pages in use" if args.force is False else "forced"
    via = f"HTTP admin {endpoint.url}" if endpoint else f"socket {socket}"
    print(f"clearing {what} ({how}) via {via}...", file=sys.stderr)
    # force None (no flag) is left to the sidecar's one default: forced.
    report: ClearReport
    if endpoint is not None:
        report = admin.clear(endpoint, force=args.force, all_tiers=args.all_tiers)
    else:
        report = rc.Client(socket).clear(force=args.force, all_tiers=args.all_tiers)
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(f"RAM (L1): {report['l1_objects']} object(s), {human_size(report['l1_bytes'])} freed")
    if has_l2:
        print(f"disk (L2): {report['l2_objects']} file(s) deleted")
    print(f"generations retired: {report['retired_generations']}")
    print(f"kept (in use): {report['kept_objects']} object(s)")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    rows = _client(args).list_generations()
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return 0
    if not rows:
        print("no published generations")
        return 0
    print(f"{'generation':<40} {'tokens':>8} {'ranks':>5} {'size':>12} durable")
    for r in rows:
        print(
            f"{r['generation'][:40]:<40} {r['num_tokens']:>8} {r['world_size']:>5} "
            f"{human_size(r['payload_bytes']):>12} {'yes' if r['durable'] else 'no'}"
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import os

    from lmcache_rc.demo import CORRUPT_ENV, DemoOptions, run_demo

    options = DemoOptions(
        turns=args.turns,
        requests=args.requests,
        world_size=args.world_size,
        rank_mode=args.rank_mode,
        replicas=args.replicas,
        keep=args.keep,
        socket=args.socket,
        json=args.json,
        corrupt=os.environ.get(CORRUPT_ENV, "") not in ("", "0"),
    )
    return run_demo(options)


def _cmd_bench(args: argparse.Namespace) -> int:
    from lmcache_rc.bench import main as bench_main

    for name in ("mib", "page_kib", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    return bench_main(args.mib, args.page_kib, args.rounds, args.json, args.socket)


def _cmd_trace_generate(args: argparse.Namespace) -> int:
    from lmcache_rc import trace

    if args.sessions is not None and args.sessions < 1:
        raise ValueError("--sessions must be at least 1")
    return trace.main_generate(args.name, args.seed, args.sessions, args.output)


def _cmd_trace_replay(args: argparse.Namespace) -> int:
    from lmcache_rc import trace

    if args.sizes is not None:
        if args.l1 is not None or args.l2 is not None:
            raise ValueError("give --sizes or --l1/--l2, not both")
        sizes = trace.parse_sizes(args.sizes)
    else:
        sizes = [(args.l1 or "16M", args.l2 or "64M")]
    if args.sessions is not None and args.sessions < 1:
        raise ValueError("--sessions must be at least 1")
    return trace.main_replay(
        args.source, args.policy, sizes, args.shape, args.seed, args.sessions, args.json
    )


def _cmd_serve_bench(args: argparse.Namespace) -> int:
    from lmcache_rc import serving

    vocab = serving.parse_range(args.vocab, "--vocab")
    workload = serving.Workload(
        users=args.users,
        conversations=args.conversations,
        duration=args.duration,
        turns=serving.parse_range(args.turns, "--turns"),
        system_prompts=args.system_prompts,
        system_tokens=serving.parse_range(args.system_tokens, "--system-tokens"),
        user_tokens=serving.parse_range(args.user_tokens, "--user-tokens"),
        max_tokens=args.max_tokens,
        stream=args.stream,
        abort=args.abort,
        vocab=(vocab[0], vocab[1] + 1),
        seed=args.seed,
        think=args.think,
    )
    return serving.main(
        args.url,
        workload,
        model=args.model,
        as_json=args.json,
        records=args.records,
        long_prompt=args.long_prompt,
    )


def _cmd_restore_skip(args: argparse.Namespace) -> int:
    from lmcache_rc.restore_skip import main as skip_main

    return skip_main(as_json=args.json)


def _cmd_shared_gc(args: argparse.Namespace) -> int:
    from lmcache_rc import shared

    url = args.shared_url or ServerConfig.from_env().shared_url
    if not url:
        raise ValueError("--shared-url (or LMCACHE_RC_SHARED_URL) is required")
    older_than = shared.parse_duration(args.older_than)
    print(f"shared gc: {url}, older than {older_than:g} s...", file=sys.stderr)
    report = shared.gc(url, older_than)
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    for key, value in sorted(report.items()):
        if key != "skipped":
            print(f"{key}: {value}")
    for namespace, why in report["skipped"]:
        print(f"skipped {namespace}: {why}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lmcache-rc`` (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="lmcache-rc",
        description="Atomic, deduplicated recurrent-model checkpoints for hybrid LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-rc {rc.__version__}")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run the checkpoint sidecar in the foreground")
    _add_server_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    for name, func, helptext in (
        ("status", _cmd_status, "print the sidecar's counters"),
        ("clear", _cmd_clear, "drop cached checkpoint pages"),
        ("inspect", _cmd_inspect, "list published generations"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument(
            "--socket", help="sidecar socket (default: LMCACHE_RC_SOCKET or the default)"
        )
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "clear":
            p.add_argument(
                "--force",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="--force (the default): drop everything, pinned pages too; refused "
                "(exit 4) while leases are live. --no-force: keep pages held by leases "
                "or pending stores",
            )
            p.add_argument("--all-tiers", action="store_true", help="also delete L2 files")
        p.set_defaults(func=func)

    ident = sub.add_parser(
        "identity", help="print the checkpoint identity (namespace, roots, generation) of a prompt"
    )
    ident.add_argument("--identity", help="identity mapping as JSON (default: a sample)")
    ident.add_argument("--salt", default="", help="cache salt (default: empty)")
    group = ident.add_mutually_exclusive_group()
    group.add_argument("--tokens", help="token ids as a JSON list")
    group.add_argument("--text", default=SAMPLE_TEXT, help="text, tokenized one token per byte")
    ident.add_argument(
        "--chunk-tokens",
        type=int,
        default=rc.TokenRoots.DEFAULT_CHUNK_TOKENS,
        help="tokens per hash chunk",
    )
    ident.add_argument("--json", action="store_true", help="print one JSON object")
    ident.set_defaults(func=_cmd_identity)

    demo = sub.add_parser(
        "demo",
        help="run a verified multi-turn workload on the simulated engine (no GPU needed)",
    )
    demo.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    demo.add_argument(
        "--requests", type=int, default=3, help="conversations sharing a system prompt (default 3)"
    )
    demo.add_argument("--world-size", type=int, default=2, help="ranks per engine (default 2)")
    demo.add_argument(
        "--rank-mode",
        choices=("spawn", "thread"),
        default="spawn",
        help="ranks in separate processes (spawn, default) or threads",
    )
    demo.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="engine replicas turns alternate between (default 2)",
    )
    demo.add_argument("--keep", metavar="DIR", help="keep the directory and L2 files in DIR")
    demo.add_argument(
        "--socket",
        metavar="PATH",
        help="use the sidecar already running at PATH instead of starting one: the run "
        "stores under a namespace of its own (new every run), skips the restart phase, "
        "and retires its namespace at the end; other data is left alone",
    )
    demo.add_argument(
        "--json", action="store_true", help="print one JSON object (progress goes to stderr)"
    )
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench", help="measure the transfer engine's store/restore throughput against memcpy"
    )
    bench.add_argument("--mib", type=int, default=256, help="MiB moved per round (default 256)")
    bench.add_argument("--page-kib", type=int, default=256, help="page size in KiB (default 256)")
    bench.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    bench.add_argument(
        "--json", action="store_true", help="print one JSON object (verdicts included)"
    )
    bench.add_argument(
        "--socket",
        metavar="PATH",
        help="use the sidecar already running at PATH instead of starting one: pages go "
        "to a namespace of its own (new every run), retired after every round; refused "
        "when the sidecar's pool has less free space than --mib",
    )
    bench.set_defaults(func=_cmd_bench)

    trace_p = sub.add_parser(
        "trace", help="generate multi-turn traces and replay them to compare eviction policies"
    )
    trace_sub = trace_p.add_subparsers(dest="trace_command", required=True)
    gen = trace_sub.add_parser(
        "generate", help="write a synthetic trace (JSON lines, docs/trace.md) to stdout or a file"
    )
    gen.add_argument("name", choices=("chat", "agentic"), help="the workload")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    gen.add_argument("--sessions", type=int, help="sessions (default: chat 300, agentic 60)")
    gen.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: stdout)")
    gen.set_defaults(func=_cmd_trace_generate)
    rep_p = trace_sub.add_parser(
        "replay",
        help="replay a trace against embedded sidecars: tokens restored, compute saved, "
        "bytes written, per eviction policy",
    )
    rep_p.add_argument(
        "source", help="a trace file (JSON lines, docs/trace.md), or chat / agentic to generate one"
    )
    rep_p.add_argument(
        "--policy",
        choices=("lru", "cost", "both"),
        default="both",
        help="eviction policy of the sidecar (default both: one replay each)",
    )
    rep_p.add_argument("--l1", metavar="SIZE", help="L1 (shared memory) size (default 16M)")
    rep_p.add_argument("--l2", metavar="SIZE", help="L2 (file tier) size (default 64M)")
    rep_p.add_argument(
        "--sizes",
        metavar="L1:L2,...",
        help="several cache sizes, e.g. 8M:32M,16M:64M (instead of --l1/--l2)",
    )
    rep_p.add_argument(
        "--shape",
        help="model shape of the cost model and the page sizes (default qwen3-next-80b-a3b; "
        "also nemotron-h-8b)",
    )
    rep_p.add_argument("--seed", type=int, default=0, help="seed of a generated trace (default 0)")
    rep_p.add_argument(
        "--sessions", type=int, help="sessions of a generated trace (default: the generator's)"
    )
    rep_p.add_argument("--json", action="store_true", help="print one JSON object")
    rep_p.set_defaults(func=_cmd_trace_replay)
    sb = sub.add_parser(
        "serve-bench",
        help="multi-turn load against an OpenAI-compatible vLLM server: time to first "
        "token, prefill tokens computed, hit rate, throughput",
    )
    sb.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    sb.add_argument("--model", help="model name to ask for (default: the first it lists)")
    sb.add_argument("--users", type=int, default=8, help="concurrent conversations (default 8)")
    sb.add_argument(
        "--conversations", type=int, default=16, help="conversations in all (default 16)"
    )
    sb.add_argument(
        "--duration", type=float, help="seconds to keep starting turns (instead of a count)"
    )
    sb.add_argument("--turns", default="4-6", help="turns per conversation (default 4-6)")
    sb.add_argument("--system-prompts", type=int, default=2, help="shared system prompts (2)")
    sb.add_argument(
        "--system-tokens", default="1024-2048", help="tokens of a system prompt (1024-2048)"
    )
    sb.add_argument("--user-tokens", default="32-128", help="tokens a turn adds (32-128)")
    sb.add_argument("--max-tokens", type=int, default=32, help="output tokens per turn (32)")
    sb.add_argument(
        "--stream",
        type=float,
        default=1.0,
        help="fraction of turns streamed; time to first token is measured on those (1.0)",
    )
    sb.add_argument(
        "--abort", type=float, default=0.0, help="fraction of streams the client abandons (0)"
    )
    sb.add_argument(
        "--vocab",
        default="10-29999",
        help="token ids are drawn from this range; keep it inside the model's vocabulary "
        "(default 10-29999)",
    )
    sb.add_argument("--seed", type=int, default=0, help="random seed of the prompts (0)")
    sb.add_argument("--think", type=float, default=0.0, help="seconds between a user's turns (0)")
    sb.add_argument(
        "--long-prompt",
        type=int,
        default=2048,
        help="later turns with at least this many prompt tokens get a row of their own (2048)",
    )
    sb.add_argument("--records", metavar="FILE", help="also write one JSON line per request")
    sb.add_argument("--json", action="store_true", help="print one JSON object")
    sb.set_defaults(func=_cmd_serve_bench)

    skip = sub.add_parser(
        "restore-skip",
        help="show the skip rule: on a shared tier with 50 ms injected latency, short "
        "prefixes are recomputed and long ones restored (estimates, decisions, counts)",
    )
    skip.add_argument("--json", action="store_true", help="print one JSON object")
    skip.set_defaults(func=_cmd_restore_skip)

    shared = sub.add_parser("shared", help="maintain the shared tier (an object store)")
    shared_sub = shared.add_subparsers(dest="shared_command", required=True)
    gc = shared_sub.add_parser(
        "gc",
        help="remove old manifests, then the pages no remaining manifest names",
    )
    gc.add_argument(
        "--shared-url",
        help="s3://bucket/prefix or file:///path (default: LMCACHE_RC_SHARED_URL); "
        "credentials from the AWS_* environment",
    )
    gc.add_argument(
        "--older-than",
        required=True,
        metavar="DURATION",
        help="age of what is removed, a duration: 36h, 7d, 90m or seconds; at least the tier's "
        "safety margin (about 75 minutes)",
    )
    gc.add_argument("--json", action="store_true", help="print one JSON object")
    gc.set_defaults(func=_cmd_shared_gc)
    return parser


def _quiet_stdout() -> None:
    """Points stdout at /dev/null after the reader went away (``| head``), so
    the interpreter's final flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (see the module docs)."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        code: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except KeyboardInterrupt:
        return 130
    except rc.errors.Unavailable as exc:
        print(f"lmcache-rc: sidecar unreachable: {exc}", file=sys.stderr)
        return 3
    except rc.errors.LeasesLive as exc:
        print(f"lmcache-rc: refused: {exc}", file=sys.stderr)
        return 4
    except (rc.errors.InvalidInput, rc.errors.InvalidType, ValueError) as exc:
        print(f"lmcache-rc: error: {exc}", file=sys.stderr)
        return 2
    except (rc.errors.CheckpointError, OSError) as exc:
        print(f"lmcache-rc: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the last line of defence: one line, exit 1
        if os.environ.get("LMCACHE_RC_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        print(
            f"lmcache-rc: unexpected error: {type(exc).__name__}: {exc} "
            "(LMCACHE_RC_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
