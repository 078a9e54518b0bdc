"""Upstream page regions from vLLM's own KV-cache allocation (``allocate_kv_cache``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness import EngineSpec, make_vllm_config, plan_kv_cache, write_model_dir
from vllm.v1.worker.utils import allocate_kv_cache

from lmcache_rc.vllm.layout import LayoutError, build_upstream_layout


def allocation(tmp_path: Path, **spec_fields: object) -> tuple[dict[str, torch.Tensor], object]:
    spec = EngineSpec(
        model_dir=write_model_dir(tmp_path / "model"), extra_config={}, connector=False
    )
    for key, value in spec_fields.items():
        setattr(spec, key, value)
    config = make_vllm_config(spec)
    plan = plan_kv_cache(config, spec)
    caches = allocate_kv_cache(plan.worker, torch.device("cpu"), plan.layout)
    return caches, plan.worker


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC", "BLHNC"])
def test_every_block_compact_layout_gives_one_region_per_layer(tmp_path: Path, layout: str) -> None:
    caches, config = allocation(tmp_path, layout=layout)
    up = build_upstream_layout(caches, config)
    assert [g.kind for g in up.groups] == ["recurrent", "attention"]
    for group in up.groups:
        assert len(group.regions) == 2  # two layers, each one contiguous page
    assert up.groups[0].page_bytes == 2 * 2816  # Mamba pages: state bytes, no padding
    assert up.groups[1].page_bytes == 2 * 4096
    assert len(up.buffers) == 1  # vLLM backs every KV-cache tensor with one allocation


def test_regions_address_exactly_the_bytes_of_each_block(tmp_path: Path) -> None:
    caches, config = allocation(tmp_path, layout="BLNHC")
    up = build_upstream_layout(caches, config)
    (flat,) = up.buffers
    block = 7
    for view in caches.values():
        view[block].view(torch.uint8).reshape(-1)[:16] = 0xAB  # mark the page's first bytes
    marked = set(torch.nonzero(flat == 0xAB).flatten().tolist())
    covered: set[int] = set()
    for group in up.groups:
        for buf, offset, stride, length in group.regions:
            assert buf == 0
            start = offset + block * stride
            covered.update(range(start, start + length))
    assert marked <= covered


def test_the_layout_names_no_address_or_block_count(tmp_path: Path) -> None:
    small, config_small = allocation(tmp_path / "a", num_blocks=64)
    large, config_large = allocation(tmp_path / "b", num_blocks=128)
    a = build_upstream_layout(small, config_small)
    b = build_upstream_layout(large, config_large)
    assert a.layout == b.layout  # replicas with other memory budgets share checkpoints
    assert a.groups != b.groups  # while their regions differ (block strides, offsets)


def test_a_layer_given_as_several_state_tensors_is_one_page(tmp_path: Path) -> None:
    caches, config = allocation(tmp_path)
    mamba = "model.layers.0.linear_attn"
    raw = caches[mamba]  # [B, 1, 1, 2816] int8
    conv = raw[:, 0, 0, : 3 * 64 * 4]
    ssm = raw[:, 0, 0, 3 * 64 * 4 : 2816]
    split = dict(caches)
    split[mamba] = [conv, ssm]  # type: ignore[assignment]
    assert (
        build_upstream_layout(split, config).layout == build_upstream_layout(caches, config).layout
    )


def test_a_layer_sharing_another_layers_cache_adds_no_region(tmp_path: Path) -> None:
    caches, config = allocation(tmp_path)
    group = config.kv_cache_groups[1]  # type: ignore[attr-defined]
    shared = "model.layers.9.self_attn"
    caches[shared] = caches["model.layers.1.self_attn"]
    group.layer_names.append(shared)
    up = build_upstream_layout(caches, config)
    assert len(up.groups[1].regions) == 2


def test_a_view_without_blocks_first_is_refused(tmp_path: Path) -> None:
    caches, config = allocation(tmp_path)
    caches["model.layers.1.self_attn"] = caches["model.layers.1.self_attn"].transpose(0, 2)
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.self_attn"):
        build_upstream_layout(caches, config)


def test_an_unsupported_group_kind_is_named() -> None:
    class SlidingWindowSpec:
        block_size = 16
        sliding_window = 64

    config = SimpleNamespace(
        num_blocks=8,
        kv_cache_groups=[SimpleNamespace(layer_names=["x"], kv_cache_spec=SlidingWindowSpec())],
    )
    with pytest.raises(LayoutError, match=r"group 0 \(SlidingWindowSpec\)"):
        build_upstream_layout({}, config)  # type: ignore[arg-type]
