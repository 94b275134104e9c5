"""Tiny random float32 models for property tests, and running them."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma4, gemma4_text, qwen3

from mlx_dspark import SpeculativeStats, speculative_generate_step
from mlx_dspark.batching.policy import Acceptance
from mlx_dspark.confidence.schedulers import ThresholdScheduler
from mlx_dspark.drafters import gemma4_dspark, qwen3_dspark
from mlx_dspark.drafters.deepspec import DeepSpecDrafter
from mlx_dspark.drafters.deepspec_model import Model

ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
}


class Clock:
    """Stands in for a module's ``time``: its ``perf_counter`` moves only
    when a test moves ``now``, so what is timed does not depend on this
    machine's speed."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def randomize(model: nn.Module, seed: int, scale: float = 0.3) -> nn.Module:
    """Gaussian weights (norm weights near 1) so that tiny models do not collapse
    onto one token."""
    key = mx.random.key(seed)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(key, len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if "norm" in name or name.endswith("layer_scalar"):
            new.append((name, 1.0 + 0.1 * mx.random.normal(p.shape, key=k)))
        else:
            new.append((name, scale * mx.random.normal(p.shape, key=k)))
    model.load_weights(new)
    mx.eval(model.parameters())
    return model


def gemma4_text_args(
    layers=4,
    window=4,
    vocab=96,
    hidden=32,
    k_eq_v=True,
    per_layer_input=0,
    kv_shared=0,
    layer_types=None,
    **overrides,
):
    layer_types = (
        layer_types or (["sliding_attention", "full_attention"] * layers)[:layers]
    )
    args = dict(
        model_type="gemma4_text",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_key_value_heads=1,
        num_global_key_value_heads=1,
        num_kv_shared_layers=kv_shared,
        hidden_size_per_layer_input=per_layer_input,
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        sliding_window=window,
        layer_types=layer_types,
        attention_k_eq_v=k_eq_v,
        use_double_wide_mlp=False,
        rope_parameters=ROPE,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    )
    args.update(overrides)
    return args


def tiny_gemma4(seed=0, wrapper=False, **kwargs):
    text_args = gemma4_text_args(**kwargs)
    if wrapper:
        model = gemma4.Model(
            gemma4.ModelArgs(
                model_type="gemma4",
                text_config=dict(text_args),
                vocab_size=text_args["vocab_size"],
            )
        )
    else:
        model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(text_args))
    return randomize(model, seed)


DRAFTER_FAMILIES = {
    "gemma4": (
        gemma4_dspark,
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            num_global_key_value_heads=1,
            global_head_dim=32,
            attention_k_eq_v=True,
            rope_parameters=ROPE,
            final_logit_softcapping=30.0,
        ),
    ),
    "qwen3": (
        qwen3_dspark,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        ),
    ),
}


def tiny_dspark(
    target_args: dict,
    seed=1,
    block_size=4,
    taps=(0, 1),
    markov_rank=8,
    markov_head_type="vanilla",
    confidence=True,
    confidence_threshold=0.0,
    layers=1,
    family="gemma4",
):
    """A random DeepSpec drafter of ``family`` for a target made from
    ``target_args``."""
    module, family_args = DRAFTER_FAMILIES[family]
    args = module.ModelArgs(
        **family_args,
        hidden_size=target_args["hidden_size"],
        intermediate_size=2 * target_args["hidden_size"],
        num_hidden_layers=layers,
        vocab_size=target_args["vocab_size"],
        block_size=block_size,
        num_target_layers=target_args["num_hidden_layers"],
        target_layer_ids=list(taps),
        mask_token_id=4,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type if markov_rank else None,
        enable_confidence_head=confidence,
        confidence_head_with_markov=confidence and markov_rank > 0,
    )
    model = randomize(Model(args), seed)
    return DeepSpecDrafter(model, family, Path("<random>"), confidence_threshold)


def qwen3_args(layers=4, vocab=96, hidden=32, tie=False):
    return dict(
        model_type="qwen3",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # heads x head_dim != hidden, as in real Qwen3
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=tie,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
    )


def tiny_qwen3(seed=0, **kwargs):
    return randomize(qwen3.Model(qwen3.ModelArgs.from_dict(qwen3_args(**kwargs))), seed)


def tiny_qwen3_dspark(target_args: dict, **kwargs):
    return tiny_dspark(target_args, family="qwen3", **kwargs)


def plain_greedy(model, prompt, max_tokens):
    """mlx-lm's own non-speculative greedy decoding."""
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def speculative(model, drafter, prompt, max_tokens, stats=None, **kwargs):
    """The tokens of ``speculative_generate_step`` and its statistics; with
    ``fixed`` rounds (every draft verified) where neither the call nor the
    drafter chose a scheduler, as the tests of the engine's rounds expect."""
    own = getattr(drafter, "scheduler", None)
    if "scheduler" not in kwargs and getattr(own, "paces_sampling", False) is not True:
        kwargs["scheduler"] = own if isinstance(own, ThresholdScheduler) else "fixed"
    if stats is None:
        stats = SpeculativeStats(drafter.name, drafter.block_size)
    steps = speculative_generate_step(
        mx.array(prompt), model, drafter, max_tokens=max_tokens, stats=stats, **kwargs
    )
    return [t for t, _, _ in steps], stats


def rounds(stats):
    """What each round of ``stats`` drafted, verified, kept and added."""
    return [(r.drafts, r.proposed, r.accepted, r.next_token) for r in stats.history]


def rounds_cut_at(full, length):
    """``full`` (``rounds`` of a generation) cut after ``length`` tokens by a
    stop token: the rounds that emitted them, a stop among a round's
    accepted drafts ending the round there, without the target's token (as
    in DeepSpec)."""
    cut, emitted = [], 1  # the first token is the prompt's
    for drafts, proposed, accepted, next_token in full:
        if emitted >= length:
            break
        j = length - 1 - emitted  # the last token's offset in this round
        if j < accepted:
            cut.append((drafts, j + 1, j + 1, None))
            break
        cut.append((drafts, proposed, accepted, next_token))
        emitted += accepted + (next_token is not None)
    return cut


def cut_at_stop(tokens, stops):
    """``tokens`` up to and including the first of ``stops``."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def from_drafts(stats):
    """For each token of a generation, whether it was an accepted draft."""
    flags = [False]
    for r in stats.history:
        flags += [True] * r.accepted + [False] * (r.next_token is not None)
    return flags


def pick_stops(tokens, flags, where, picks):
    """Stop tokens for a generation of ``tokens`` (``flags``: from
    ``from_drafts``): for each of ``picks`` (any integers), the token at one
    of the positions ``where`` names: ``"last draft"`` (a round's last
    accepted draft), ``"inner draft"`` (an accepted draft another one
    follows), ``"first"`` (the first token) or ``"any"`` (any token, also
    where there is no such draft)."""
    n = len(tokens)
    follows = [i + 1 < n and flags[i + 1] for i in range(n)]
    positions = {
        "last draft": [i for i in range(n) if flags[i] and not follows[i]],
        "inner draft": [i for i in range(n) if flags[i] and follows[i]],
        "first": [0],
    }.get(where) or range(n)
    return {tokens[positions[p % len(positions)]] for p in picks}


def counted_expectations(monkeypatch):
    """Every ``Acceptance.expect`` call from now on (each still made), as
    ``(acceptance, first, rates)``."""
    counted, expect = [], Acceptance.expect

    def counting(self, first, rates):
        counted.append((self, first, rates))
        expect(self, first, rates)

    monkeypatch.setattr(Acceptance, "expect", counting)
    return counted
