"""Random-weight models at Gemma-4-12B shapes (or scaled down), for timings.

The configs are those of ``google/gemma-4-12B-it`` and of the drafters
released for it (``deepseek-ai/dspark_gemma4_12b_block7``,
``dflash_gemma4_12b_block7``, ``google/gemma-4-12B-it-assistant``); see
``shared/docs``. ``scale`` divides widths, depth, vocabulary and window for a
quick run on a small machine. Weights are random: only timings mean anything.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from mlx_dspark.drafters import gemma4_assistant, gemma4_dspark
from mlx_dspark.drafters.deepspec import DeepSpecDrafter
from mlx_dspark.drafters.deepspec_model import Model
from mlx_dspark.drafters.gemma4_assistant import AssistantDrafter

ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
}


def target_config(scale: int = 1) -> dict:
    # Whole groups of five sliding layers and one full one, at least one.
    layers = max(6, 48 // scale // 6 * 6)
    return dict(
        model_type="gemma4_text",
        hidden_size=3840 // scale,
        intermediate_size=15360 // scale,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256 // scale if scale > 1 else 256,
        global_head_dim=512 // scale if scale > 1 else 512,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        vocab_size=262144 // scale,
        vocab_size_per_layer_input=262144 // scale,
        sliding_window=1024 // scale,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6),
        use_double_wide_mlp=False,
        final_logit_softcapping=30.0,
        rope_parameters=ROPE,
        tie_word_embeddings=True,
    )


def drafter_config(target: dict, variant: str = "dspark", scale: int = 1) -> dict:
    layers = target["num_hidden_layers"]
    # The released taps; scaled down, five layers spread the same way.
    taps = (
        [5, 17, 29, 41, 46]
        if scale == 1
        else [i * (layers - 2) // 5 for i in range(1, 6)]
    )
    dspark = variant == "dspark"
    return dict(
        architectures=["Gemma4DSparkModel"],
        hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"],
        num_hidden_layers=5,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=1,
        global_head_dim=target["global_head_dim"],
        attention_k_eq_v=True,
        vocab_size=target["vocab_size"],
        rope_parameters=ROPE,
        final_logit_softcapping=30.0,
        block_size=7,
        num_target_layers=layers,
        target_layer_ids=taps,
        mask_token_id=4,
        markov_rank=256 // scale if dspark else 0,
        markov_head_type="vanilla" if dspark else None,
        enable_confidence_head=dspark,
        confidence_head_with_markov=dspark,
    )


def assistant_config(target: dict, scale: int = 1) -> dict:
    return dict(
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=False,
        text_config=dict(
            hidden_size=1024 // scale,
            intermediate_size=8192 // scale,
            num_hidden_layers=4,
            num_attention_heads=16,
            head_dim=target["head_dim"],
            global_head_dim=target["global_head_dim"],
            num_key_value_heads=target["num_key_value_heads"],
            num_global_key_value_heads=target["num_global_key_value_heads"],
            attention_k_eq_v=True,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            sliding_window=target["sliding_window"],
            rope_parameters=ROPE,
            vocab_size=target["vocab_size"],
        ),
    )


def quantize(model: nn.Module, bits: int, group_size: int = 64) -> nn.Module:
    """MLX affine quantization of every quantizable layer (the confidence
    head stays float, as ``mlx_dspark convert`` leaves it)."""
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda path, m: (
            hasattr(m, "to_quantized")
            and "confidence_head" not in path
            and m.weight.shape[-1] % group_size == 0
        ),
    )
    mx.eval(model.parameters())
    return model


def finish(model: nn.Module, dtype=mx.bfloat16, bits=None):
    """``model`` in ``dtype``, evaluated, quantized to ``bits`` if given."""
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return quantize(model, bits) if bits else model


def make_target(scale=1, dtype=mx.bfloat16, bits=None):
    return make_target_from(target_config(scale), dtype, bits)


def target_module(scale=1):
    """The target before its weights are evaluated (what MLX's launch
    settings, read at the device's first evaluation, may be decided from)."""
    return gemma4_text.Model(gemma4_text.ModelArgs.from_dict(target_config(scale)))


def make_target_from(config: dict, dtype=mx.bfloat16, bits=None):
    args = gemma4_text.ModelArgs.from_dict(config)
    return finish(gemma4_text.Model(args), dtype, bits)


def make_drafter(scale=1, variant="dspark", dtype=mx.bfloat16, bits=None):
    config = drafter_config(target_config(scale), variant, scale)
    model = Model(gemma4_dspark.ModelArgs.from_dict(config))
    return DeepSpecDrafter(
        finish(model, dtype, bits), "gemma4", Path(f"<random {variant}>")
    )


def make_assistant(scale=1, dtype=mx.bfloat16, bits=None, block_size=6):
    config = assistant_config(target_config(scale), scale)
    model = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_dict(config))
    return AssistantDrafter(
        finish(model, dtype, bits),
        Path("<random assistant>"),
        block_size,
        "transformers",
    )
