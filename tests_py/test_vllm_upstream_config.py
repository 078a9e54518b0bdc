"""Upstream-mode configuration without vLLM: options, ``"auto"`` revisions,
start-up prerequisites and mode choice. (The mode itself runs under vLLM's
real scheduler in ``tests_vllm/``.)"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_rc.vllm.connector import resolve_mode, upstream_problems
from lmcache_rc.vllm.identity import (
    resolve_source_revision,
    resolve_target_revision,
    snapshot_revision,
    vllm_distribution_digest,
)
from lmcache_rc.vllm.options import InvalidConnectorConfig, parse_options

IDENTITY = {"target_revision": "a" * 40, "source_revision": "b" * 40}


def extra(**kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"lmcache_rc.checkpoint_identity": dict(IDENTITY)}
    out.update({f"lmcache_rc.{k}": v for k, v in kw.items()})
    return out


def test_upstream_options_have_documented_defaults() -> None:
    opts = parse_options(extra(), speculative=False)
    assert opts.vllm_api == "auto"
    assert opts.store_prompt == "last"
    assert opts.store_response is True


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("vllm_api", "fork", "vllm_api must be one of 'auto', 'boundary', 'upstream'"),
        ("store_prompt", "every", "store_prompt must be one of 'last', 'all', 'none'"),
        ("store_response", "yes", "store_response must be true or false"),
    ],
)
def test_bad_upstream_options_name_the_option(key: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidConnectorConfig, match=f"lmcache_rc.{message}"):
        parse_options(extra(**{key: value}), speculative=False)


def test_auto_revisions_pass_option_parsing() -> None:
    opts = parse_options(
        {"lmcache_rc.checkpoint_identity": {"target_revision": "auto", "source_revision": "auto"}},
        speculative=False,
    )
    assert (opts.target_revision, opts.source_revision) == ("auto", "auto")


def test_a_moving_revision_name_is_refused_with_the_alternative_named() -> None:
    with pytest.raises(InvalidConnectorConfig, match='or "auto"'):
        parse_options(
            {
                "lmcache_rc.checkpoint_identity": {
                    "target_revision": "main",
                    "source_revision": "auto",
                }
            },
            speculative=False,
        )


def test_target_revision_auto_reads_the_snapshot_commit(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    model = tmp_path / "models--org--name" / "snapshots" / commit
    model.mkdir(parents=True)
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None))
    assert resolve_target_revision("auto", config) == commit
    assert snapshot_revision(str(model)) == commit
    assert resolve_target_revision("c" * 40, config) == "c" * 40


def test_target_revision_auto_accepts_a_commit_revision_of_a_hub_id() -> None:
    config = SimpleNamespace(model_config=SimpleNamespace(model="org/name", revision="d" * 40))
    assert resolve_target_revision("auto", config) == "d" * 40


def test_a_local_directory_is_not_proven_by_a_revision_it_ignores(tmp_path: Path) -> None:
    # vLLM loads a local directory whatever --revision says
    assert snapshot_revision(str(tmp_path), "c" * 40) is None
    commit = "0123456789abcdef0123456789abcdef01234567"
    model = tmp_path / "snapshots" / commit
    model.mkdir(parents=True)
    assert snapshot_revision(str(model), commit) == commit
    assert snapshot_revision(str(model), "c" * 40) is None  # a contradiction proves nothing


def test_target_revision_auto_refuses_a_plain_directory(tmp_path: Path) -> None:
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path), revision=None))
    with pytest.raises(InvalidConnectorConfig, match="not a Hugging Face cache snapshot") as e:
        resolve_target_revision("auto", config)
    assert "target_revision" in str(e.value)
    assert "snapshots/" in str(e.value)  # says where to find it


def test_distribution_digest_is_stable_and_covers_every_file_hash() -> None:
    digest = vllm_distribution_digest("pytest")
    assert digest is not None and len(digest) == 64
    assert digest == vllm_distribution_digest("pytest")
    dist = importlib.metadata.distribution("pytest")
    lines = sorted(f"{f},{f.hash.mode}={f.hash.value}" for f in dist.files or [] if f.hash)
    want = hashlib.sha256(f"pytest=={dist.version}\n".encode())
    for line in lines:
        want.update(line.encode() + b"\n")
    assert digest == want.hexdigest()


def test_source_revision_auto_without_a_wheel_says_what_to_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(InvalidConnectorConfig, match="git rev-parse HEAD"):
        resolve_source_revision("auto")
    assert resolve_source_revision("e" * 40) == "e" * 40


def test_explicit_modes_are_taken_as_given() -> None:
    assert resolve_mode("upstream") == "upstream"
    assert resolve_mode("boundary") == "boundary"


def _config(**over: Any) -> Any:
    kv = SimpleNamespace(kv_role="kv_both", kv_load_failure_policy="recompute")
    cache = SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align")
    parallel = SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1)
    config = SimpleNamespace(kv_transfer_config=kv, cache_config=cache, parallel_config=parallel)
    for path, value in over.items():
        section, name = path.split("__")
        setattr(getattr(config, section), name, value)
    return config


class MambaSpec:
    block_size = 16


class FullAttentionSpec:
    block_size = 16
    sliding_window = None


class SlidingWindowSpec:
    block_size = 16
    sliding_window = 128


def _groups(*specs: Any) -> Any:
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[]) for s in specs]
    )


def test_pipeline_parallelism_is_named() -> None:
    config = _config(parallel_config__pipeline_parallel_size=2)
    problems = upstream_problems(config, _groups(FullAttentionSpec(), MambaSpec()))
    assert problems == [
        "pipeline_parallel_size is 2: upstream mode supports tensor parallelism only "
        "(each pipeline stage holds other layers)"
    ]


def test_prerequisites_met_give_no_problem() -> None:
    assert upstream_problems(_config(), _groups(FullAttentionSpec(), MambaSpec())) == []


def test_every_unmet_prerequisite_is_named_with_its_fix() -> None:
    problems = upstream_problems(
        _config(
            kv_transfer_config__kv_load_failure_policy="fail",
            kv_transfer_config__kv_role="kv_producer",
            cache_config__enable_prefix_caching=False,
            cache_config__mamba_cache_mode="none",
            parallel_config__decode_context_parallel_size=2,
        ),
        _groups(FullAttentionSpec(), MambaSpec(), SlidingWindowSpec()),
    )
    text = "\n".join(problems)
    assert len(problems) == 6, problems
    assert '"kv_load_failure_policy": "recompute"' in text
    assert '"kv_role": "kv_both"' in text
    assert "--enable-prefix-caching" in text
    assert "mamba_cache_mode is 'none'" in text
    assert "decode_context_parallel_size is 2" in text
    assert "KV-cache group 2 is SlidingWindowSpec" in text


def test_attention_only_models_are_fine() -> None:
    config = _config(cache_config__mamba_cache_mode="none")
    assert upstream_problems(config, _groups(FullAttentionSpec())) == []
