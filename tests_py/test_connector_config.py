"""The connector's configuration surface: options, revisions, and the vLLM method surface.

The upstream names below are a literal copy of the abstract methods of vLLM's
``KVConnectorBase_V1`` and ``SupportsHMA`` (vllm/distributed/kv_transfer/
kv_connector/v1/base.py, checked against the vllm 0.33.0 wheel) plus the
fork's boundary hooks, so a rename on either side shows up here even where
vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import rpc_helpers

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.vllm.api import KVConnectorRole, SupportsHMA
from lmcache_rc.vllm.connector import LMCacheRecurrentCheckpointConnector
from lmcache_rc.vllm.identity import PRECISION_ENV_VARS, checkpoint_identity
from lmcache_rc.vllm.options import (
    OPTION_DEFAULTS,
    OPTIONS,
    ConnectorOptions,
    InvalidConnectorConfig,
    parse_options,
)

TARGET = "0123456789abcdef0123456789abcdef01234567"
SOURCE = "89abcdef" * 8  # 64 hex digits
DRAFT = "fedcba9876543210fedcba9876543210fedcba98"

# Abstract methods of upstream vLLM (parameter names in order; "**kwargs" marks VAR_KEYWORD).
UPSTREAM_ABSTRACT: dict[str, list[str]] = {
    # KVConnectorBase_V1, worker side
    "start_load_kv": ["self", "forward_context", "**kwargs"],
    "wait_for_layer_load": ["self", "layer_name"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "**kwargs"],
    "wait_for_save": ["self"],
    # KVConnectorBase_V1, scheduler side
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["self", "scheduler_output"],
    # SupportsHMA
    "request_finished_all_groups": ["self", "request", "block_ids"],
}

# Upstream methods with defaults that the connector overrides: same parameters.
UPSTREAM_OVERRIDDEN: dict[str, list[str]] = {
    "register_kv_caches": ["self", "kv_caches"],
    "register_cross_layers_kv_cache": ["self", "kv_cache", "attn_backend"],
    "set_host_xfer_buffer_ops": ["self", "copy_operation"],
    "handle_preemptions": ["self", "kv_connector_metadata"],
    "get_finished": ["self", "finished_req_ids"],
    "get_block_ids_with_load_errors": ["self"],
    "shutdown": ["self"],
    "get_kv_connector_stats": ["self"],
    "get_kv_connector_kv_cache_events": ["self"],
    "get_handshake_metadata": ["self"],
    "build_connector_worker_meta": ["self"],
    "bind_gpu_block_pool": ["self", "gpu_block_pool"],
    "update_connector_output": ["self", "connector_output"],
    "request_finished": ["self", "request", "block_ids"],
    "take_events": ["self"],
    "has_pending_push_work": ["self"],
    "get_finished_count": ["self"],
    "set_xfer_handshake_metadata": ["self", "metadata"],
    "set_xfer_handshake_metadata_pp_aware": ["self", "metadata"],
    "reset_cache": ["self"],
}

UPSTREAM_CLASSMETHODS: dict[str, list[str]] = {
    "get_required_kvcache_layout": ["vllm_config"],
    "requires_piecewise_for_cudagraph": ["extra_config"],
    "build_kv_connector_stats": ["data"],
    "build_prom_metrics": ["vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"],
    # fork: config-time capability (called on the class)
    "supports_request_boundary_checkpoints": ["vllm_config"],
}

# Boundary-checkpoint hooks of the local-inference-lab fork (docs/design/vllm-boundary-api.md §2.2).
FORK_HOOKS: dict[str, list[str]] = {
    "bind_boundary_checkpoint_cache": ["self", "manager"],
    "bind_boundary_checkpoint_state": ["self", "state"],
    "poll_boundary_checkpoint": ["self", "request"],
    "boundary_checkpoint_external_tokens": ["self", "request"],
    "store_boundary_checkpoint": ["self", "request", "checkpoint"],
}

UPSTREAM_PROPERTIES = ("role", "requires_kv_delivery", "prefer_cross_layer_blocks")


def params(fn: Any) -> list[str]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        out.append(f"**{p.name}" if p.kind is inspect.Parameter.VAR_KEYWORD else p.name)
    return out


def identity(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"target_revision": TARGET, "source_revision": SOURCE}
    values.update(overrides)
    return {k: v for k, v in values.items() if v is not None}


def extra(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "lmcache_rc.socket": "/tmp/lmcache-rc-test.sock",
        "lmcache_rc.checkpoint_identity": identity(),
    }
    values.update({f"lmcache_rc.{k}": v for k, v in overrides.items()})
    return values


def make_config(
    extra_config: dict[str, Any] | None, *, speculative: bool = False, rank: int = 0, world: int = 2
) -> SimpleNamespace:
    kv = None
    if extra_config is not None:
        kv = SimpleNamespace(
            kv_connector="LMCacheRecurrentCheckpointConnector",
            kv_connector_module_path="lmcache_rc.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config,
            engine_id="engine",
            kv_load_failure_policy="fail",
            is_kv_producer=True,
            get_from_extra_config=lambda key, default: extra_config.get(key, default),
        )
    return SimpleNamespace(
        kv_transfer_config=kv,
        parallel_config=SimpleNamespace(
            tensor_parallel_size=world,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            decode_context_parallel_size=1,
            cp_kv_cache_interleave_size=1,
            world_size=world,
            rank=rank,
        ),
        speculative_config=SimpleNamespace(method="mtp", num_speculative_tokens=1)
        if speculative
        else None,
        model_config=SimpleNamespace(max_model_len=128, compute_hash=lambda: "model-hash"),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        compute_hash=lambda: "runtime-hash",
    )


# --------------------------------------------------------------------------- surface


@pytest.mark.parametrize("name", sorted(UPSTREAM_ABSTRACT))
def test_every_upstream_abstract_method_is_implemented_with_its_parameters(name: str) -> None:
    cls = LMCacheRecurrentCheckpointConnector
    assert name in cls.__dict__, f"{name} must be implemented by the connector itself"
    assert not getattr(cls.__dict__[name], "__isabstractmethod__", False)
    assert params(getattr(cls, name)) == UPSTREAM_ABSTRACT[name]


@pytest.mark.parametrize("name", sorted(UPSTREAM_OVERRIDDEN))
def test_overridden_upstream_methods_keep_their_parameters(name: str) -> None:
    cls = LMCacheRecurrentCheckpointConnector
    assert name in cls.__dict__
    assert params(getattr(cls, name)) == UPSTREAM_OVERRIDDEN[name]


@pytest.mark.parametrize("name", sorted(UPSTREAM_CLASSMETHODS))
def test_classmethods_keep_their_parameters(name: str) -> None:
    cls = LMCacheRecurrentCheckpointConnector
    assert isinstance(cls.__dict__[name], classmethod)
    assert params(getattr(cls, name)) == UPSTREAM_CLASSMETHODS[name]


@pytest.mark.parametrize("name", sorted(FORK_HOOKS))
def test_fork_boundary_hooks_are_implemented(name: str) -> None:
    cls = LMCacheRecurrentCheckpointConnector
    assert name in cls.__dict__
    assert params(getattr(cls, name)) == FORK_HOOKS[name]


def test_class_is_concrete_hma_and_accepts_the_factory_keyword() -> None:
    cls = LMCacheRecurrentCheckpointConnector
    assert not inspect.isabstract(cls)
    assert issubclass(cls, SupportsHMA)
    assert "kv_cache_config" in inspect.signature(cls.__init__).parameters
    for prop in UPSTREAM_PROPERTIES:
        assert isinstance(inspect.getattr_static(cls, prop), property)
    connector = cls(make_config(extra()), KVConnectorRole.SCHEDULER, kv_cache_config=None)
    assert connector.role is KVConnectorRole.SCHEDULER
    assert connector.requires_kv_delivery is False
    assert connector.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert connector.get_finished(set()) == (None, None)
    assert connector.request_finished_all_groups(
        SimpleNamespace(request_id="r"), ([1, 2], [3])
    ) == (False, None)
    assert cls.get_required_kvcache_layout(make_config(extra())) is None


def test_no_hook_asks_the_mode_the_sides_are_chosen_at_bind_time() -> None:
    # Only construction and the bind hooks decide the mode (and the fork's
    # class-level capability query reads the option); every other hook
    # delegates to the side objects chosen there.
    deciders = {
        "__init__",
        "supports_request_boundary_checkpoints",
        "bind_kv_cache_manager",
        "bind_boundary_checkpoint_cache",
        "bind_boundary_checkpoint_state",
        "mode",
    }
    cls = LMCacheRecurrentCheckpointConnector
    for name, member in vars(cls).items():
        if name in deciders:
            continue
        target = member.fget if isinstance(member, property) else member
        target = getattr(target, "__func__", target)
        if not inspect.isfunction(target):
            continue
        source = inspect.getsource(target)
        assert "_mode" not in source, f"{name} asks the mode"
        assert "vllm_api" not in source, f"{name} asks the mode option"


def test_module_imports_without_vllm_or_the_worker_module() -> None:
    import sys

    import lmcache_rc.connector as module

    assert "torch" not in sys.modules
    # vLLM's factory resolves the class by name in the configured module
    cls = getattr(module, "LMCacheRecurrentCheckpointConnector")  # noqa: B009
    assert cls.__module__ == "lmcache_rc.vllm.connector"


# --------------------------------------------------------------------------- options


def test_defaults() -> None:
    opts = parse_options(extra(), speculative=False)
    assert opts == ConnectorOptions(
        socket="/tmp/lmcache-rc-test.sock",
        target_revision=TARGET,
        source_revision=SOURCE,
        draft_revision="",
    )
    assert opts.lookup_timeout == 60.0 and opts.rpc_timeout == 30.0
    assert opts.max_lookup_attempts == 4 and opts.copy_workers == 2
    assert opts.max_copies_per_rank == 16 and opts.chunk_tokens == 4096
    for name, default in OPTION_DEFAULTS.items():
        if default is not None:
            assert getattr(opts, name) == default, name


def test_the_options_table_is_the_one_source_of_fields_types_and_defaults() -> None:
    fields = {f.name: f for f in dataclasses.fields(ConnectorOptions)}
    revisions = ["target_revision", "source_revision", "draft_revision"]
    table = [o.name for o in OPTIONS if o.kind not in ("socket", "identity")]
    assert list(fields) == ["socket", *revisions, *table]
    hints = typing.get_type_hints(ConnectorOptions)
    for option in OPTIONS:
        if option.kind in ("socket", "identity"):
            continue
        assert hints[option.name] is option.type, option.name
        assert fields[option.name].default == option.default, option.name
        assert type(option.parse(option.default)) is option.type, option.name
    # the engine and identity defaults are the core's, not copies
    engine = rc.TransferEngine.defaults()
    assert OPTION_DEFAULTS["copy_workers"] == engine["workers"]
    assert OPTION_DEFAULTS["max_copies_per_rank"] == engine["max_copies_in_flight"]
    assert OPTION_DEFAULTS["rpc_timeout"] == engine["rpc_timeout"]
    assert OPTION_DEFAULTS["chunk_tokens"] == rc.TokenRoots.DEFAULT_CHUNK_TOKENS


def test_the_docs_option_tables_are_generated_from_the_options_table() -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "ci" / "gen_option_docs.py"
    spec = importlib.util.spec_from_file_location("gen_option_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    docs = module.TARGET.read_text()
    assert module.render(docs) == docs, "run python ci/gen_option_docs.py"
    for option in OPTIONS:
        assert docs.count(f"| `lmcache_rc.{option.name}` | {option.shown_default()} |") == 2


def test_max_copies_per_rank_is_read_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = parse_options(extra(max_copies_per_rank=8), speculative=False)
    assert opts.max_copies_per_rank == 8


def test_the_old_name_max_pending_still_works_with_a_deprecation_warning() -> None:
    with pytest.warns(FutureWarning, match=r"lmcache_rc\.max_pending is deprecated") as caught:
        opts = parse_options(extra(max_pending=8), speculative=False)
    assert opts.max_copies_per_rank == 8
    message = str(caught[0].message)
    assert "use lmcache_rc.max_copies_per_rank" in message and "--max-pending" in message
    # The old name is checked like the new one (and the error names the new one).
    with (
        pytest.warns(FutureWarning),
        pytest.raises(InvalidConnectorConfig, match=r"lmcache_rc\.max_copies_per_rank"),
    ):
        parse_options(extra(max_pending=1, copy_workers=2), speculative=False)


def test_the_old_and_new_name_together_are_refused() -> None:
    with pytest.raises(InvalidConnectorConfig, match=r"max_pending and lmcache_rc\.max_copies"):
        parse_options(extra(max_pending=8, max_copies_per_rank=8), speculative=False)


def test_the_unknown_option_message_lists_the_new_name_only() -> None:
    with pytest.raises(InvalidConnectorConfig) as info:
        parse_options(extra(max_copies=8), speculative=False)
    assert "lmcache_rc.max_copies_per_rank" in str(info.value)
    assert "lmcache_rc.max_pending" not in str(info.value)


def test_socket_defaults_to_the_sidecar_default() -> None:
    from lmcache_rc.config import default_socket_path

    values = extra()
    del values["lmcache_rc.socket"]
    assert parse_options(values, speculative=False).socket == default_socket_path()


def test_other_connectors_keys_are_ignored_and_identity_may_be_json() -> None:
    values = extra()
    values["lmcache.mp.something"] = 1
    values["lmcache_rc.checkpoint_identity"] = json.dumps(identity())
    assert parse_options(values, speculative=False).target_revision == TARGET


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ({"checkpoint_identity": None}, "lmcache_rc.checkpoint_identity"),
        ({"checkpoint_identity": "not json"}, "lmcache_rc.checkpoint_identity"),
        ({"checkpoint_identity": ["a"]}, "lmcache_rc.checkpoint_identity"),
        (
            {"checkpoint_identity": identity(target_revision=None)},
            "lmcache_rc.checkpoint_identity.target_revision",
        ),
        (
            {"checkpoint_identity": identity(source_revision="")},
            "lmcache_rc.checkpoint_identity.source_revision",
        ),
        (
            {"checkpoint_identity": {**identity(), "layout": {}}},
            "lmcache_rc.checkpoint_identity",
        ),
        ({"lookup_timeout": "60 parsecs"}, "lmcache_rc.lookup_timeout"),
        ({"lookup_timeout": [60]}, "lmcache_rc.lookup_timeout"),
        ({"lookup_timeout": 0}, "lmcache_rc.lookup_timeout"),
        ({"rpc_timeout": -1.0}, "lmcache_rc.rpc_timeout"),
        ({"rpc_timeout": float("nan")}, "lmcache_rc.rpc_timeout"),
        ({"max_lookup_attempts": 0}, "lmcache_rc.max_lookup_attempts"),
        ({"max_lookup_attempts": True}, "lmcache_rc.max_lookup_attempts"),
        ({"copy_workers": 2.5}, "lmcache_rc.copy_workers"),
        ({"max_copies_per_rank": 1, "copy_workers": 2}, "lmcache_rc.max_copies_per_rank"),
        ({"chunk_tokens": 65537}, "lmcache_rc.chunk_tokens"),
        ({"socket": ""}, "lmcache_rc.socket"),
        ({"socket": 5}, "lmcache_rc.socket"),
        ({"lookup_timout": 3}, "lmcache_rc.lookup_timout"),
    ],
)
def test_missing_malformed_or_unknown_options_are_named(
    overrides: dict[str, Any], option: str
) -> None:
    values = extra(**overrides)
    if values.get("lmcache_rc.checkpoint_identity") is None:
        del values["lmcache_rc.checkpoint_identity"]
    with pytest.raises(InvalidConnectorConfig, match=option.replace(".", r"\.")) as info:
        parse_options(values, speculative=False)
    assert isinstance(info.value, errors.InvalidInput)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "revision",
    [
        "main",
        "v1.0",
        TARGET.upper(),
        TARGET[:-1],
        TARGET + "0",
        "g" * 40,
        " " + TARGET[1:],
        1234,
    ],
)
@pytest.mark.parametrize("field", ["target_revision", "source_revision", "draft_revision"])
def test_connector_capability_rejects_mutable_revision_names(field: str, revision: Any) -> None:
    values = extra(checkpoint_identity=identity(**{"draft_revision": DRAFT, field: revision}))
    config = make_config(values, speculative=True)
    assert (
        LMCacheRecurrentCheckpointConnector.supports_request_boundary_checkpoints(config) is False
    )
    with pytest.raises(InvalidConnectorConfig, match=f"checkpoint_identity.{field}"):
        LMCacheRecurrentCheckpointConnector(config, KVConnectorRole.WORKER)


def test_capability_accepts_immutable_revisions() -> None:
    cls = LMCacheRecurrentCheckpointConnector
    assert cls.supports_request_boundary_checkpoints(make_config(extra())) is True
    spec = make_config(extra(checkpoint_identity=identity(draft_revision=DRAFT)), speculative=True)
    assert cls.supports_request_boundary_checkpoints(spec) is True
    assert parse_options(
        extra(checkpoint_identity=identity(draft_revision=DRAFT)), speculative=True
    )


def test_draft_revision_is_required_with_speculative_decoding_only() -> None:
    cls = LMCacheRecurrentCheckpointConnector
    spec = make_config(extra(), speculative=True)
    assert cls.supports_request_boundary_checkpoints(spec) is False
    with pytest.raises(InvalidConnectorConfig, match=r"draft_revision is required"):
        parse_options(extra(), speculative=True)
    # without speculation a configured draft does not enter the identity
    opts = parse_options(
        extra(checkpoint_identity=identity(draft_revision=DRAFT)), speculative=False
    )
    assert opts.draft_revision == ""


def test_capability_is_false_without_options_or_transfer_config() -> None:
    cls = LMCacheRecurrentCheckpointConnector
    assert cls.supports_request_boundary_checkpoints(make_config(None)) is False
    assert cls.supports_request_boundary_checkpoints(make_config({})) is False
    with pytest.raises(ValueError, match="kv_transfer_config"):
        cls(make_config(None), KVConnectorRole.SCHEDULER)


# --------------------------------------------------------------------------- identity


def test_identity_holds_revisions_config_hashes_precision_and_geometry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in PRECISION_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    config = make_config(extra())
    ident = checkpoint_identity(config, parse_options(extra(), speculative=False))
    assert ident["target_revision"] == TARGET and ident["source_revision"] == SOURCE
    assert ident["draft_revision"] == ""
    assert ident["runtime_config_hash"] == "runtime-hash"
    assert ident["model_config_hash"] == "model-hash"
    assert ident["parallel"] == {"tp": 2, "dcp": 1, "cp_interleave": 1}
    assert ident["precision_environment"]["VLLM_ATTENTION_BACKEND"] == "FLASHINFER"
    assert ident["precision_environment"]["VLLM_USE_DEEP_GEMM"] is None
    assert "layout" not in ident
    ns = rc.checkpoint_namespace({**ident, "layout": {"page_bytes": 64}})
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    other = checkpoint_identity(config, parse_options(extra(), speculative=False))
    assert rc.checkpoint_namespace({**other, "layout": {"page_bytes": 64}}) != ns


# --------------------------------------------------------------------------- scheduler role


class _Manager:
    """Just enough allocator for the bridge to bind (no lookups run here)."""

    def __init__(self) -> None:
        self.boundary_checkpoints = SimpleNamespace(find=lambda request, n: None)
        self.kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=["a"], kv_cache_spec=object())]
        )
        self.coordinator = SimpleNamespace(single_type_managers=[SimpleNamespace(block_size=4)])


def test_scheduler_role_is_inert_until_the_cache_is_bound(tmp_path: Path) -> None:
    srv = rc.Server.start(rpc_helpers.config(tmp_path))
    try:
        values = extra(socket=srv.socket_path, layout_timeout=0)
        connector = LMCacheRecurrentCheckpointConnector(
            make_config(values), KVConnectorRole.SCHEDULER, kv_cache_config=None
        )
        request = SimpleNamespace(request_id="r", all_token_ids=[1, 2, 3], num_tokens=3)
        assert connector.poll_boundary_checkpoint(request) is True
        assert connector.has_pending_push_work() is False
        assert connector.build_connector_meta(None).tasks == ()
        assert connector.report_status()["bound"] is False
        connector.bind_boundary_checkpoint_cache(_Manager())
        assert connector.bridge is not None
        assert connector.has_pending_push_work() is True  # layouts not reported yet
        assert connector.poll_boundary_checkpoint(request) is False
        status = connector.report_status()
        json.dumps(status)
        assert status["role"] == "scheduler" and status["layout_negotiated"] is False
        connector.shutdown()
    finally:
        srv.stop()


def test_unreachable_sidecar_names_the_socket_option(tmp_path: Path) -> None:
    values = extra(socket=str(tmp_path / "nobody.sock"), connect_timeout=0.2)
    connector = LMCacheRecurrentCheckpointConnector(make_config(values), KVConnectorRole.SCHEDULER)
    with pytest.raises(errors.Unavailable, match=r"lmcache_rc\.socket"):
        connector.bind_boundary_checkpoint_cache(_Manager())


def test_timeout_options_read_the_one_duration_grammar() -> None:
    # The grammar of every duration setting (docs/configuration.md): plain
    # seconds as numbers or text, or a number with a unit.
    opts = parse_options(
        extra(lookup_timeout="250ms", task_timeout="5m", close_timeout="90", idle_flush=0),
        speculative=False,
    )
    assert (opts.lookup_timeout, opts.task_timeout, opts.close_timeout) == (0.25, 300.0, 90.0)
    assert opts.idle_flush == 0
    for bad in ("soon", "-1s", "1h30m"):
        with pytest.raises(InvalidConnectorConfig, match=r"lmcache_rc\.lookup_timeout"):
            parse_options(extra(lookup_timeout=bad), speculative=False)
