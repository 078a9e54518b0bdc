"""The fake CUDA driver (``rust/fake-cuda``) for the cuda backend's tests
without a GPU: building it, the ctypes handle on its test controls, and a
stand-in for a CUDA tensor over numpy memory declared fake device memory.

The driver is found the way the product finds the real one: cudarc loads
``libcuda.so`` by name, so a process whose ``LD_LIBRARY_PATH`` starts with a
directory holding ``libcuda.so`` -> the fake loads the fake. That variable is
read when a process starts, and cudarc keeps its library for the life of the
process, so the cases run in child processes (``fake_cuda_cases.py``)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "lmcache-rc-fake-cuda"
TARGET = "lmcache_rc_fake_cuda"
ENV = "LMCACHE_RC_FAKE_CUDA"
"""Names the fake's file in a child process (set by ``child_env``)."""

# CUresult values the fake can inject.
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_LAUNCH_FAILED = 719
CUDA_ERROR_UNKNOWN = 999


def build() -> Path:
    """Builds the fake with cargo (a debug build: seconds once cudarc is
    built) and returns the path of the shared library."""
    cargo = shutil.which("cargo")
    if cargo is None:
        raise RuntimeError("the fake CUDA driver tests need cargo (install Rust, see README)")
    proc = subprocess.run(
        [cargo, "build", "-p", PACKAGE, "--lib", "--message-format=json-render-diagnostics"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building {PACKAGE} failed:\n{proc.stderr[-4000:]}")
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == TARGET:
            for name in msg["filenames"]:
                if name.endswith(".so"):
                    return Path(name)
    raise RuntimeError(f"cargo built no shared library for {PACKAGE}:\n{proc.stdout[-4000:]}")


def child_env(lib: Path, directory: Path) -> dict[str, str]:
    """The environment of a child process that loads ``lib`` as libcuda:
    ``directory`` gets ``libcuda.so`` and ``libcuda.so.1`` links to it and
    goes first on ``LD_LIBRARY_PATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("libcuda.so", "libcuda.so.1"):
        link = directory / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(lib)
    old = os.environ.get("LD_LIBRARY_PATH")
    path = f"{directory}:{old}" if old else str(directory)
    return dict(os.environ, LD_LIBRARY_PATH=path, **{ENV: str(lib)})


class FakeDriver:
    """The fake's test controls, through the instance the process loaded
    (the dynamic loader gives the same instance for the same file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        lib = ctypes.CDLL(os.fspath(path))
        self._lib = lib
        lib.lmcache_fake_cuda_register_device.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        lib.lmcache_fake_cuda_register_device.restype = ctypes.c_int
        lib.lmcache_fake_cuda_unregister_device.argtypes = [ctypes.c_uint64]
        lib.lmcache_fake_cuda_unregister_device.restype = ctypes.c_int
        lib.lmcache_fake_cuda_fail.argtypes = [
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
        ]
        lib.lmcache_fake_cuda_fail.restype = ctypes.c_int
        lib.lmcache_fake_cuda_hold.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.lmcache_fake_cuda_hold.restype = ctypes.c_int
        for name in ("waiting", "calls", "stat"):
            fn = getattr(lib, f"lmcache_fake_cuda_{name}")
            fn.argtypes = [ctypes.c_char_p]
            fn.restype = ctypes.c_int64
        lib.lmcache_fake_cuda_pending_fill.argtypes = [
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_uint8,
        ]
        lib.lmcache_fake_cuda_pending_fill.restype = ctypes.c_uint64
        lib.lmcache_fake_cuda_reset.argtypes = []
        lib.lmcache_fake_cuda_reset.restype = None

    def register_device(self, array: np.ndarray[Any, Any]) -> int:
        """Declares ``array``'s bytes fake device memory; its address."""
        ptr = int(array.ctypes.data)
        if self._lib.lmcache_fake_cuda_register_device(ptr, array.nbytes) != 0:
            raise ValueError("the range is empty or overlaps declared device memory")
        return ptr

    def unregister_device(self, ptr: int) -> None:
        if self._lib.lmcache_fake_cuda_unregister_device(ptr) != 0:
            raise ValueError(f"no device range at {ptr:#x}")

    def fail(self, symbol: str, count: int = 1, *, after: int = 0, code: int = 700) -> None:
        """The next ``count`` calls of ``symbol``, after ``after`` good ones,
        return ``code`` (default ``CUDA_ERROR_ILLEGAL_ADDRESS``)."""
        r = self._lib.lmcache_fake_cuda_fail(symbol.encode(), code, count, after)
        if r != 0:
            raise ValueError(f"fail({symbol!r}, code={code}) refused: {r}")

    def hold(self, symbol: str, on: bool = True) -> None:
        if self._lib.lmcache_fake_cuda_hold(symbol.encode(), int(on)) != 0:
            raise ValueError(f"unknown symbol {symbol!r}")

    def waiting(self, symbol: str) -> int:
        return int(self._lib.lmcache_fake_cuda_waiting(symbol.encode()))

    def calls(self, symbol: str) -> int:
        n = int(self._lib.lmcache_fake_cuda_calls(symbol.encode()))
        if n < 0:
            raise ValueError(f"unknown symbol {symbol!r}")
        return n

    def stat(self, name: str) -> int:
        n = int(self._lib.lmcache_fake_cuda_stat(name.encode()))
        if n < 0:
            raise ValueError(f"unknown stat {name!r}")
        return n

    def stats(self) -> dict[str, int]:
        names = ("live_streams", "live_events", "host_registrations", "pending_ops", "ctx_refs")
        return {n: self.stat(n) for n in (*names, "violations")}

    def pending_fill(self, ptr: int, nbytes: int, value: int) -> int:
        """A producer's write of ``value`` over ``nbytes`` at ``ptr`` that
        runs only once waited for; the event handle to wait on."""
        event = int(self._lib.lmcache_fake_cuda_pending_fill(ptr, nbytes, value))
        if event == 0:
            raise ValueError("the range is not inside declared device memory")
        return event

    def reset(self) -> None:
        self._lib.lmcache_fake_cuda_reset()


class FakeCudaTensor:
    """Just enough of a contiguous ``torch.uint8`` CUDA tensor for
    ``lmcache_rc.worker`` (``is_cuda``, ``data_ptr``, ``device.index``,
    ``dtype``, ``shape``, ``dim``, ``is_contiguous``, ``numel``,
    ``element_size``), over a numpy array declared fake device memory. The
    array is ``self.array`` (read and write it only while no copy runs)."""

    is_cuda = True
    dtype = "torch.uint8"

    def __init__(self, fake: FakeDriver, array: np.ndarray[Any, Any]) -> None:
        if array.dtype != np.uint8 or not array.flags.c_contiguous:
            raise ValueError("a contiguous uint8 array")
        self.array = array
        self.device = SimpleNamespace(type="cuda", index=0)
        self.shape = tuple(int(d) for d in array.shape)
        self._ptr = fake.register_device(array)
        # Undeclared when the tensor goes (with its array); a worker that
        # turned unsafe keeps its pool, so memory under a queued copy stays.
        weakref.finalize(self, fake.unregister_device, self._ptr)

    def data_ptr(self) -> int:
        return self._ptr

    def dim(self) -> int:
        return self.array.ndim

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return 1
