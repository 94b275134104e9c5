"""DeepSpec drafters (DSpark and DFlash), as a drafter-kind plugin.

DSpark drafts a block in one forward and chains it with a Markov head (each
position corrected by the previous draft token); a confidence head predicts
which drafts will survive. DFlash is the same network without either head.
The round follows DeepSpec's decode loop (``deepspec/eval``): the block is
``[anchor, mask x (B-1)]`` at positions ``start .. start+B-1``, and the
context is every committed position's target taps, concatenated in
``target_layer_ids`` order.
"""

from functools import partial
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..checkpoints import (
    FLAG,
    LARGEST,
    SIZE,
    Field,
    check_fields,
    invalid_config,
    layer_count,
    load_network,
    shape_problems,
    tensor_shapes,
)
from ..confidence.calibration import drafter_fingerprint, resolve_calibration
from ..confidence.schedulers import make_scheduler
from ..plugins import DrafterKind, architecture
from ..validation import check, problem
from .base import Proposal, check_pairing
from .deepspec_model import Model
from .heads import MARKOV_HEADS

# The most drafts per round a checkpoint may ask for: DeepSpec trains blocks of
# 7 to 16, and every round holds block + 1 rows of target logits and caches
# that roll back that far.
MAX_BLOCK_SIZE = 64

COMMON_FIELDS = {
    "hidden_size": SIZE,
    "intermediate_size": SIZE,
    "num_hidden_layers": SIZE,
    "num_attention_heads": SIZE,
    "num_key_value_heads": SIZE,
    "vocab_size": SIZE,
    "block_size": Field("integer", 1, MAX_BLOCK_SIZE),
    "num_target_layers": Field("integer", 1),
    "target_layer_ids": Field("list"),
    "mask_token_id": Field("integer", 0),
    "attention_bias": FLAG,
    "rms_norm_eps": Field("number", 0, required=False),
    "max_position_embeddings": Field("integer", 1, required=False),
    "markov_rank": Field("integer", 0, LARGEST, required=False),
    "markov_head_type": Field("string", required=False, nullable=True),
    "enable_confidence_head": FLAG,
    "confidence_head_with_markov": FLAG,
}

# Config fields and the tensor whose first dimension each one is.
FIRST_DIMS = {
    "vocab_size": "embed_tokens.weight",
    "hidden_size": "norm.weight",
    "intermediate_size": "layers.0.mlp.gate_proj.weight",
}


def _argmax_draw(logits: mx.array):
    return mx.argmax(logits, axis=-1), None


