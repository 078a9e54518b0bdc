"""Every stored state equals recomputation (issue: outputs alone cannot tell
our errors from vLLM's, and a tiny random model can match by luck).

For each family, a two-turn conversation is stored through the connector
(``store_prompt=all``: every block boundary; response checkpoints mid-block
and at a block end; turn 2 also stores after a restore). Then, for every
listed generation of ``n`` tokens, a fresh reference engine — no lmcache-rc,
prefix caching off, ``mamba_cache_mode="none"`` — prefills exactly those
``n`` tokens and the state probe (:mod:`probe`) reads what it computed. Each
stored page (read back from the sidecar) is compared with it: attention pages
over the token slots the checkpoint covers, recurrent pages whole.

Prefill and decode compute the same state in different orders, so equality is
numeric, not bitwise: the relative error to the state of ``n`` tokens must be
small, and at least ten times smaller than to the state of ``n - 1`` tokens,
which proves the comparison can tell a state one token off.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import models
import numpy as np
import pytest
import torch
from conftest import Engines, Sidecar, Transcript
from scenarios import IDENTITY_FAMILIES, OUT, block, tokens

import lmcache_rc as rc

TOLERANCE = {"torch.bfloat16": 3e-2, "torch.float16": 5e-3, "torch.float32": 2e-3}
"""Largest relative error (max |a-b| over max |b|) per dtype between a stored
state and the reference, for pages computed by prefill in one and decode in
the other."""


def _decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    t = torch.from_numpy(raw.copy()).view(getattr(torch, dtype.removeprefix("torch.")))
    return t.float().numpy()


def rel_error(
    stored: np.ndarray, ref: dict[str, Any], model_dtype: str
) -> tuple[float, float, str]:
    """Worst relative error over the page's segments, the fraction of covered
    bytes that are identical, and the worst segment's dtype. A byte-typed KV
    cache (vLLM's CPU attention allocates raw bytes) holds ``model_dtype``."""
    mask = ref["mask"]
    worst, worst_dtype = 0.0, ""
    for start, end, raw_dtype in ref["segments"]:
        dtype = f"torch.{model_dtype}" if raw_dtype in ("torch.int8", "torch.uint8") else raw_dtype
        m = mask[start:end]
        item = torch.empty((), dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()
        keep = m.reshape(-1, item).all(axis=1)
        a = _decode(stored[start:end], dtype)[keep]
        b = _decode(ref["bytes"][start:end], dtype)[keep]
        if a.size == 0:
            continue
        scale = float(np.max(np.abs(b))) or 1.0
        err = float(np.max(np.abs(a - b))) / scale
        if not np.isfinite(err):
            err = float("inf")
        if err >= worst:
            worst, worst_dtype = err, dtype
    same = float(np.mean(stored[mask] == ref["bytes"][mask])) if mask.any() else 1.0
    return worst, same, worst_dtype


def stored_pages(sidecar: Sidecar) -> dict[int, tuple[Any, list[list[np.ndarray]]]]:
    """Every listed generation's manifest and page bytes, read back through the
    sidecar's retrieve leases (the bytes a restore would copy)."""
    sidecar.stop()
    directory = rc.Directory(str(sidecar.root / "index.sqlite"))
    manifests = [row["manifest"] for row in directory.list()]
    directory.close()
    sidecar.start()
    client = sidecar.client()
    out: dict[int, tuple[Any, list[list[np.ndarray]]]] = {}
    for manifest in manifests:
        lease = client.begin_retrieve(manifest, 0)
        deadline = time.monotonic() + 60
        while lease.status == "pending" and time.monotonic() < deadline:
            time.sleep(0.02)
            lease = client.poll_retrieve(lease.lease_id, rank=0)
        assert lease.status == "ready", (manifest.generation, lease.status, lease.reason)
        pages = [[np.array(a, copy=True) for a in group] for group in client.lease_arrays(lease)]
        client.finish_retrieve(lease.lease_id, rank=0)
        out[manifest.prefix.num_tokens] = (manifest, pages)
    return out


def reference_states(
    engines: Engines, family: str, conversation: list[int], lengths: list[int], out_dir: Path
) -> dict[int, dict[str, Any]]:
    """The probe's reading of a fresh engine that prefilled exactly ``n`` tokens, per n."""
    out_dir.mkdir(parents=True, exist_ok=True)
    engines.run(
        family,
        [[conversation[:n]] for n in lengths],
        probe=str(out_dir),
        max_tokens=1,
        engine={"enable_prefix_caching": False, "mamba_cache_mode": "none"},
    )
    states: dict[int, dict[str, Any]] = {}
    for n in lengths:
        with open(out_dir / f"{n}.pkl", "rb") as f:
            states[n] = pickle.load(f)
    return states


@pytest.mark.parametrize("family", IDENTITY_FAMILIES)
def test_every_stored_state_equals_recomputation(
    family: str, sidecar: Sidecar, engines: Engines, transcript: Transcript, tmp_path: Path
) -> None:
    bs = block(family)
    model_dtype = models.FAMILIES[family].dtype
    opts = {"store_prompt": "all"}
    t1 = tokens(200, 2 * bs + bs // 3, family)
    first = engines.run(family, [[t1]], socket=sidecar.socket, options=opts)
    # turn 2 ends its response exactly on a block boundary
    base = len(t1) + OUT
    k = (base + OUT - 1 + 10) // bs + 1
    t2 = t1 + first.turns[0].output + tokens(201, k * bs - (OUT - 1) - base, family)
    second = engines.run(family, [[t2]], socket=sidecar.socket, options=opts)
    assert second.turns[0].cached == len(t1) + OUT - 1
    conversation = t2 + second.turns[0].output
    stored = stored_pages(sidecar)
    lengths = sorted(stored)
    kinds = {
        n: ("response" if n in (len(t1) + OUT - 1, len(t2) + OUT - 1) else "prompt")
        + (", block end" if n % bs == 0 else ", mid-block")
        for n in lengths
    }
    assert len(t2) + OUT - 1 == k * bs and kinds[k * bs] == "response, block end", kinds
    assert any(v == "response, mid-block" for v in kinds.values()), kinds
    assert any(v.startswith("prompt") for v in kinds.values()), kinds
    wanted = sorted(set(lengths) | {n - 1 for n in lengths})
    refs = reference_states(engines, family, conversation, wanted, tmp_path / "probe")
    transcript.note(f"{family}: block {bs}, {len(lengths)} stored generations")
    transcript.note(
        f"{'tokens':>7} {'kind':<22} {'group':<5} {'page':>4} {'rel.err':>9} "
        f"{'identical':>9} {'vs n-1':>9}"
    )
    checked = 0
    for n in lengths:
        manifest, pages = stored[n]
        groups = manifest.page_groups()
        ref, off_by_one = refs[n], refs[n - 1]
        for g, group in enumerate(groups):
            want = ref["groups"][g]
            assert len(pages[g]) == len(want["pages"]), (n, group["name"])
            for p, page in enumerate(pages[g]):
                r = want["pages"][p]
                assert page.size == r["bytes"].size, (n, group["name"], p)
                err, same, dtype = rel_error(page, r, model_dtype)
                control = np.nan
                if want["kind"] == "recurrent":
                    control, _, _ = rel_error(
                        page, off_by_one["groups"][g]["pages"][0], model_dtype
                    )
                transcript.note(
                    f"{n:>7} {kinds[n]:<22} {group['name']:<5} {p:>4} {err:>9.2e} "
                    f"{same:>9.4f} {control:>9.2e}"
                )
                assert err <= TOLERANCE[dtype], (n, group["name"], p, err, dtype)
                if want["kind"] == "recurrent":
                    assert control > 10 * max(err, 1e-6), (n, group["name"], err, control)
                checked += 1
    transcript.note(f"{checked} pages compared")
    assert checked > 0
