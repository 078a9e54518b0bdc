"""Every protocol operation is reachable from Python and declared in the stubs.

``lmcache_rc._native.OPERATIONS`` is the core's operation table (the one list
that generates the Rust traits, the wire requests, the RPC client and the
binding's methods). These tests fail when an operation of that table is
missing from ``Client`` or ``CheckpointService`` (either twin) or from
``_native.pyi``, so a new operation cannot reach one front end and not the
other, nor ship without its stub.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import lmcache_rc as rc
from lmcache_rc import _native

STUB = Path(rc.__file__).with_name("_native.pyi")
FRONT_ENDS = (rc.Client, rc.CheckpointService)


def stub_classes() -> dict[str, ast.ClassDef]:
    """The classes ``_native.pyi`` declares, by name."""
    tree = ast.parse(STUB.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


# The operations of protocol version 3, in wire-tag order. The table is append
# only: new operations come after these, which keep their places.
PROTOCOL_3 = (
    "capabilities",
    "find",
    "begin",
    "abort",
    "prepare_store",
    "finish_store",
    "begin_retrieve",
    "poll_retrieve",
    "finish_retrieve",
    "cancel_retrieve",
    "status",
    "clear",
    "list_generations",
    "invalidate_namespace",
)


def test_operations_lists_each_operation_once_in_append_only_order() -> None:
    ops = _native.OPERATIONS
    assert isinstance(ops, tuple) and all(isinstance(op, str) for op in ops)
    assert len(set(ops)) == len(ops)
    assert ops[: len(PROTOCOL_3)] == PROTOCOL_3


@pytest.mark.parametrize("cls", FRONT_ENDS, ids=lambda c: c.__name__)
def test_every_operation_is_callable_on_each_front_end(cls: type) -> None:
    for op in _native.OPERATIONS:
        for name in (op, f"{op}_async"):
            assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name} is missing"


@pytest.mark.parametrize("cls", FRONT_ENDS, ids=lambda c: c.__name__)
def test_each_async_twin_takes_the_arguments_of_its_operation(cls: type) -> None:
    for op in _native.OPERATIONS:
        blocking = inspect.signature(getattr(cls, op))
        pending = inspect.signature(getattr(cls, f"{op}_async"))
        assert blocking.parameters == pending.parameters, op


def test_every_operation_is_declared_in_the_stubs() -> None:
    classes = stub_classes()
    declared = {
        node.name for node in classes["_Checkpoints"].body if isinstance(node, ast.FunctionDef)
    }
    missing = [
        name for op in _native.OPERATIONS for name in (op, f"{op}_async") if name not in declared
    ]
    assert not missing, f"_native.pyi's _Checkpoints lacks {missing}"
    for cls in FRONT_ENDS:
        bases = [ast.unparse(base) for base in classes[cls.__name__].bases]
        assert any(base.startswith("_Checkpoints") for base in bases), (cls.__name__, bases)
