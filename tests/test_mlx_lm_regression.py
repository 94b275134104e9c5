"""mlx-lm's own speculative decoding is not lossless on a sliding-window
target; ours is, on the same target and prompts."""

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.generate import speculative_generate_step as mlx_lm_speculative

from mlx_dspark import speculative_generate_step

from conftest import DEEPSPEC_TINY

PROMPTS = ([65, 211, 266, 241, 234, 10, 325], [5, 6, 7], [100, 200, 300, 400])


def test_mlx_lm_diverges_at_the_window_and_we_do_not(tiny_pair):
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
            for t, _, _ in mlx_lm_speculative(
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
