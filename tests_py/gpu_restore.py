"""The GPU restore measurement of ``ci/gpu-check.sh``: a 32K-token TP4
checkpoint — 4 ranks x 2055 pages (16 tokens each) x 60 KiB = 505 MB — is
stored through four cuda transfer engines (one per rank, as four workers
would), then restored from the sidecar's L1 into device memory by all four
at once, timed end to end (first submit to the last future resolved, median
of 3 after a warm-up), against raw ``cuMemcpyHtoDAsync`` of the same bytes
(four copies, one per rank, from page-locked host memory on one stream, then
``cuStreamSynchronize``). Target: ratio (raw time / restore time) >= 0.8.

Run as a script on a GPU machine (``ci/gpu-check.sh``: device buffers are
torch tensors). :func:`measure` takes the device-buffer factory, so the fake
driver's case (``fake_cuda_cases.py``: numpy memory declared device memory,
``rust/fake-cuda``) runs the same code path at a small size: there it checks
the path and the bytes, not the speed."""

from __future__ import annotations

import ctypes
import json
import mmap
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

import lmcache_rc as rc

RANKS = 4
PAGES = 2055  # 32,880 tokens in 16-token blocks
PAGE_BYTES = 60 << 10
TARGET = 0.8


class DeviceBuffer(Protocol):
    """A device allocation of ``rows`` x ``page_bytes`` bytes."""

    def data_ptr(self) -> int: ...


Alloc = Callable[[int, int, bool], DeviceBuffer]
"""``alloc(rows, page_bytes, random)``: a device buffer, random bytes or zeros."""

Same = Callable[[DeviceBuffer, DeviceBuffer], bool]
"""Whether two device buffers hold the same bytes (rows 1.. only)."""


