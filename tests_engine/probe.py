"""The state probe: a minimal vLLM KV connector of the tests, not of lmcache-rc.

It reads what a fresh engine computed for a request, through vLLM's own
connector hooks only: ``register_kv_caches`` gives the worker's KV-cache
tensors, ``request_finished_all_groups`` the request's blocks right after its
last forward (an in-process engine: scheduler and worker share this process,
and nothing runs between that call and the read). For every request it writes
``<LMCACHE_RC_PROBE_OUT>/<num_computed_tokens>.pkl``: per KV-cache group the
pages of the state after exactly that many tokens, gathered block by block
exactly as a checkpoint page is defined (``docs/vllm.md``: a page of group g at
block b is the bytes of each of the group's layers at b), with the dtype of
every byte range and, for the last attention page, which bytes belong to
token slots the state covers.

Run the reference engine with prefix caching off and ``mamba_cache_mode="none"``:
a request's recurrent state then lives in its one state block, so where the
probe reads it owes nothing to align mode's block arithmetic, which is what
the comparison checks.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

_KV: dict[str, Any] = {}
"""layer name -> the KV-cache tensor(s) of the worker in this process."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layer_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, list | tuple):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return [value]


def _raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes in memory order (bfloat16 included): a view whose
    dimensions are permuted in memory is read outermost stride first."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    dense = t.permute(*order).contiguous()
    return dense.view(-1).view(torch.uint8).numpy().copy()


class StateProbeConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Reads the state of each finished request; loads and stores nothing."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._kv_config = kv_cache_config
        self._out = os.environ["LMCACHE_RC_PROBE_OUT"]
        self._scheduler = role == KVConnectorRole.SCHEDULER

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        _KV.update(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        n = int(request.num_computed_tokens)
        groups = []
        for g, group in enumerate(self._kv_config.kv_cache_groups):
            spec = group.kv_cache_spec
            ids = list(block_ids[g])
            bs = int(spec.block_size)
            if isinstance(spec, MambaSpec):
                live = [b for b in ids if b != 0]
                assert len(live) == 1, f"group {g}: expected one state block, got {ids}"
                pages = [self._page(group.layer_names, live[0], None)]
                kind = "recurrent"
            elif isinstance(spec, AttentionSpec):
                pages = []
                last = _cdiv(n, bs)
                for p in range(last):
                    valid = min(bs, n - p * bs)
                    pages.append(self._page(group.layer_names, ids[p], (valid, bs)))
                kind = "attention"
            else:
                raise AssertionError(f"group {g}: unexpected spec {type(spec).__name__}")
            groups.append({"index": g, "kind": kind, "block_size": bs, "pages": pages})
        with open(os.path.join(self._out, f"{n}.pkl"), "wb") as f:
            pickle.dump({"n": n, "groups": groups}, f)
        return False, None

    def _page(self, layers: list[str], block: int, slots: tuple[int, int] | None) -> dict[str, Any]:
        """One page: its bytes, dtype per byte range, and the covered-slot mask."""
        chunks: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        segments: list[tuple[int, int, str]] = []
        at = 0
        num_blocks = int(self._kv_config.num_blocks)
        for name in layers:
            for t in _layer_tensors(_KV[name]):
                per = t.shape[0] // num_blocks  # kernel blocks per vLLM block
                view = t[block * per : (block + 1) * per]
                raw = _raw(view)
                chunks.append(raw)
                segments.append((at, at + raw.size, str(t.dtype)))
                at += raw.size
                if slots is None:
                    masks.append(np.ones(raw.size, dtype=bool))
                else:
                    masks.append(self._slot_mask(view, *slots))
        return {
            "bytes": np.concatenate(chunks),
            "segments": segments,
            "mask": np.concatenate(masks),
        }

    @staticmethod
    def _slot_mask(view: torch.Tensor, valid: int, block_size: int) -> np.ndarray:
        """Bytes of token slots below ``valid`` in a CPU attention block view
        ``[kernel_blocks, heads, kernel_block_size, 2 * head_size]``, read by
        vLLM's CPU backend as ``[.., 2 * kernel_block_size, head_size]``: keys
        in the first half of the rows, values in the second."""
        assert view.is_contiguous() and view.dim() == 4, (tuple(view.shape), view.stride())
        assert view.shape[-1] % 2 == 0, tuple(view.shape)
        kb, heads, kbs, two_hs = view.shape
        assert kb * kbs == block_size, (tuple(view.shape), block_size)
        hs = two_hs // 2
        rows = np.zeros((kb, heads, 2 * kbs, hs), dtype=bool)
        for slot in range(valid):
            k, r = divmod(slot, kbs)
            rows[k, :, r, :] = True
            rows[k, :, kbs + r, :] = True
        return np.repeat(rows.reshape(-1), view.element_size())
