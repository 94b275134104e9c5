"""The Gemma-4 assistant drafter, draft for draft against transformers."""

import functools
import json
import re
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark import speculative_generate_step
from mlx_dspark.drafters.gemma4_assistant import DEFAULT_NUM_ASSISTANT_TOKENS

from conftest import FIXTURES
from tiny import speculative, tiny_gemma4

CASES = ("e2b", "dense", "e2b_random")
ASSISTANT = FIXTURES / "assistant-tiny"


@functools.lru_cache(maxsize=None)
def case(name):
    path = ASSISTANT / name
    oracle = json.loads((path / "oracle.json").read_text())
    model, _ = load(str(path / "target"))
    return oracle, model


def drafter_for(name, **options):
    return mlx_dspark.load_drafter(ASSISTANT / name / "assistant", **options)


def record_steps(drafter):
    """Make ``drafter`` record each draft step's inputs, logits and hidden."""
    steps, network = [], drafter.model

    class Recorder:
        def __call__(self, inputs, kv, position):
            logits, hidden = network(inputs, kv, position)
            steps.append((inputs, logits, hidden))
            return logits, hidden

        def __getattr__(self, name):
            return getattr(network, name)

    drafter.model = Recorder()
    return steps


@pytest.mark.parametrize("name", CASES)
def test_every_round_matches_transformers(name):
    """Output equals plain greedy decoding, every round's drafts and
    accepted count equal transformers', and every draft step's logits and
    hidden state match its tensors."""
    oracle, model = case(name)
    drafter = drafter_for(name)
    steps = record_steps(drafter)
    prompt = oracle["prompt"]
    max_tokens = len(oracle["plain_greedy_output"]) - len(prompt)
    tokens, stats = speculative(model, drafter, prompt, max_tokens)
    assert tokens == oracle["plain_greedy_output"][len(prompt) :]
    assert len(stats.history) == oracle["num_rounds"]
    for ours, ref in zip(stats.history, oracle["rounds"]):
        assert ours.drafts == ref["drafts"]
        assert ours.accepted == ref["accepted"]
        assert ref["position_id"] in (None, ours.start)  # None: a round without drafts
    assert (stats.accepted, stats.drafted) == (oracle["accepted"], oracle["drafted"])

    tensors = mx.load(str(ASSISTANT / name / "rounds.safetensors"))
    step = iter(steps)
    for r, ref in enumerate(oracle["rounds"]):
        for s in range(len(ref["steps"])):
            inputs, logits, hidden = next(step)
            np.testing.assert_allclose(
                np.array(inputs),
                np.array(tensors[f"r{r}.s{s}.inputs_embeds"]),
                atol=1e-4,
            )
            np.testing.assert_allclose(
                np.array(logits), np.array(tensors[f"r{r}.s{s}.logits"][0]), atol=1e-4
            )
            np.testing.assert_allclose(
                np.array(hidden),
                np.array(tensors[f"r{r}.s{s}.last_hidden_state"]),
                atol=1e-4,
            )


@pytest.mark.parametrize("name", ["e2b", "dense"])
def test_one_draft_step_on_the_references_tensors(name):
    """Unit parity: the exact K/V, seed and inputs transformers used for a
    round give its logits and next hidden state."""
    tensors = mx.load(str(ASSISTANT / name / "rounds.safetensors"))
    oracle, _ = case(name)
    window = json.loads((ASSISTANT / name / "assistant" / "config.json").read_text())[
        "text_config"
    ]["sliding_window"]
    network = drafter_for(name).model
    for r in (0, 1, len(oracle["rounds"]) - 1):
        sliding_k = tensors[f"r{r}.sliding_attention.k"][..., -(window + 1) :, :]
        sliding_v = tensors[f"r{r}.sliding_attention.v"][..., -(window + 1) :, :]
        kv = {
            "sliding_attention": (sliding_k, sliding_v, None),
            "full_attention": (
                tensors[f"r{r}.full_attention.k"],
                tensors[f"r{r}.full_attention.v"],
                None,
            ),
        }
        position = oracle["rounds"][r]["position_id"]
        for s in range(len(oracle["rounds"][r]["steps"])):
            logits, hidden = network(tensors[f"r{r}.s{s}.inputs_embeds"], kv, position)
            np.testing.assert_allclose(
                np.array(logits), np.array(tensors[f"r{r}.s{s}.logits"][0]), atol=1e-4
            )
            np.testing.assert_allclose(
                np.array(hidden),
                np.array(tensors[f"r{r}.s{s}.last_hidden_state"]),
                atol=1e-4,
            )


