"""The exception hierarchy of lmcache_rc.errors and Rust log forwarding."""

from __future__ import annotations

import inspect
import logging

import pytest

import lmcache_rc as rc
from lmcache_rc import _native, errors
from lmcache_rc.errors import CheckpointError, InvalidInput, InvalidType

ERROR_CLASSES = [
    obj
    for _, obj in inspect.getmembers(errors, inspect.isclass)
    if obj.__module__ == errors.__name__
]


def test_errors_module_exports_every_class_it_defines() -> None:
    assert sorted(errors.__all__) == sorted(c.__name__ for c in ERROR_CLASSES)
    assert rc.errors is errors


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_derives_from_checkpoint_error(cls: type) -> None:
    assert issubclass(cls, CheckpointError)
    assert issubclass(cls, Exception)
    instance = cls("message")
    assert instance.args == ("message",)
    assert "message" in str(instance)
    assert cls.__doc__


def test_invalid_input_is_a_value_error() -> None:
    assert issubclass(InvalidInput, ValueError)
    assert issubclass(InvalidInput, CheckpointError)
    with pytest.raises(ValueError):
        rc.TokenRoots.build("ns", [-1])


def test_invalid_type_is_both_invalid_input_and_type_error() -> None:
    assert issubclass(InvalidType, InvalidInput)
    assert issubclass(InvalidType, TypeError)
    assert issubclass(InvalidType, ValueError)
    with pytest.raises(TypeError):
        rc.TokenRoots.build("ns", "text")
    with pytest.raises(ValueError):
        rc.TokenRoots.build("ns", "text")


def test_builtin_bases_follow_the_documented_mapping() -> None:
    assert issubclass(errors.GenerationConflict, InvalidInput)
    assert issubclass(errors.StorageIOError, OSError)
    assert issubclass(errors.NotFound, LookupError)
    for cls in (errors.Closed, errors.CorruptData, errors.DatabaseError, errors.LeasesLive):
        assert not issubclass(cls, (ValueError, TypeError, OSError, KeyError))


def test_native_error_mapping_names_only_existing_classes() -> None:
    mapping = _native._error_classes()
    assert mapping
    kinds = [kind for kind, _ in mapping]
    assert len(kinds) == len(set(kinds))
    for kind, class_name in mapping:
        assert isinstance(kind, str)
        assert class_name in errors.__all__, (kind, class_name)
        assert issubclass(getattr(errors, class_name), CheckpointError)
    names = dict(mapping)
    assert names["InvalidInput"] == "InvalidInput"
    assert names["InvalidType"] == "InvalidType"


def test_native_errors_are_instances_of_the_python_classes() -> None:
    with pytest.raises(InvalidInput) as info:
        rc.TokenRoots.build("ns", [1], 0)
    assert type(info.value) is InvalidInput
    with pytest.raises(InvalidType) as type_info:
        rc.checkpoint_namespace({"layout": {1, 2}})
    assert type(type_info.value) is InvalidType


def test_rust_log_records_reach_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        _native._log_for_test("warning", "hello")
    records = [r for r in caplog.records if r.getMessage() == "hello"]
    assert len(records) == 1
    record = records[0]
    assert record.name.startswith("lmcache_rc")
    assert record.levelno == logging.WARNING


@pytest.mark.parametrize(
    ("level", "levelno"),
    [
        ("error", logging.ERROR),
        ("warning", logging.WARNING),
        ("info", logging.INFO),
        ("debug", logging.DEBUG),
    ],
)
def test_rust_log_levels_map_to_python_levels(
    caplog: pytest.LogCaptureFixture, level: str, levelno: int
) -> None:
    message = f"level-{level}"
    with caplog.at_level(logging.DEBUG, logger="lmcache_rc"):
        _native._log_for_test(level, message)
    matching = [r for r in caplog.records if r.getMessage() == message]
    assert [r.levelno for r in matching] == [levelno]
    assert matching[0].name.startswith("lmcache_rc")


def test_rust_log_records_honour_the_python_level(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="lmcache_rc"):
        _native._log_for_test("info", "filtered-out")
        _native._log_for_test("error", "kept")
    messages = [r.getMessage() for r in caplog.records]
    assert "kept" in messages
    assert "filtered-out" not in messages


def test_log_for_test_refuses_an_unknown_level() -> None:
    with pytest.raises(InvalidInput):
        _native._log_for_test("verbose", "x")
