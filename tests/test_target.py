"""The tapped targets (Gemma-4, Qwen3)."""

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from mlx_dspark.plugins import find_target_adapter
from mlx_dspark.targets.gemma4 import Gemma4Target

from tiny import tiny_gemma4, tiny_qwen3

VARIANTS = {
    "dense-k_eq_v": dict(),
    "separate-v": dict(k_eq_v=False),
    "gemma4-wrapper": dict(wrapper=True),
    "per-layer-inputs+kv-sharing": dict(per_layer_input=8, kv_shared=2),
}
BUILDERS = {name: functools.partial(tiny_gemma4, **kw) for name, kw in VARIANTS.items()}
BUILDERS["qwen3"] = tiny_qwen3
BUILDERS["qwen3-tied"] = functools.partial(tiny_qwen3, tie=True)


@functools.lru_cache(maxsize=None)
def model_for(variant, quantize=False):
    model = BUILDERS[variant](seed=3)
    if quantize:
        nn.quantize(
            model,
            group_size=32,
            bits=4,
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0
            ),
        )
    return model


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "4-bit"])
@pytest.mark.parametrize("variant", BUILDERS)
@given(
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=12),
    steps=st.lists(st.integers(1, 5), max_size=4),
    taps=st.sets(st.integers(-1, 3), max_size=4),
)
def test_tap_leaves_logits_bit_identical(variant, quantize, prompt, steps, taps):
    """Over a prompt and several verify-sized steps (for Gemma-4 crossing
    window 4), the tapped forward's logits equal the model's own forward bit
    for bit."""
    model = model_for(variant, quantize)
    target = find_target_adapter(model).adapt(model)
    tapped_cache, plain_cache = target.make_cache(5), target.make_cache(5)
    rng = np.random.default_rng(len(prompt))
    for tokens in [prompt] + [rng.integers(0, 96, k).tolist() for k in steps]:
        x = mx.array(tokens)[None]
        out = target(x, tapped_cache, sorted(taps))
        assert mx.array_equal(out.logits, model(x, cache=plain_cache))
        assert len(out.hidden) == len(taps)


@pytest.mark.parametrize("variant", VARIANTS)
def test_taps_are_raw_layer_outputs(variant):
    """Tap -1 is the scaled embedding; the last layer's tap, final-normed and
    projected, gives the logits (so taps are taken before the final norm)."""
    model = tiny_gemma4(seed=5, **VARIANTS[variant])
    target = Gemma4Target(model)
    x = mx.array([[3, 9, 27, 81]])
    out = target(x, target.make_cache(2), (-1, 3))
    body = target.text.model
    assert mx.array_equal(out.hidden[0], body.embed_tokens(x) * body.embed_scale)
    logits = body.embed_tokens.as_linear(body.norm(out.hidden[1]))
    logits = mx.tanh(logits / 30.0) * 30.0
    np.testing.assert_allclose(np.array(logits), np.array(out.logits), atol=1e-5)


def test_tapped_forward_agrees_with_mlx_lm_caches():
    """With our rollback caches the logits match mlx-lm's own caches."""
    model = tiny_gemma4(seed=2, window=3)
    target = Gemma4Target(model)
    ours, theirs = target.make_cache(4), make_prompt_cache(model)
    for tokens in ([1, 2, 3, 4, 5, 6, 7], [8], [9, 10], [11]):
        x = mx.array(tokens)[None]
        np.testing.assert_allclose(
            np.array(target(x, ours).logits),
            np.array(model(x, cache=theirs)),
            atol=1e-5,
        )


def test_model_is_not_modified():
    """Tapping is per call: no attribute of the model or its class changes."""
    model = tiny_gemma4(seed=4)
    before = {k: id(v) for k, v in vars(model).items()}
    cls_call = type(model).__call__
    layer_call = type(model.layers[0]).__call__
    target = find_target_adapter(model).adapt(model)
    target(mx.array([[1, 2, 3]]), target.make_cache(2), (0, 1))
    assert {k: id(v) for k, v in vars(model).items()} == before
    assert (
        type(model).__call__ is cls_call
        and type(model.layers[0]).__call__ is layer_call
    )


def test_unsupported_target_is_refused():
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        num_attention_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=32,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match="not supported for hidden-state drafting"):
        find_target_adapter(llama.Model(args))


def test_qwen3_taps_are_raw_layer_outputs():
    model = tiny_qwen3(seed=5)
    target = find_target_adapter(model).adapt(model)
    x = mx.array([[3, 9, 27, 81]])
    out = target(x, target.make_cache(2), (-1, 3))
    body = model.model
    assert mx.array_equal(out.hidden[0], body.embed_tokens(x))
    logits = model.lm_head(body.norm(out.hidden[1]))
    np.testing.assert_allclose(np.array(logits), np.array(out.logits), atol=1e-5)