def test_seed_hidden_is_the_targets_final_hidden():
    oracle, model = case("e2b")
    tensors = mx.load(str(ASSISTANT / "e2b" / "rounds.safetensors"))
    drafter = drafter_for("e2b")
    steps = record_steps(drafter)
    speculative(model, drafter, oracle["prompt"], 3)
    first_inputs = steps[0][0]
    np.testing.assert_allclose(
        np.array(first_inputs[..., 64:]), np.array(tensors["r0.seed_hidden"]), atol=1e-5
    )


@pytest.mark.parametrize("name", ["e2b", "dense"])
@pytest.mark.parametrize("kv_view", ["transformers", "clean"])
@given(
    prompt=st.lists(st.integers(5, 511), min_size=1, max_size=20),
    max_tokens=st.integers(1, 48),
    num_draft_tokens=st.integers(1, 8),
)
def test_lossless_with_either_kv_view(
    name, kv_view, prompt, max_tokens, num_draft_tokens
):
    """Random prompts and lengths that cross the window (8) several times,
    and more drafts per round than the checkpoint's 4."""
    _, model = case(name)
    drafter = drafter_for(name, kv_view=kv_view)
    tokens, _ = speculative(
        model, drafter, prompt, max_tokens, num_draft_tokens=num_draft_tokens
    )
    plain = [
        t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]
    assert tokens == plain


def test_the_clean_view_changes_drafts_not_output():
    oracle, model = case("dense")
    hf, _ = speculative(model, drafter_for("dense"), oracle["prompt"], 48)
    clean_tokens, clean = speculative(
        model, drafter_for("dense", kv_view="clean"), oracle["prompt"], 48
    )
    assert clean_tokens == oracle["plain_greedy_output"][len(oracle["prompt"]) :]
    assert [r.drafts for r in clean.history] != [r["drafts"] for r in oracle["rounds"]]


def test_the_clean_view_is_the_targets_own_window_at_the_anchor():
    """Every round, the clean view shows the sliding layer the ``W - 1``
    positions before the anchor (the anchor's own query makes ``W``) and the
    full layer every position before it."""
    oracle, model = case("dense")
    drafter = drafter_for("dense", kv_view="clean")
    window = drafter.model.args.text.sliding_window
    kv, views = drafter._kv, []

    def recording(state, target, target_cache):
        result = kv(state, target, target_cache)
        keys, _, visible = result["sliding_attention"]
        assert visible is None  # a slice of exactly the positions viewed
        sliding = target_cache[target.kv_donors()["sliding_attention"]]
        held, positions = np.array(sliding.keys[0, 0]), np.array(sliding.slot_positions())
        viewed = [
            positions[np.flatnonzero((held == row).all(axis=1))[0]]
            for row in np.array(keys[0, 0])
        ]
        full = result["full_attention"][0].shape[2]
        views.append((state.offset, viewed, full))
        return result

    drafter._kv = recording
    speculative(model, drafter, oracle["prompt"], 40)
    assert len(views) > 5 and views[-1][0] > 2 * window
    for anchor, sliding, full in views:
        assert sliding == list(range(max(0, anchor - window + 1), anchor))
        assert full == anchor


def test_sampling_with_the_assistant():
    oracle, model = case("dense")
    drafter = drafter_for("dense")
    mx.random.seed(0)
    tokens, stats = speculative(
        model, drafter, oracle["prompt"], 30, sampler=mlx_dspark.make_sampler(0.8)
    )
    assert len(tokens) == 30 and stats.acceptance_rule == "rejection"


def test_block_size_comes_from_the_generation_config(tmp_path):
    assert drafter_for("dense").block_size == 4
    path = tmp_path / "assistant"
    shutil.copytree(ASSISTANT / "dense" / "assistant", path)
    (path / "generation_config.json").unlink()
    assert mlx_dspark.load_drafter(path).block_size == DEFAULT_NUM_ASSISTANT_TOKENS
    (path / "generation_config.json").write_text(
        json.dumps({"num_assistant_tokens": 0})
    )
    with pytest.raises(ValueError, match="num_assistant_tokens must be an integer in"):
        mlx_dspark.load_drafter(path)


