"""One engine process of the real-engine suite: ``python engine_turn.py SPEC.json``.

Builds a vLLM engine (vLLM's CPU build, a tiny model folder made by
:mod:`models`), with or without the lmcache-rc connector, runs the spec's
request batches in order (the requests of one batch in one ``generate()``
call) and prints one line ``RESULT {json}``: per request its output tokens,
``num_cached_tokens`` (in a fresh process: the tokens the connector restored)
and the batch's time; in-process engines also report the connector's
scheduler-side counters. Then, as the spec says, it returns at once (a script
that ends right after ``generate()``), stays idle for a while, or is killed by
the test.

Spec keys: ``model`` (folder), ``family``, ``block_size`` (None, or the block
size the suite expects: any other choice of vLLM's ends the process with a
message saying so), ``engine`` (extra ``LLM`` kwargs),
``multiprocess`` (bool: vLLM's engine-core process or in-process),
``connector`` (None, or the ``lmcache_rc.*`` options without the prefix),
``batches`` (list of lists of token lists), ``max_tokens``, ``fault``
(None or ``{"kind": "fail", "count": n}``: the next n copies on the rank fail),
``idle`` (seconds to stay alive after printing the result),
``fresh_batches`` (reset vLLM's prefix cache before each batch) or
``reset_before`` (before the batches of these indices), ``gated``
(before each batch after the first, print ``BATCH i DONE`` and wait for the
file ``SPEC.json.go<i+1>``), ``probe`` (a folder: run with the state probe
instead of a connector, see :mod:`probe`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from typing import Any


def _connector_status(llm: Any) -> dict[str, Any] | None:
    """The scheduler-side status of an in-process engine's connector."""
    try:
        core = llm.llm_engine.engine_core.engine_core
    except AttributeError:
        return None  # engine-core process: not reachable from here
    connector = getattr(core.scheduler, "connector", None)
    if connector is None or not hasattr(connector, "report_status"):
        return None
    status: dict[str, Any] = connector.report_status()
    return status


def _margins(logprobs: Any) -> list[float]:
    """Per generated token, the log-probability gap between the two best
    tokens (how near a tie the greedy choice was)."""
    out: list[float] = []
    for step in logprobs or []:
        best = sorted((lp.logprob for lp in step.values()), reverse=True)
        out.append(float(best[0] - best[1]) if len(best) > 1 else float("inf"))
    return out


def _inject_fault(worker: Any, kind: str, count: int) -> None:
    """Runs on each worker (``collective_rpc`` passes the worker first): the
    rank's next ``count`` copies get ``kind``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().inject_fault(kind, count)


def main() -> None:
    # a test that finds this process hung sends SIGUSR1 before it kills it:
    # every thread's Python stack goes to stderr, which the failure shows
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with open(sys.argv[1]) as f:
        spec: dict[str, Any] = json.load(f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(spec.get("engine") or {})
    connector = spec.get("connector")
    probe = spec.get("probe")
    if probe is not None:
        os.environ["LMCACHE_RC_PROBE_OUT"] = probe
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StateProbeConnector",
            kv_connector_module_path="probe",
            kv_role="kv_both",
        )
    elif connector is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheRecurrentCheckpointConnector",
            kv_connector_module_path="lmcache_rc.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={f"lmcache_rc.{k}": v for k, v in connector.items()},
        )
    started = time.monotonic()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, **kwargs)
    startup = time.monotonic() - started
    chosen = llm.llm_engine.vllm_config.cache_config.block_size
    expected = spec.get("block_size")
    if expected is not None and chosen != expected:
        # every scenario is laid out in blocks of models.py's size: stop here,
        # not at a confusing assertion about restored token counts later
        raise SystemExit(
            f"vLLM chose block size {chosen} for {spec['family']}, the suite "
            f"expects {expected} (models.py); pin what moved it in the family's engine kwargs"
        )
    if spec.get("fault"):
        fault = spec["fault"]
        llm.collective_rpc(_inject_fault, args=(fault["kind"], int(fault.get("count", 1))))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(spec.get("max_tokens", 16)),
        ignore_eos=True,
        detokenize=False,
        logprobs=2,
    )
    batches: list[dict[str, Any]] = []
    for i, batch in enumerate(spec["batches"]):
        if i and (spec.get("fresh_batches") or i in spec.get("reset_before", ())):
            # each batch from scratch: nothing of earlier batches is cached
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        if i and spec.get("gated"):
            # the test acts between batches (kills the sidecar, say), then lets us go on
            print(f"BATCH {i - 1} DONE", flush=True)
            gate = f"{sys.argv[1]}.go{i}"
            while not os.path.exists(gate):
                time.sleep(0.05)
        t0 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in batch], params, use_tqdm=False)
        elapsed = time.monotonic() - t0
        batches.append(
            {
                "elapsed": elapsed,
                "requests": [
                    {
                        "prompt": len(o.prompt_token_ids or []),
                        "output": list(o.outputs[0].token_ids),
                        "cached": int(o.num_cached_tokens or 0),
                        "margins": _margins(o.outputs[0].logprobs),
                    }
                    for o in outs
                ],
            }
        )
    result = {
        "startup": startup,
        "block_size": chosen,
        "batches": batches,
        "connector": _connector_status(llm),
    }
    print("RESULT " + json.dumps(result), flush=True)
    idle = float(spec.get("idle", 0))
    if idle > 0:
        time.sleep(idle)
    # then return: the interpreter exits with the engine still alive, as a script does


if __name__ == "__main__":
    main()