class DeepSpecDrafter:
    """A loaded DSpark or DFlash drafter (see ``mlx_dspark.drafters.base.Drafter``).

    Args:
        model: The drafter network.
        family: The target-adapter family it was trained for (``"gemma4"``).
        confidence_threshold: Verify drafts only up to the first one whose
            confidence ``σ(c_k)`` is below this (DeepSpec's per-position
            threshold). ``0`` verifies every draft.
        scheduler: ``"fixed"``, ``"threshold"`` or ``"cost"`` (see
            ``mlx_dspark.confidence.schedulers``); by default ``threshold``
            when a threshold is given, else ``cost`` (``make_scheduler``).
        calibration: The confidence head's STS calibration, if any.
        fingerprint: Identifies the checkpoint (for calibrations and
            cost profiles).
    """

    def __init__(
        self,
        model,
        family: str,
        path: Path,
        confidence_threshold: float = 0.0,
        scheduler: Optional[str] = None,
        calibration=None,
        fingerprint: Optional[str] = None,
    ):
        check(confidence_threshold, "confidence_threshold", "number", 0, 1)
        self.model = model
        self.family = family
        self.path = path
        args = model.args
        heads = model.markov_head is not None or model.confidence_head is not None
        self.name = "dspark" if heads else "dflash"
        self.block_size = self.max_draft_tokens = args.block_size
        self.taps = tuple(args.target_layer_ids)
        self.calibration = calibration
        self.fingerprint = fingerprint
        self.scheduler = make_scheduler(
            scheduler,
            confidence_threshold,
            calibration,
            args.block_size,
            model.confidence_head is not None,
            path,
        )
        self._masks = mx.full((args.block_size - 1,), args.mask_token_id, mx.uint32)

    def __repr__(self) -> str:
        return f"<{self.name} drafter, block {self.block_size}, from {self.path}>"

    def check_target(self, target) -> None:
        args = self.model.args
        problems = []
        if target.family != self.family:
            problems.append(
                f"it drafts for {self.family} targets, not {target.family} "
                f"({target.model_type})"
            )
        check_pairing(
            f"The drafter {self.path} was not trained for this target",
            problems,
            (
                ("{} decoder layers", args.num_target_layers, target.num_layers),
                ("{} hidden size", args.hidden_size, target.hidden_size),
                ("{} vocabulary size", args.vocab_size, target.vocab_size),
            ),
            "Use the drafter released for your target model.",
        )

    def make_cache(self) -> list:
        return [KVCache() for _ in self.model.layers]

    def commit(
        self, cache: list, hidden: List[mx.array], proposal: Optional[Proposal] = None
    ) -> None:
        self.model.add_context(mx.concatenate(hidden, axis=-1), cache)

    def propose(
        self,
        cache: list,
        anchor: mx.array,
        num_drafts: int,
        draw: Optional[Callable] = None,
        target=None,
        target_cache: Optional[list] = None,
    ) -> Proposal:
        return self.propose_batch(cache, anchor.reshape(1), num_drafts, draw).row(0)

    def propose_batch(
        self,
        cache: list,
        anchors: mx.array,
        num_drafts: int,
        draw: Optional[Callable] = None,
        target=None,
        target_cache: Optional[list] = None,
    ) -> Proposal:
        """``propose`` for ``B`` sequences at once (see ``Drafter``); it
        reads nothing of the target's."""
        model = self.model
        anchors = anchors.astype(mx.uint32)
        masks = mx.broadcast_to(self._masks, (anchors.size, self._masks.size))
        block = mx.concatenate([anchors[:, None], masks], axis=1)
        hidden = model(block, cache)[:, :num_drafts]
        base_logits = model.compute_logits(hidden)
        head = model.markov_head
        if head is None and draw is None:
            tokens = mx.argmax(base_logits, axis=-1).astype(mx.uint32)
            return Proposal(
                tokens, base_logits, None, self._confidence(hidden, None)
            )

        # Position k is drawn after k-1: the Markov head corrects it with the
        # token drawn there, and ``draw`` may depend on the drafts so far.
        draw = draw or _argmax_draw
        state = head.initial_state(hidden) if head is not None else None
        prev = anchors
        tokens, steps, log_probs, embeddings = [], [], [], []
        for k in range(num_drafts):
            step = base_logits[:, k]
            if head is not None:
                embedding = head.markov_w1(prev)
                bias, state = head.step(embedding, hidden[:, k], state)
                step = step + bias
                embeddings.append(embedding)
            prev, step_log_probs = draw(step)
            prev = prev.astype(mx.uint32)
            tokens.append(prev)
            steps.append(step)
            log_probs.append(step_log_probs)
        prev_embeddings = mx.stack(embeddings, axis=1) if embeddings else None
        return Proposal(
            tokens=mx.stack(tokens, axis=1),
            logits=mx.stack(steps, axis=1),
            log_probs=None if log_probs[0] is None else mx.stack(log_probs, axis=1),
            confidence=self._confidence(hidden, prev_embeddings),
        )

    def _confidence(self, hidden, prev_embeddings):
        if self.model.confidence_head is None:
            return None
        features = hidden
        if self.model.args.confidence_head_with_markov:
            features = mx.concatenate(
                [hidden, prev_embeddings.astype(hidden.dtype)], axis=-1
            )
        return self.model.confidence_head(features)


