"""Where a block's bytes live in stock vLLM's KV cache (upstream mode, worker side).

What it owns: turning what a worker rank is given — the per-layer KV-cache
views of ``register_kv_caches`` and the ``KVCacheConfig`` of the connector's
constructor — into (a) the :class:`lmcache_rc.worker.PageRegions` the
transfer engine copies (one page per block per KV-cache group, made of byte
regions of the backing allocation) and (b) the address-free worker layout
every rank reports and every manifest carries (part of the checkpoint
identity, invariant I3).

A page of group ``g`` at block ``b`` is, for each layer of the group in the
group's layer order, the bytes of that layer's view at block ``b`` (``view[b]``,
after grouping kernel blocks back into vLLM blocks), split into contiguous
runs. The region templates are derived from the
views' own strides, so any layout vLLM resolves (layer- or block-outermost,
heads inside or outside the block) is described exactly; padding of a Mamba
page beyond its state bytes is not copied.

What it must never do: put an address, a block count or any other value that
differs between ranks or replicas into the layout dict (it would split the
namespace), or describe a region that is not inside the allocation.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_rc.vllm.api import KVCacheConfig, KVCacheGroupSpec, layer_spec, spec_kind

__all__ = ["LayoutError", "UpstreamLayout", "build_upstream_layout", "group_name"]

LAYOUT_FORMAT = "vllm-upstream-v1"
"""The ``format`` field of an upstream-mode worker layout."""


class LayoutError(ValueError):
    """The KV cache cannot be described as pages of byte regions."""


def group_name(group_index: int) -> str:
    """The manifest page-group name of vLLM KV-cache group ``group_index``."""
    return f"g{group_index}"


@dataclass(frozen=True)
class GroupPages:
    """One KV-cache group's page: its kind, block size and region templates."""

    index: int
    kind: str
    """``"attention"`` or ``"recurrent"``."""
    block_size: int
    page_bytes: int
    regions: tuple[tuple[int, int, int, int], ...]
    """``(buffer, offset of block 0, block stride, length)`` per region."""


@dataclass(frozen=True)
class UpstreamLayout:
    """The pages of one worker rank."""

    layout: dict[str, Any]
    """Address-free description (identical on every rank of an engine)."""
    groups: tuple[GroupPages, ...]
    buffers: tuple[Any, ...]
    """One tensor per distinct backing allocation (uint8 views of the storage)."""
    num_blocks: int


def _tensors(value: Any) -> list[Any]:
    """A layer's cache: one tensor, or a list/tuple of state tensors."""
    if isinstance(value, list | tuple):
        return [t for t in value if hasattr(t, "untyped_storage")]
    return [value] if hasattr(value, "untyped_storage") else []