def test_quantized_assistant_loads_and_stays_lossless(tmp_path):
    oracle, model = case("dense")
    drafter = drafter_for("dense")
    nn.quantize(
        drafter.model,
        group_size=32,
        bits=8,
        class_predicate=lambda _, m: (
            hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0
        ),
    )
    path = tmp_path / "assistant-8bit"
    shutil.copytree(ASSISTANT / "dense" / "assistant", path)
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(drafter.model.parameters()))
    )
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (path / "config.json").write_text(json.dumps(config))
    quantized = mlx_dspark.load_drafter(path)
    assert isinstance(quantized.model.pre_projection, nn.QuantizedLinear)
    tokens, stats = speculative(model, quantized, oracle["prompt"], 40)
    assert (
        tokens
        == oracle["plain_greedy_output"][
            len(oracle["prompt"]) : len(oracle["prompt"]) + 40
        ]
    )


def test_missing_parameters_are_refused(tmp_path):
    path = tmp_path / "assistant"
    shutil.copytree(ASSISTANT / "e2b" / "assistant", path)
    weights = mx.load(str(path / "model.safetensors"))
    del weights["masked_embedding.token_ordering"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(
        ValueError, match="Missing 1 parameters: masked_embedding.token_ordering"
    ):
        mlx_dspark.load_drafter(path)


def test_bad_kv_view_option():
    with pytest.raises(ValueError, match="kv_view must be one of transformers, clean"):
        drafter_for("dense", kv_view="stale")


# The dense assistant fixture: backbone 64, vocabulary 512, sliding head dim 16
# with 2 KV heads, full head dim 32 with 1 KV head, K = V, window 8.
MATCHING = dict(
    layers=6,
    hidden=64,
    vocab=512,
    window=8,
    k_eq_v=True,
    head_dim=16,
    num_key_value_heads=2,
    global_head_dim=32,
    num_global_key_value_heads=1,
)


@pytest.mark.parametrize(
    "change,problem",
    [
        (dict(hidden=32), "hidden size (backbone_hidden_size) 64, the target has 32"),
        (dict(vocab=256), "vocabulary size 512, the target has 256"),
        (dict(head_dim=8), "sliding-layer head dim 16, the target has 8"),
        (dict(num_key_value_heads=1), "sliding-layer KV heads 2, the target has 1"),
        (dict(global_head_dim=64), "full-layer head dim 32, the target has 64"),
        (dict(num_global_key_value_heads=2), "full-layer KV heads 1, the target has 2"),
        (dict(k_eq_v=False), "attention_k_eq_v True, the target has False"),
        (dict(window=16), "sliding window 8, the target has 16"),
    ],
)
def test_pairing_errors(change, problem):
    model = tiny_gemma4(**{**MATCHING, **change})
    drafter = drafter_for("dense")
    with pytest.raises(
        ValueError, match=f"not made for this target: .*{re.escape(problem)}"
    ):
        next(speculative_generate_step(mx.array([5, 6]), model, drafter))


def test_matching_geometry_pairs():
    model = tiny_gemma4(**MATCHING)
    tokens, _ = speculative(model, drafter_for("dense"), [5, 6, 7], 20)
    assert tokens == [
        t for t, _ in generate_step(mx.array([5, 6, 7]), model, max_tokens=20)
    ]


def test_qwen3_target_is_refused():
    model, _ = load(str(FIXTURES / "deepspec-qwen3-tiny" / "target_tiny_qwen3"))
    with pytest.raises(ValueError, match="drafts for Gemma-4 targets, not qwen3"):
        next(speculative_generate_step(mx.array([5, 6]), model, drafter_for("dense")))


def test_the_scheduler_chosen_at_load_runs_the_rounds():
    """``--draft-scheduler`` reaches an assistant as it reaches a DeepSpec
    drafter: loaded with ``fixed``, every round drafts its whole block
    (where the default, ``cost``, paces the rounds); ``threshold`` is refused,
    an assistant having no confidences to read."""
    oracle, model = case("dense")
    drafter = drafter_for("dense", scheduler="fixed")
    prompt, expected = oracle["prompt"], oracle["plain_greedy_output"]
    stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
    steps = speculative_generate_step(
        mx.array(prompt), model, drafter, max_tokens=len(expected) - len(prompt), stats=stats
    )
    assert [t for t, _, _ in steps] == expected[len(prompt) :]
    assert stats.scheduler == "fixed"
    # Every round drafts but, at most, the last (one token left to emit).
    assert sum(not r.drafts for r in stats.history) <= 1
    assert drafter_for("dense").scheduler.name == "cost"
    with pytest.raises(ValueError, match="no confidence head"):
        drafter_for("dense", scheduler="threshold")