def validate_config(config: dict, path: Path, shapes: dict, fields: dict, family_problems) -> None:
    """Check a DeepSpec drafter config against what every family needs plus
    the family's ``fields``, then against the weights' ``shapes`` and, with
    every field of the right type, the family's ``family_problems(config)``;
    raise one ValueError listing all problems."""
    fields = {**COMMON_FIELDS, **fields}
    check_fields(config, fields, shapes, path, "DeepSpec drafter")
    ids = config["target_layer_ids"]
    if any(problem(i, "integer") for i in ids):
        raise invalid_config(
            path, "DeepSpec drafter", [f"target_layer_ids must be integers, got {ids!r}"]
        )

    problems = shape_problems(config, shapes, FIRST_DIMS)
    layers = layer_count(shapes, "layers.")
    if config["num_hidden_layers"] != layers:
        problems.append(
            f"num_hidden_layers is {config['num_hidden_layers']} but the weights "
            f"hold {layers} layers"
        )
    target_layers = config["num_target_layers"]
    if not ids or ids != sorted(set(ids)) or ids[0] < -1 or ids[-1] >= target_layers - 1:
        problems.append(
            f"target_layer_ids {ids} must be strictly increasing, each in "
            f"[-1, {target_layers - 2}] (the last target layer cannot be tapped)"
        )
    positions = config.get("max_position_embeddings")
    if positions is not None and config["block_size"] > positions:
        problems.append(
            f"block_size {config['block_size']} exceeds max_position_embeddings {positions}"
        )
    if config["mask_token_id"] >= config["vocab_size"]:
        problems.append(
            f"mask_token_id {config['mask_token_id']} is outside the vocabulary "
            f"[0, {config['vocab_size']})"
        )
    rank = config.get("markov_rank") or 0
    kind = config.get("markov_head_type")
    if rank > 0 and kind not in MARKOV_HEADS:
        problems.append(
            f"markov_head_type {kind!r} is not one of {', '.join(MARKOV_HEADS)}"
        )
    if (
        config.get("enable_confidence_head")
        and config.get("confidence_head_with_markov")
        and rank <= 0
    ):
        problems.append("confidence_head_with_markov needs markov_rank > 0")
    problems += family_problems(config)
    if problems:
        raise invalid_config(path, "DeepSpec drafter", problems)


def load(
    family: str,
    args_class,
    fields: dict,
    family_problems,
    path: Path,
    config: dict,
    confidence_threshold: float = 0.0,
    scheduler: Optional[str] = None,
    calibration=None,
    dtype=None,
    lazy=False,
):
    """Load a DeepSpec drafter of ``family`` (see ``drafter_kind``)."""
    validate_config(config, path, tensor_shapes(path), fields, family_problems)
    model = load_network(path, Model, args_class, dtype, lazy)
    fingerprint = drafter_fingerprint(path)
    if calibration not in (None, False) and model.confidence_head is None:
        raise ValueError(
            f"{path} has no confidence head (a DFlash drafter), so it takes no "
            "calibration."
        )
    calibration = resolve_calibration(calibration, fingerprint, model.args.block_size)
    return DeepSpecDrafter(
        model,
        family,
        path,
        confidence_threshold,
        scheduler,
        calibration=calibration,
        fingerprint=fingerprint,
    )


def drafter_kind(
    family: str, name: str, args_class, fields: dict, family_problems
) -> DrafterKind:
    """The kind of DeepSpec's ``name`` checkpoints (``architectures[0]``),
    drafters for ``family`` targets: their config is ``args_class``, checked
    against the keys every family needs plus ``fields``, then by
    ``family_problems(config)`` (see ``validate_config``)."""
    return DrafterKind(
        name=f"deepspec-{family}",
        architectures=(name,),
        detect=lambda config: architecture(config) == name,
        load=partial(load, family, args_class, fields, family_problems),
    )
