"""The Python API mirrors mlx-lm's: same responses, same text, plus stats."""

import copy

import mlx.core as mx
import numpy as np
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import stream_generate as mlx_lm_stream_generate

import mlx_dspark

PROMPT = "w65 w211 w266 w241 w234"


def test_stream_generate_matches_mlx_lm(tiny_pair):
    model, tokenizer, drafter = tiny_pair
    ours = list(
        mlx_dspark.stream_generate(
            model, tokenizer, PROMPT, draft=drafter, max_tokens=30
        )
    )
    theirs = list(mlx_lm_stream_generate(model, tokenizer, PROMPT, max_tokens=30))
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)
    assert ours[-1].finish_reason == theirs[-1].finish_reason == "length"
    assert (
        ours[-1].generation_tokens == 30
        and ours[-1].prompt_tokens == theirs[-1].prompt_tokens
    )
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(
            np.array(a.logprobs), np.array(b.logprobs), atol=1e-4
        )
    assert any(r.from_draft for r in ours)
    stats = ours[-1].stats
    assert stats.drafter == "dspark" and stats.rounds > 0 and stats.tau > 1
    # The last round may run past max_tokens; its drafts still count.
    assert sum(r.from_draft for r in ours) <= stats.accepted <= stats.drafted


def test_stop_on_eos_like_mlx_lm(tiny_pair):
    model, tokenizer, drafter = tiny_pair
    tokenizer = copy.deepcopy(tokenizer)
    plain = [
        r.token for r in mlx_lm_stream_generate(model, tokenizer, PROMPT, max_tokens=30)
    ]
    tokenizer.eos_token_ids = {plain[12]}
    ours = list(
        mlx_dspark.stream_generate(
            model, tokenizer, PROMPT, draft=drafter, max_tokens=30
        )
    )
    theirs = list(mlx_lm_stream_generate(model, tokenizer, PROMPT, max_tokens=30))
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert ours[-1].finish_reason == theirs[-1].finish_reason == "stop"
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)


def test_generate_returns_the_same_text(tiny_pair, capsys):
    model, tokenizer, drafter = tiny_pair
    text = mlx_dspark.generate(
        model, tokenizer, PROMPT, draft=drafter, max_tokens=25, verbose=True
    )
    assert text == mlx_lm_generate(model, tokenizer, PROMPT, max_tokens=25)
    assert "Speculative: dspark (greedy):" in capsys.readouterr().out


def test_without_a_drafter_it_is_plain_mlx_lm(tiny_pair):
    model, tokenizer, _ = tiny_pair
    ours = [
        r.token
        for r in mlx_dspark.stream_generate(model, tokenizer, PROMPT, max_tokens=12)
    ]
    theirs = [
        r.token for r in mlx_lm_stream_generate(model, tokenizer, PROMPT, max_tokens=12)
    ]
    assert ours == theirs


def test_token_list_and_array_prompts(tiny_pair):
    model, tokenizer, drafter = tiny_pair
    ids = tokenizer.encode(PROMPT)
    a = [
        r.token
        for r in mlx_dspark.stream_generate(
            model, tokenizer, ids, draft=drafter, max_tokens=8
        )
    ]
    b = [
        r.token
        for r in mlx_dspark.stream_generate(
            model, tokenizer, mx.array(ids), draft=drafter, max_tokens=8
        )
    ]
    assert a == b
