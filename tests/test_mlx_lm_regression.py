"""mlx-lm's own speculative decoding is not lossless on a sliding-window
target; ours is, on the same target and prompts."""

import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_dspark import speculative_generate_step
from mlx_dspark.integration import patch_module, unpatch_module

from conftest import DEEPSPEC_TINY

PROMPTS = ([65, 211, 266, 241, 234, 10, 325], [5, 6, 7], [100, 200, 300, 400])


@pytest.fixture
def stock_mlx_lm():
    """mlx_lm.generate with mlx-dspark's patches taken out (auto-activation
    applies them in this process)."""
    module = sys.modules["mlx_lm.generate"]
    unpatch_module(module)
    yield module
    patch_module(module)


def test_mlx_lm_diverges_at_the_window_and_we_do_not(tiny_pair, stock_mlx_lm):
    model, _, drafter = tiny_pair
    # An ordinary draft model that mostly agrees with the target: a noisy copy.
    draft, _ = load(str(DEEPSPEC_TINY / "target_tiny_gemma4"))
    mx.random.seed(0)
    draft.update(
        tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape), draft.parameters())
    )

    window = model.args.sliding_window
    diverged_at = []
    for prompt in PROMPTS:
        plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=60)]
        theirs = [
            t
            for t, _, _ in stock_mlx_lm.speculative_generate_step(
                mx.array(prompt), model, draft, num_draft_tokens=3, max_tokens=60
            )
        ]
        ours = [
            t
            for t, _, _ in speculative_generate_step(
                mx.array(prompt), model, drafter, max_tokens=60
            )
        ]
        assert ours == plain
        first = next((i for i, (a, b) in enumerate(zip(plain, theirs)) if a != b), None)
        diverged_at.append(first)

    # mlx-lm 0.32's RotatingKVCache stops rolling back once the window (8)
    # has filled: the outputs part from plain greedy only after that point.
    # If this starts failing, upstream has fixed the bug.
    assert all(
        i is not None and len(p) + i >= window for p, i in zip(PROMPTS, diverged_at)
    )
