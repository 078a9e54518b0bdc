"""The cuda backend's copy and failure paths without a GPU, on the fake CUDA
driver (``rust/fake-cuda``), loaded through the product's own path: cudarc
finds ``libcuda.so`` on ``LD_LIBRARY_PATH``.

The fake is built here with cargo (so a fresh clone needs nothing else), and
each case of ``fake_cuda_cases.py`` runs in a child pytest process whose
``LD_LIBRARY_PATH`` starts with a directory holding ``libcuda.so`` -> the
fake (the variable is read at process start and cudarc keeps its library
for the life of the process). A case's child output is shown on failure."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import fake_cuda
import fake_cuda_cases
import pytest

CASES = sorted(
    name
    for name, fn in vars(fake_cuda_cases).items()
    if name.startswith("test_") and inspect.isfunction(fn)
)


@pytest.fixture(scope="module")
def child_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    lib = fake_cuda.build()
    return fake_cuda.child_env(lib, tmp_path_factory.mktemp("fake-libcuda"))


def test_the_cases_are_found() -> None:
    assert len(CASES) >= 8, CASES


@pytest.mark.parametrize("case", CASES)
def test_cuda_backend_on_the_fake_driver(child_env: dict[str, str], case: str) -> None:
    cases = Path(fake_cuda_cases.__file__)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{cases}::{case}",
        ],
        cwd=fake_cuda.ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = f"{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    # Every item passed: nothing skipped, deselected or expected to fail.
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"=* ?\d+ passed in [\d.]+s( \(.*\))? ?=*", summary), output