def _runs(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    """Contiguous byte runs ``(offset, length)`` covering a strided view, in
    memory order (dims sorted by stride, adjacent dims merged)."""
    dims = [(int(s) * itemsize, int(n)) for n, s in zip(shape, strides, strict=True) if n != 1]
    dims.sort(key=lambda d: -d[0])
    # merge from the innermost outwards while dims are contiguous
    inner = itemsize
    while dims and dims[-1][0] == inner:
        stride, n = dims.pop()
        inner = stride * n
    offsets = [0]
    for stride, n in reversed(dims):
        offsets = [o + i * stride for i in range(n) for o in offsets]
    offsets.sort()
    runs: list[tuple[int, int]] = []
    for o in offsets:
        if runs and runs[-1][0] + runs[-1][1] == o:
            runs[-1] = (runs[-1][0], runs[-1][1] + inner)
        else:
            runs.append((o, inner))
    return runs


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with touching or overlapping runs joined."""
    out: list[tuple[int, int]] = []
    for off, length in sorted(runs):
        if out and off <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], off + length)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((off, length))
    return out


def build_upstream_layout(
    kv_caches: Mapping[str, Any], kv_cache_config: KVCacheConfig
) -> UpstreamLayout:
    """Regions and the address-free layout of this rank's KV cache.

    Raises :class:`LayoutError` naming the layer when a view does not hold
    its blocks along dimension 0, two layers' pages of one group overlap, or
    a region leaves its allocation.
    """
    num_blocks = int(kv_cache_config.num_blocks)
    storages: dict[int, tuple[int, Any]] = {}  # data_ptr -> (buffer index, uint8 tensor)
    groups: list[GroupPages] = []
    described: list[dict[str, Any]] = []
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        kind = spec_kind(group.kv_cache_spec)
        if kind is None:
            raise LayoutError(
                f"KV-cache group {gi} ({type(group.kv_cache_spec).__name__}) is neither full "
                "attention nor recurrent state; lmcache-rc cannot checkpoint it"
            )
        regions: list[tuple[int, int, int, int]] = []
        layers: list[list[Any]] = []
        for layer in group.layer_names:
            spec = layer_spec(group, layer)
            real = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
            tensors = _tensors(kv_caches.get(layer))
            if not tensors:
                raise LayoutError(f"register_kv_caches has no tensor for layer {layer!r}")
            # One view, or one view per state tensor (a Mamba layer's conv and
            # SSM states): block b of the layer is the union of every view's [b].
            starts: list[tuple[int, int]] = []
            buffer = -1
            block_stride = 0
            for view in tensors:
                rows = int(view.shape[0]) if len(view.shape) else 0
                if rows == 0 or rows % num_blocks:
                    raise LayoutError(
                        f"the KV-cache view of {layer!r} has shape {tuple(view.shape)}; "
                        f"expected blocks along dimension 0 ({num_blocks} blocks, or a "
                        "multiple of them when kernel blocks split a block)"
                    )
                if rows != num_blocks:
                    # kernel blocks: each block is `rows // num_blocks` evenly strided
                    # kernel blocks (vLLM's group_kernel_blocks does the same view)
                    view = view.unflatten(0, (num_blocks, -1))
                storage = view.untyped_storage()
                base = int(storage.data_ptr())
                if base not in storages:
                    import torch  # type: ignore[import-not-found, unused-ignore]

                    flat = torch.empty(0, dtype=torch.uint8, device=view.device).set_(
                        storage, 0, (int(storage.nbytes()),)
                    )
                    storages[base] = (len(storages), flat)
                index, flat = storages[base]
                itemsize = int(view.element_size())
                stride = int(view.stride(0)) * itemsize
                if buffer not in (-1, index) or block_stride not in (0, stride):
                    raise LayoutError(
                        f"the state tensors of {layer!r} do not share one allocation and "
                        "block stride"
                    )
                buffer, block_stride = index, stride
                start = int(view.data_ptr()) - base
                starts.extend(
                    (start + off, length)
                    for off, length in _runs(view.shape[1:], view.stride()[1:], itemsize)
                )
            total = 0
            layer_regions: list[tuple[int, int, int, int]] = []
            for off, length in _merge(starts):
                if total >= real:
                    break  # padding past the state bytes is not copied
                length = min(length, real - total)
                layer_regions.append((buffer, off, block_stride, length))
                total += length
            if total != real:
                raise LayoutError(
                    f"the KV-cache view of {layer!r} covers {total} bytes per block, its spec "
                    f"says {real}"
                )
            flat = next(f for i, f in storages.values() if i == buffer)
            size = int(flat.numel())
            for _, off, stride, length in layer_regions:
                last = off + (num_blocks - 1) * stride + length
                if off < 0 or stride <= 0 or last > size:
                    raise LayoutError(
                        f"a page region of {layer!r} leaves its KV-cache allocation "
                        f"({off} + {num_blocks - 1} x {stride} + {length} > {size})"
                    )
            fresh = [r for r in layer_regions if r not in regions]
            if not fresh:
                continue  # a layer sharing another layer's cache (vLLM's KV sharing)
            regions.extend(fresh)
            layers.append([layer, real, [length for *_, length in fresh]])
        _check_disjoint(gi, regions)
        block_size = int(group.kv_cache_spec.block_size)
        page_bytes = sum(r[3] for r in regions)
        groups.append(GroupPages(gi, kind, block_size, page_bytes, tuple(regions)))
        described.append(
            {
                "name": group_name(gi),
                "kind": kind,
                "spec": type(group.kv_cache_spec).__name__,
                "block_size": block_size,
                "page_bytes": page_bytes,
                "layers": layers,
            }
        )
    layout = {
        "format": LAYOUT_FORMAT,
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None) or ""),
        "groups": described,
    }
    buffers = tuple(flat for _, flat in sorted(storages.values(), key=lambda bf: bf[0]))
    return UpstreamLayout(layout, tuple(groups), buffers, num_blocks)


def _check_disjoint(group: int, regions: Sequence[tuple[int, int, int, int]]) -> None:
    """Two layers of one group must not share bytes of one block."""
    spans = sorted((buf, off, off + length) for buf, off, _, length in regions)
    for a, b in itertools.pairwise(spans):
        if a[0] == b[0] and b[1] < a[2]:
            raise LayoutError(
                f"KV-cache group {group}: two layers' pages of one block overlap "
                f"(bytes {b[1]}..{a[2]} of allocation {a[0]})"
            )


def group_kinds(kv_cache_config: KVCacheConfig) -> list[tuple[str | None, KVCacheGroupSpec]]:
    """``(kind, group)`` for every KV-cache group (kind None: unsupported)."""
    return [(spec_kind(g.kv_cache_spec), g) for g in kv_cache_config.kv_cache_groups]
