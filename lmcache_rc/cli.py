"""The ``lmcache-rc`` command line (also ``python -m lmcache_rc``).

Sub-commands available in this version:

- ``lmcache-rc --version``
- ``lmcache-rc identity --identity JSON [--salt S] [--tokens JSON | --text TEXT]``:
  print the namespace, token roots and generation id of a prompt, so an operator
  can check two hosts agree on a checkpoint's identity.

The sidecar (``serve``, ``status``, ``clear``, ``inspect``) and ``demo`` arrive
with their issues; see the README.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import lmcache_rc as rc

SAMPLE_IDENTITY: dict[str, Any] = {
    "target_revision": "0123456789abcdef0123456789abcdef01234567",
    "draft_revision": "",
    "source_revision": "89abcdef0123456789abcdef0123456789abcdef",
    "layout": {"page_bytes": 4096, "groups": [{"kind": "attention", "block_size": 16}]},
    "parallel": {"tp": 1, "dcp": 1},
}
SAMPLE_TEXT = "You are a helpful assistant. Summarise the following document."


def _text_tokens(text: str) -> list[int]:
    """Toy tokenizer for the sample: one token per UTF-8 byte (stable, no downloads)."""
    return list(text.encode("utf-8"))


def _identity_report(args: argparse.Namespace) -> dict[str, Any]:
    identity = json.loads(args.identity) if args.identity else SAMPLE_IDENTITY
    tokens = json.loads(args.tokens) if args.tokens else _text_tokens(args.text)
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lmcache-rc`` (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="lmcache-rc",
        description="Atomic, deduplicated recurrent-model checkpoints for hybrid LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-rc {rc.__version__}")
    sub = parser.add_subparsers(dest="command")
    ident = sub.add_parser(
        "identity", help="print the checkpoint identity (namespace, roots, generation) of a prompt"
    )
    ident.add_argument("--identity", help="identity mapping as JSON (default: a sample)")
    ident.add_argument("--salt", default="", help="cache salt (default: empty)")
    group = ident.add_mutually_exclusive_group()
    group.add_argument("--tokens", help="token ids as a JSON list")
    group.add_argument("--text", default=SAMPLE_TEXT, help="text, tokenized one token per byte")
    ident.add_argument("--chunk-tokens", type=int, default=4096, help="tokens per hash chunk")
    ident.add_argument("--json", action="store_true", help="print one JSON object")
    ident.set_defaults(func=_cmd_identity)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 = bad input, 1 = failure)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        code: int = args.func(args)
    except rc.errors.InvalidInput as exc:
        print(f"lmcache-rc: error: {exc}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"lmcache-rc: error: invalid JSON argument: {exc}", file=sys.stderr)
        return 2
    except rc.errors.CheckpointError as exc:
        print(f"lmcache-rc: error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