def manifest(pages: int, page_bytes: int, layout: dict[str, Any]) -> rc.Manifest:
    """One TP4 generation: ``pages`` attention pages of ``page_bytes`` per rank."""
    tokens = pages * 16
    roots = rc.TokenRoots.build("gpu-restore", list(range(tokens)))
    keys = roots.content_keys([(16 * (p + 1), "attention:0") for p in range(pages)])
    payload = json.dumps(
        {
            "schema_version": 2,
            "worker_layout": layout,
            "page_groups": [
                {
                    "name": "engine-kv-group:0",
                    "page_bytes": page_bytes,
                    "positions": list(range(pages)),
                    "content_keys": keys,
                }
            ],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    prefix = roots.prefix(tokens)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, RANKS, payload)


class Driver:
    """The CUDA driver API through ctypes (``libcuda.so.1``: the real driver,
    or the fake when ``LD_LIBRARY_PATH`` names it first)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        vp, u64, sz = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        for name, args in (
            ("cuInit", [ctypes.c_uint]),
            ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
            ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int]),
            ("cuDevicePrimaryCtxRelease_v2", [ctypes.c_int]),
            ("cuCtxSetCurrent", [vp]),
            ("cuStreamCreate", [ctypes.POINTER(vp), ctypes.c_uint]),
            ("cuStreamDestroy_v2", [vp]),
            ("cuStreamSynchronize", [vp]),
            ("cuMemHostRegister_v2", [vp, sz, ctypes.c_uint]),
            ("cuMemHostUnregister", [vp]),
            ("cuMemcpyHtoDAsync_v2", [u64, vp, sz, vp]),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def __call__(self, name: str, *args: Any) -> None:
        code = getattr(self._lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed with CUresult {code}")


def raw_h2d_seconds(dst: Sequence[int], nbytes: int, rounds: int) -> list[float]:
    """Seconds per round to copy ``nbytes`` from page-locked host memory to
    each device address of ``dst`` with ``cuMemcpyHtoDAsync`` on one stream."""
    cu = Driver()
    cu("cuInit", 0)
    dev = ctypes.c_int()
    cu("cuDeviceGet", ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    host = mmap.mmap(-1, nbytes * len(dst))  # page-aligned
    array = np.frombuffer(host, np.uint8)
    array[:] = 1
    base = array.ctypes.data
    stream = ctypes.c_void_p()
    times = []
    try:
        cu("cuCtxSetCurrent", ctx)
        cu("cuMemHostRegister_v2", ctypes.c_void_p(base), nbytes * len(dst), 0)
        try:
            cu("cuStreamCreate", ctypes.byref(stream), 1)
            for _ in range(rounds + 1):  # the first warms up
                start = time.perf_counter()
                for k, d in enumerate(dst):
                    src = ctypes.c_void_p(base + k * nbytes)
                    cu("cuMemcpyHtoDAsync_v2", d, src, nbytes, stream)
                cu("cuStreamSynchronize", stream)
                times.append(time.perf_counter() - start)
            cu("cuStreamDestroy_v2", stream)
        finally:
            cu("cuMemHostUnregister", ctypes.c_void_p(base))
    finally:
        cu("cuDevicePrimaryCtxRelease_v2", dev)
        del array
        host.close()
    return times[1:]


def measure(
    alloc: Alloc,
    same: Same,
    *,
    pages: int = PAGES,
    page_bytes: int = PAGE_BYTES,
    rounds: int = 3,
) -> dict[str, Any]:
    """Stores one TP4 generation from ``RANKS`` device buffers, restores it
    ``rounds`` times (after a warm-up) into ``RANKS`` others, all ranks at
    once, checks the bytes, times raw H2D copies of the same bytes, and
    returns the figures (seconds are medians)."""
    layout = {"schema_version": 1, "page_bytes": page_bytes}
    m = manifest(pages, page_bytes, layout)
    rows = pages + 1
    ids = [list(range(1, rows))]
    total = RANKS * pages * page_bytes
    src = [alloc(rows, page_bytes, True) for _ in range(RANKS)]
    dst = [alloc(rows, page_bytes, False) for _ in range(RANKS)]
    restore_times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = rc.ServerConfig(socket=str(Path(tmp) / "gpu.sock"), l1_bytes=total + (64 << 20))
        with rc.Server.start(cfg) as server, rc.Client(server.socket_path) as client:
            opts: dict[str, Any] = {"layout": layout, "max_copies_in_flight": 4}
            engines = [
                [
                    rc.TransferEngine.cuda(
                        server.socket_path, b.data_ptr(), rows, page_bytes, **opts
                    )
                    for b in bufs
                ]
                for bufs in (src, dst)
            ]
            try:
                if not client.begin(m):
                    raise RuntimeError("the sidecar refused to stage the generation")
                _all(engines[0], m, "STORE", ids)
                for r in range(rounds + 1):  # the first warms up
                    start = time.perf_counter()
                    _all(engines[1], m, "RETRIEVE", ids)
                    if r:
                        restore_times.append(time.perf_counter() - start)
            finally:
                for pair in engines:
                    for e in pair:
                        e.close()
    if not all(same(a, b) for a, b in zip(src, dst, strict=True)):
        raise RuntimeError("restored device bytes differ from the stored ones")
    raw = raw_h2d_seconds([b.data_ptr() + page_bytes for b in dst], pages * page_bytes, rounds)
    restore_s, raw_s = statistics.median(restore_times), statistics.median(raw)
    return {
        "ranks": RANKS,
        "pages_per_rank": pages,
        "page_bytes": page_bytes,
        "bytes": total,
        "restore_s": restore_s,
        "raw_h2d_s": raw_s,
        "restore_gb_s": total / restore_s / 1e9,
        "raw_h2d_gb_s": total / raw_s / 1e9,
        "ratio": raw_s / restore_s,
        "target": TARGET,
    }


def _all(engines: list[rc.TransferEngine], m: rc.Manifest, direction: str, ids: Any) -> None:
    """Submits rank ``k``'s job to ``engines[k]`` for every rank; waits for all."""
    futures = [e.submit(m, rank, direction, ids) for rank, e in enumerate(engines)]
    for f in futures:
        if f is None or f.result(300) is not True:
            raise RuntimeError(f"a {direction} failed: {f.error if f else 'refused'}")


def report(result: dict[str, Any]) -> str:
    """The one-line figure ``ci/gpu-check.sh`` prints."""
    met = "met" if result["ratio"] >= result["target"] else "NOT met"
    return (
        f"gpu restore from L1 ({result['ranks']} ranks x {result['pages_per_rank']} pages x "
        f"{result['page_bytes'] >> 10} KiB = {result['bytes'] / 1e6:.0f} MB, all ranks at once, "
        f"end to end): {result['restore_s'] * 1e3:.1f} ms = {result['restore_gb_s']:.2f} GB/s; "
        f"raw cuMemcpyHtoDAsync of the same bytes {result['raw_h2d_s'] * 1e3:.1f} ms = "
        f"{result['raw_h2d_gb_s']:.2f} GB/s; ratio {result['ratio']:.2f} {met} "
        f"(target >= {result['target']})"
    )


def _torch_alloc(rows: int, page_bytes: int, random: bool) -> Any:
    import torch

    if random:
        t = torch.randint(0, 256, (rows, page_bytes), dtype=torch.uint8, device="cuda")
        t[0] = 0
        return t
    return torch.zeros((rows, page_bytes), dtype=torch.uint8, device="cuda")


def _torch_same(a: Any, b: Any) -> bool:
    import torch

    torch.cuda.synchronize()
    return bool(torch.equal(a[1:], b[1:]))


if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_restore: torch sees no CUDA device")
    figures = measure(_torch_alloc, _torch_same)
    print(report(figures))
    print(json.dumps(figures, sort_keys=True))
