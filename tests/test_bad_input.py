"""Bad input gets a precise ValueError that says what to do, and nothing is lost."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache

import mlx_dspark
from mlx_dspark import speculative_generate_step

from conftest import DEEPSPEC_TINY, FIXTURES
from tiny import tiny_gemma4

DSPARK = DEEPSPEC_TINY / "dspark_tiny_gemma4_block4"
DFLASH = DEEPSPEC_TINY / "dflash_tiny_gemma4_block4"


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, drop=(), replace=None):
    weights = mx.load(str(path / "model.safetensors"))
    for name in drop:
        del weights[name]
    weights.update(replace or {})
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def refused(match, path, **options):
    with pytest.raises(ValueError, match=match):
        mlx_dspark.load_drafter(path, **options)


def test_missing_directory(tmp_path):
    refused("No checkpoint directory", tmp_path / "nope")


def test_a_file_instead_of_a_directory(checkpoint):
    refused("is a file; pass the checkpoint's directory", checkpoint / "config.json")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    refused("has no config.json", checkpoint)


def test_config_that_is_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    refused("is not valid JSON", checkpoint)


def test_unknown_architecture(checkpoint):
    edit_config(checkpoint, architectures=["LlamaForCausalLM"])
    refused(
        r"not a drafter checkpoint .*LlamaForCausalLM.*deepspec-gemma4 \(Gemma4DSparkModel\)",
        checkpoint,
    )


def test_missing_config_field(checkpoint):
    edit_config(checkpoint, target_layer_ids=None)
    refused("lacks required field.*target_layer_ids", checkpoint)


def test_tapping_the_last_target_layer(checkpoint):
    edit_config(checkpoint, target_layer_ids=[1, 5])
    refused(
        r"target_layer_ids \[1, 5\] must be strictly increasing, each in \[-1, 4\]",
        checkpoint,
    )


def test_unknown_markov_head(checkpoint):
    edit_config(checkpoint, markov_head_type="transformer")
    refused(
        "markov_head_type 'transformer' is not one of vanilla, gated, rnn", checkpoint
    )


def test_non_integer_block_size(checkpoint):
    edit_config(checkpoint, block_size="7")
    refused("block_size must be an integer, got '7'", checkpoint)


def test_mask_token_outside_the_vocabulary(checkpoint):
    edit_config(checkpoint, mask_token_id=512)
    refused(r"mask_token_id 512 is outside the vocabulary \[0, 512\)", checkpoint)


def test_rope_without_theta(checkpoint):
    edit_config(
        checkpoint, rope_parameters={"full_attention": {"rope_type": "proportional"}}
    )
    refused("no 'full_attention' entry with a rope_theta", checkpoint)


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    refused(r"has no model\*\.safetensors weights", checkpoint)


def test_corrupt_weights(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused("corrupt or truncated", checkpoint)


def test_missing_tensor(checkpoint):
    edit_weights(checkpoint, drop=["markov_head.markov_w2.weight"])
    refused(
        "do not match its config.json: Missing 1 parameters: markov_head.markov_w2.weight",
        checkpoint,
    )


def test_misshapen_tensor(checkpoint):
    edit_weights(checkpoint, replace={"fc.weight": mx.zeros((64, 128))})
    refused(
        r"Expected shape \(64, 192\) but received shape \(64, 128\) for parameter fc.weight",
        checkpoint,
    )


def test_bad_options():
    refused(
        r"confidence_threshold must be in \[0, 1\]", DSPARK, confidence_threshold=1.5
    )
    refused("no confidence head", DFLASH, confidence_threshold=0.5)
    refused(
        "take the options confidence_threshold, scheduler, calibration, dtype, lazy; got temperature",
        DSPARK,
        temperature=0.7,
    )
    refused("dtype must be one of", DSPARK, dtype="int8")


@pytest.mark.parametrize(
    "change,problem",
    [
        (dict(layers=5), "it expects 6 decoder layers, the target has 5"),
        (dict(hidden=32), "it expects 64 hidden size, the target has 32"),
        (dict(vocab=96), "it expects 512 vocabulary size, the target has 96"),
    ],
)
def test_drafter_paired_with_the_wrong_target(change, problem):
    shape = dict(layers=6, hidden=64, vocab=512)
    shape.update(change)
    model = tiny_gemma4(**shape)
    drafter = mlx_dspark.load_drafter(DSPARK)
    with pytest.raises(
        ValueError, match=f"was not trained for this target: .*{problem}"
    ):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter))


def test_drafter_of_another_family():
    from mlx_lm import load

    model, _ = load(str(DEEPSPEC_TINY / "target_tiny_gemma4"))
    drafter = mlx_dspark.load_drafter(
        FIXTURES / "deepspec-qwen3-tiny" / "dspark_tiny_qwen3_block4"
    )
    with pytest.raises(ValueError, match="it drafts for qwen3 targets, not gemma4"):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter))


@pytest.mark.parametrize(
    "options,problem",
    [
        (
            dict(num_draft_tokens=0),
            r"num_draft_tokens must be between 1 and 4 for this drafter \(its trained block size is 4\), got 0",
        ),
        (
            dict(num_draft_tokens=5),
            r"num_draft_tokens must be between 1 and 4 for this drafter \(its trained block size is 4\), got 5",
        ),
        (dict(kv_bits=4), "quantized KV cache"),
    ],
)
def test_bad_generation_options(tiny_pair, options, problem):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match=problem):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter, **options))


def test_mlx_lm_prompt_cache_is_refused(tiny_pair):
    model, _, drafter = tiny_pair
    cache = mlx_lm_make_prompt_cache(model) + drafter.make_cache()
    with pytest.raises(ValueError, match="mlx_dspark.make_prompt_cache"):
        next(
            speculative_generate_step(
                mx.array([1, 2]), model, drafter, prompt_cache=cache
            )
        )


def test_prompt_cache_made_for_a_smaller_block(tiny_pair):
    """A cache that cannot roll back a whole verify is refused before any
    token is produced."""
    model, _, drafter = tiny_pair
    from mlx_dspark.spec.engine import adapt_target

    cache = adapt_target(model, drafter).make_cache(2) + drafter.make_cache()
    steps = speculative_generate_step(
        mx.array([1, 2]), model, drafter, prompt_cache=cache, num_draft_tokens=4
    )
    with pytest.raises(ValueError, match="can roll back 2 tokens, but verifying 4"):
        next(steps)


def test_prompt_ids_outside_the_vocabulary(tiny_pair):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match=r"outside the target's vocabulary \[0, 512\)"):
        next(speculative_generate_step(mx.array([1, 600]), model, drafter))


def test_negative_max_tokens(tiny_pair):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match="max_tokens must be positive or -1"):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter, max_tokens=-3))


def test_empty_prompt(tiny_pair):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match="must be a non-empty 1-D array"):
        next(speculative_generate_step(mx.array([], mx.uint32), model, drafter))


def test_uncached_hub_id_offline(offline_hub):
    refused(
        r"deepseek-ai/missing is not a local directory .*hf download deepseek-ai/missing",
        "deepseek-ai/missing",
    )
