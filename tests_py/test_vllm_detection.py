"""Which vLLM the connector is on, decided from the installed ``vllm`` package.

``vllm_api = "auto"`` (the default) must pick boundary mode on the
request-boundary fork and upstream mode on stock vLLM 0.33, from markers each
build really has. The fork's connector base class does not define
``bind_boundary_checkpoint_cache`` (docs/design/vllm-boundary-api.md §2.2), and
an earlier detection that tested for it disabled the connector on the fork
with "the installed vLLM offers neither …". These tests put stand-ins of both
builds (``tests_py/fake_vllm.py``, markers only) on ``sys.path`` of a fresh
interpreter and run the connector there: on the fork, through the simulated
engine, a second turn must restore the first turn's checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_vllm import write_fake_vllm

from lmcache_rc.vllm import api

_PROBE = r"""
import json, logging, os, shutil, sys, tempfile

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)

import lmcache_rc as rc
from lmcache_rc.vllm import api
from lmcache_rc.vllm.connector import resolve_mode

out = {
    "vllm_from": os.path.dirname(sys.modules["vllm"].__file__),
    "available": api.VLLM_AVAILABLE,
    "boundary": api.has_boundary_api(),
    "upstream": api.has_upstream_api(),
    "mode": resolve_mode("auto"),
    "base_has_bind_hook": hasattr(api.KVConnectorBase_V1, "bind_boundary_checkpoint_cache"),
}
if sys.argv[1] == "fork":
    from lmcache_rc.testing import SimEngine

    d = tempfile.mkdtemp(prefix="lmrc-")
    server = rc.Server.start(rc.ServerConfig(socket=os.path.join(d, "s.sock"), l1_bytes=32 << 20))
    try:
        prompt = list(range(500, 540))
        turns = []
        tokens = prompt
        for turn in range(2):
            eng = SimEngine(server.socket_path, world_size=2)
            r = eng.generate(f"t{turn}", tokens, 4)
            turns.append({
                "mode": eng.connector.mode,
                "restored": r.restored_tokens,
                "published": len(r.published),
                "correct": r.output_tokens == eng.model.reference_generate(tokens, 4),
            })
            eng.close()
            tokens = tokens + r.output_tokens + [1, 2, 3]
        out["turns"] = turns
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)
out["disabled_lines"] = [m for m in records if "connector disabled" in m]
print("RESULT " + json.dumps(out))
"""


def _probe(tmp_path: Path, flavour: str) -> dict[str, Any]:
    root = write_fake_vllm(tmp_path / flavour, flavour)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, flavour],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    assert result["vllm_from"].startswith(str(root)), result  # the stand-in, not a real vLLM
    return result


def test_auto_picks_boundary_mode_on_the_fork_whose_base_lacks_the_bind_hook(
    tmp_path: Path,
) -> None:
    r = _probe(tmp_path, "fork")
    assert not r["base_has_bind_hook"]
    assert r["available"] and r["boundary"] and not r["upstream"]
    assert r["mode"] == "boundary"
    assert r["disabled_lines"] == []
    first, second = r["turns"]
    assert first["mode"] == second["mode"] == "boundary"
    assert first["published"] >= 1 and first["restored"] == 0
    # the second turn resumes from the first turn's response checkpoint
    assert second["restored"] == 40 + 4 - 1
    assert first["correct"] and second["correct"]


def test_auto_picks_upstream_mode_on_stock_vllm(tmp_path: Path) -> None:
    r = _probe(tmp_path, "stock")
    assert r["available"] and not r["boundary"] and r["upstream"]
    assert r["mode"] == "upstream"


@pytest.mark.parametrize("flavour", ["fork", "stock"])
def test_the_stand_in_vllm_builds_have_only_their_markers(tmp_path: Path, flavour: str) -> None:
    root = write_fake_vllm(tmp_path, flavour)
    base = (root / "vllm/distributed/kv_transfer/kv_connector/v1/base.py").read_text()
    config = (root / "vllm/config/__init__.py").read_text()
    assert "bind_boundary" not in base
    assert (api.BOUNDARY_BASE_MARKER in base) == (flavour == "fork")
    assert (api.BOUNDARY_CONFIG_MARKER in config) == (flavour == "fork")


def test_the_simulated_engines_base_matches_the_fork() -> None:
    """Without vLLM, the stand-in base plays the fork: its markers, not the bind hook."""
    if api.VLLM_AVAILABLE:
        pytest.fail("tests_py runs without vLLM; the stand-in base is what it checks")
    assert hasattr(api.KVConnectorBase_V1, api.BOUNDARY_BASE_MARKER)
    assert not hasattr(api.KVConnectorBase_V1, "bind_boundary_checkpoint_cache")
    assert api.KVConnectorBase_V1.supports_request_boundary_checkpoints(None) is False
