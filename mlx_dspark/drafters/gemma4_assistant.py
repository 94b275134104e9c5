"""Google's Gemma-4 assistant drafters (``gemma4_assistant`` and
``gemma4_unified_assistant``): multi-token prediction that borrows the
target's K/V.

A 4-layer Gemma-4 stack whose layers have only query projections. Each draft
step embeds the last token with the *target's* embedding, concatenates a
hidden state (the target's final-normed hidden at the position that predicted
that token, then the drafter's own ``post_projection`` output), projects it to
the assistant's width, and attends - at the fixed position of the anchor - to
the K/V of the target's last sliding and last full layer that own a cache. It
drafts greedily in transformers; here it may also sample. It writes nothing:
its state is the seed hidden and which K/V entries it may look at.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import _BaseCache
from mlx_lm.models.rope_utils import initialize_rope

from ..checkpoints import (
    FLAG,
    NULLABLE_SIZE,
    OPTIONAL_SIZE,
    SIZE,
    Field,
    check_fields,
    field_problems,
    invalid_config,
    layer_count,
    load_network,
    read_json,
    shape_problems,
    tensor_shapes,
)
from ..confidence.schedulers import make_scheduler
from ..plugins import DrafterKind, architecture, hookimpl
from ..targets.base import FINAL
from ..validation import check, problem
from .base import Proposal, check_pairing
from .layers import GemmaDecoderLayer, QueryAttention

ARCHITECTURES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")
MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")

# Drafts per round when the checkpoint has no generation_config.json with
# num_assistant_tokens (the released checkpoints say 6).
DEFAULT_NUM_ASSISTANT_TOKENS = 6
# The most drafts per round accepted: the assistant has no trained block.
MAX_DRAFT_TOKENS = 32

KV_VIEWS = ("transformers", "clean")


@dataclass
class TextArgs(BaseModelArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    global_head_dim: int
    num_key_value_heads: int
    layer_types: List[str]
    sliding_window: int
    rope_parameters: Dict
    vocab_size: int
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072


@dataclass
class ModelArgs(BaseModelArgs):
    backbone_hidden_size: int
    text_config: dict
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    text: TextArgs = field(init=False)

    def __post_init__(self):
        self.text = TextArgs.from_dict(self.text_config)


class Attention(QueryAttention):
    """Queries only: keys and values are the target's."""

    def __init__(self, args: TextArgs, layer_type: str):
        super().__init__()
        full = layer_type == "full_attention"
        self.n_heads = args.num_attention_heads
        self.head_dim = args.global_head_dim if full else args.head_dim
        self.scale = 1.0
        self.q_proj = nn.Linear(
            args.hidden_size, self.n_heads * self.head_dim, bias=False
        )
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(
            self.n_heads * self.head_dim, args.hidden_size, bias=False
        )
        rope = args.rope_parameters[layer_type]
        self.rope = initialize_rope(
            dims=self.head_dim,
            base=rope["rope_theta"],
            traditional=False,
            scaling_config=rope,
            max_position_embeddings=args.max_position_embeddings,
        )

    def __call__(self, x: mx.array, kv, position: int) -> mx.array:
        keys, values, mask = kv
        return self.attend(self.queries(x, position), keys, values, mask)


class TextModel(nn.Module):
    def __init__(self, args: TextArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            GemmaDecoderLayer(args, Attention(args, t)) for t in args.layer_types
        ]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class MaskedEmbedder(nn.Module):
    """The centroid-routed LM head of E2B/E4B: only the tokens of the top-k
    centroids are scored; every other token gets the lowest score minus one."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.centroid_intermediate_top_k
        self.num_centroids = args.num_centroids
        self.centroids = nn.Linear(
            args.text.hidden_size, args.num_centroids, bias=False
        )
        self.token_ordering = mx.zeros((args.text.vocab_size,), mx.int32)

    def __call__(self, z: mx.array, embed_tokens: nn.Embedding) -> mx.array:
        """``[B, 1, hidden]`` -> ``[B, V]``."""
        B = z.shape[0]
        scores = self.centroids(z)[:, 0]
        top = mx.argpartition(-scores, self.top_k - 1, axis=-1)[:, : self.top_k]
        ids = self.token_ordering.reshape(self.num_centroids, -1)[top].reshape(B, -1)
        selected = (embed_tokens(ids) @ z.swapaxes(1, 2))[..., 0]
        lowest = selected.min(axis=-1, keepdims=True) - 1
        logits = mx.broadcast_to(lowest, (B, self.token_ordering.size))
        return mx.put_along_axis(logits, ids, selected, axis=-1)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = TextModel(args.text)
        width = args.text.hidden_size
        self.pre_projection = nn.Linear(
            2 * args.backbone_hidden_size, width, bias=False
        )
        self.post_projection = nn.Linear(width, args.backbone_hidden_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(args)

    def __call__(self, inputs_embeds: mx.array, kv: dict, position):
        """One draft step: ``[B, 1, 2 * backbone]`` inputs -> (logits ``[B, V]``,
        the next step's hidden ``[B, 1, backbone]``); ``position`` is an int or
        each row's (``[B]``)."""
        x = self.pre_projection(inputs_embeds)
        for layer, layer_type in zip(self.model.layers, self.args.text.layer_types):
            x = layer(x, kv[layer_type], position)
        z = self.model.norm(x)
        if self.args.use_ordered_embeddings:
            logits = self.masked_embedding(z, self.model.embed_tokens)
        else:
            logits = self.model.embed_tokens.as_linear(z)[:, 0]
        return logits, self.post_projection(z)

    def sanitize(self, weights: dict) -> dict:
        weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
        if "masked_embedding.token_ordering" in weights:
            ordering = weights["masked_embedding.token_ordering"]
            weights["masked_embedding.token_ordering"] = ordering.astype(mx.int32)
        return weights


class AssistantState(_BaseCache):
    """The assistant's part of a prompt cache: how many positions it has
    seen (in step with the target's caches), the hidden state that seeds the
    next round, and which of the target's K/V entries the next round reads
    (transformers' view depends on the last target forward)."""

    def __init__(self):
        self.offset = 0
        self.seed = None
        self.view = None  # (full_end, sliding_start, sliding_end)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        if n:
            # The seed and view of an earlier position are gone; the next
            # commit (every generation starts with one) sets them again.
            self.seed, self.view = None, None
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.seed is None

    @property
    def nbytes(self) -> int:
        return 0 if self.seed is None else self.seed.nbytes

    @property
    def state(self):
        return (self.seed,)

    @state.setter
    def state(self, v):
        (self.seed,) = v


def full_kv_heads(args) -> int:
    """The KV heads of a full-attention layer (``args``: a Gemma-4 text config)."""
    if args.attention_k_eq_v and args.num_global_key_value_heads:
        return args.num_global_key_value_heads
    return args.num_key_value_heads


def view_bounds(kv_view, window, start, anchor, length, least=min, most=max):
    """Which of the target's K/V entries a round at ``anchor`` reads, as
    ``(full_end, sliding_start, sliding_end)``, after a forward from
    ``start`` that verified ``length`` positions (``None``: no drafts).
    Python ints, or with ``mx.minimum``/``mx.maximum`` arrays of rows."""
    if kv_view == "clean":
        return anchor, most(0, anchor - window + 1), anchor
    if length is None:
        # After the prompt, transformers' sliding donor returned every
        # prompt entry: the view is the last W + 1 of them.
        return anchor, most(0, anchor - window - 1), anchor
    # transformers slices the previous forward's returned K/V by index to P
    # entries: the sliding donor returned its cached entries (at most W - 1)
    # followed by the forward's own (the anchor and the drafts, from
    # ``start``).
    cached = least(start, window - 1)
    kept = least(cached + length, anchor + 1)
    sliding_end = start - cached + kept
    return (
        least(anchor + 1, start + length),
        most(start - cached, sliding_end - window - 1),
        sliding_end,
    )


def borrowed_kv(target, cache, full_start, full_end, sliding_start, sliding_end):
    """What the assistant's layers attend to, by layer type: the target's
    K/V of the full layer in ``[full_start, full_end)`` and of the sliding
    layer in ``[sliding_start, sliding_end)`` (see ``Target.borrowed_kv``)."""
    return {
        "full_attention": target.borrowed_kv(
            cache, "full_attention", full_start, full_end
        ),
        "sliding_attention": target.borrowed_kv(
            cache, "sliding_attention", sliding_start, sliding_end
        ),
    }


class BatchAssistantState(_BaseCache):
    """The ``AssistantState`` of each row of a speculative batch, with the
    row operations of ``batching.cache.BatchRollbackKVCache``. A commit
    keeps the taps of every position it took in; a rollback (on the device)
    moves each row's offset and seed back, and the view follows from them
    when the next round drafts. The batch's caches forget rolled-back
    entries, so a row's transformers view lacks the stale ones a single
    stream would show (the drafts may differ, never the output)."""

    def __init__(self):
        self.offset = None  # [B] int32
        self.lengths: List[int] = []  # the same on the host
        self.hidden = None  # [B, L, backbone]: the last commit's taps
        self.last = None  # [B] int32: each row's seed in ``hidden``
        self.start = None  # [B] int32: each row's offset before the last commit
        self.length = None  # [B] int32: what that forward verified, 0: no drafts

    @classmethod
    def merge(cls, states: Sequence[AssistantState], window=None, max_rollback=None):
        """A batch of single-sequence states (``window`` and ``max_rollback``
        as ``BatchRollbackKVCache.merge`` takes them, unused). Only their
        offsets count: every row's prompt is committed before it drafts."""
        batch = cls()
        batch.lengths = [s.offset for s in states]
        batch.offset = batch.start = mx.array(batch.lengths, mx.int32)
        batch.length = batch.last = mx.zeros(len(states), mx.int32)
        return batch

    def commit(self, hidden: mx.array, length: Optional[int]) -> None:
        B, L, _ = hidden.shape
        self.hidden = hidden
        self.last = mx.full((B,), L - 1, mx.int32)
        self.start = self.offset
        self.offset = self.offset + L
        self.lengths = [n + L for n in self.lengths]
        self.length = mx.full((B,), length or 0, mx.int32)

    def seeds(self) -> mx.array:
        """``[B, 1, backbone]``: each row's seed hidden state."""
        return mx.take_along_axis(self.hidden, self.last[:, None, None], axis=1)

    def extract(self, idx: int, end: Optional[int] = None) -> AssistantState:
        """Row ``idx`` as the single-sequence state of its first ``end``
        positions (by default all it holds). Like a trimmed state it has no
        seed or view: the commit that starts every generation sets them."""
        state = AssistantState()
        state.offset = self.lengths[idx] if end is None else end
        return state

    def rollback(self, counts: mx.array) -> None:
        self.offset = self.offset - counts
        self.last = self.last - counts

    def settle(self, counts: Sequence[int], reuse: bool) -> None:
        self.lengths = [n - c for n, c in zip(self.lengths, counts)]

    def trim_rows(self, counts: Sequence[int]) -> None:
        self.rollback(mx.array(counts, mx.int32))
        self.settle(counts, reuse=True)

    def reclaimable(self) -> int:
        return 0

    def compact(self) -> None:
        """Nothing to pack: a row keeps no entries, only its seed."""

    def filter(self, keep: List[int]) -> None:
        index = mx.array(keep, mx.int32)
        if self.hidden is not None:
            self.hidden = self.seeds()[index]
        self.last = mx.zeros(len(keep), mx.int32)
        self.offset, self.start, self.length = (
            x[index] for x in (self.offset, self.start, self.length)
        )
        self.lengths = [self.lengths[i] for i in keep]

    def select(self, rows: List[int]) -> "BatchAssistantState":
        taken = BatchAssistantState()
        taken.__dict__.update(self.__dict__)
        taken.filter(rows)
        return taken

    def extend(self, other: "BatchAssistantState") -> None:
        like = self.hidden if self.hidden is not None else other.hidden
        if like is not None:
            self.hidden = mx.concatenate([s._seeds_like(like) for s in (self, other)])
        self.last = mx.zeros(len(self.lengths) + len(other.lengths), mx.int32)
        self.offset, self.start, self.length = (
            mx.concatenate([a, b])
            for a, b in zip(
                (self.offset, self.start, self.length),
                (other.offset, other.start, other.length),
            )
        )
        self.lengths = self.lengths + other.lengths

    def _seeds_like(self, like: mx.array) -> mx.array:
        if self.hidden is None:
            return mx.zeros((len(self.lengths), 1, like.shape[-1]), like.dtype)
        return self.seeds()

    @property
    def nbytes(self) -> int:
        return 0 if self.hidden is None else self.hidden.nbytes

    @property
    def state(self):
        return self.hidden, self.last, self.offset, self.start, self.length


class AssistantDrafter:
    """A loaded Gemma-4 assistant (see ``mlx_dspark.drafters.base.Drafter``).

    Args:
        kv_view: ``"transformers"`` (default) hands each round the K/V entries
            transformers' ``SinglePositionMultiTokenCandidateGenerator`` hands
            its drafter, stale entries of the previous round's rejected drafts
            included, so that drafts match transformers round for round.
            ``"clean"`` hands only accepted positions: the target's own
            sliding window at the anchor, and every earlier position for the
            full layer.
        scheduler: ``"fixed"`` or ``"cost"`` (it has no confidences for
            ``threshold``); by default ``cost`` for greedy decoding and
            ``fixed`` when sampling (``make_scheduler``).
    """

    name = "assistant"
    taps = (FINAL,)
    batch_cache = BatchAssistantState
    max_draft_tokens = MAX_DRAFT_TOKENS

    def __init__(
        self, model: Model, path: Path, block_size: int, kv_view: str,
        scheduler: Optional[str] = None,
    ):
        if kv_view not in KV_VIEWS:
            raise ValueError(
                f"kv_view must be one of {', '.join(KV_VIEWS)}, got {kv_view!r}."
            )
        self.model = model
        self.path = path
        self.block_size = block_size
        self.kv_view = kv_view
        self.scheduler = make_scheduler(scheduler, 0.0, None, block_size, False, str(path))

    def __repr__(self) -> str:
        return (
            f"<assistant drafter, {self.block_size} drafts per round, from {self.path}>"
        )

    def check_target(self, target) -> None:
        if target.family != "gemma4":
            raise ValueError(
                f"The assistant drafter {self.path} drafts for Gemma-4 targets, not "
                f"{target.family} ({target.model_type})."
            )
        ours, theirs = self.model.args.text, target.args
        donors = target.kv_donors()
        problems = [
            f"the target has no {kind} layer that owns its K/V"
            for kind in ("sliding_attention", "full_attention")
            if kind not in donors
        ]
        check_pairing(
            f"The assistant drafter {self.path} was not made for this target",
            problems,
            (
                (
                    "hidden size (backbone_hidden_size) {}",
                    self.model.args.backbone_hidden_size,
                    theirs.hidden_size,
                ),
                ("vocabulary size {}", ours.vocab_size, theirs.vocab_size),
                ("sliding-layer head dim {}", ours.head_dim, theirs.head_dim),
                (
                    "sliding-layer KV heads {}",
                    ours.num_key_value_heads,
                    theirs.num_key_value_heads,
                ),
                (
                    "full-layer head dim {}",
                    ours.global_head_dim,
                    theirs.global_head_dim,
                ),
                ("full-layer KV heads {}", full_kv_heads(ours), full_kv_heads(theirs)),
                ("attention_k_eq_v {}", ours.attention_k_eq_v, theirs.attention_k_eq_v),
                ("sliding window {}", ours.sliding_window, theirs.sliding_window),
            ),
            "Use the assistant released for your target model.",
        )

    def make_cache(self) -> list:
        return [AssistantState()]

    def commit(
        self, cache: list, hidden: List[mx.array], proposal: Optional[Proposal] = None
    ) -> None:
        state = cache[0]
        # The positions the forward verified (``None``: it verified no drafts).
        length = None if proposal is None else proposal.tokens.shape[-1] + 1
        if isinstance(state, BatchAssistantState):
            state.commit(hidden[0], length)
            return
        start = state.offset
        state.seed = hidden[0][:, -1:]
        state.offset += hidden[0].shape[1]
        window = self.model.args.text.sliding_window
        state.view = view_bounds(self.kv_view, window, start, state.offset, length)

    def _kv(self, state: AssistantState, target, target_cache: list) -> dict:
        return borrowed_kv(target, target_cache, 0, *state.view)

    def _batch_kv(self, state: "BatchAssistantState", target, target_cache) -> dict:
        """``_kv`` for each row of a batch, from its own view."""
        window = self.model.args.text.sliding_window
        args = (self.kv_view, window, state.start, state.offset)
        drafted = view_bounds(*args, state.length, mx.minimum, mx.maximum)
        undrafted = view_bounds(*args, None, mx.minimum, mx.maximum)
        view = [mx.where(state.length > 0, a, b) for a, b in zip(drafted, undrafted)]
        return borrowed_kv(target, target_cache, mx.zeros_like(view[0]), *view)

    def propose(
        self,
        cache: list,
        anchor: mx.array,
        num_drafts: int,
        draw: Optional[Callable] = None,
        target=None,
        target_cache: Optional[list] = None,
    ) -> Proposal:
        state = cache[0]
        if state.seed is None or target is None or target_cache is None:
            raise ValueError("The assistant has no target state to draft from.")
        kv = self._kv(state, target, target_cache)
        return self._draft(
            kv, anchor, state.seed, state.offset, num_drafts, draw, target
        ).row(0)

    def propose_batch(
        self,
        cache: list,
        anchors: mx.array,
        num_drafts: int,
        draw: Optional[Callable] = None,
        target=None,
        target_cache: Optional[list] = None,
    ) -> Proposal:
        """For the rows of a ``BatchAssistantState`` (see ``Drafter``): each
        row attends at its own position to its own view of the batch's K/V."""
        state = cache[0]
        kv = self._batch_kv(state, target, target_cache)
        return self._draft(
            kv, anchors, state.seeds(), state.offset, num_drafts, draw, target
        )

    def _draft(self, kv, anchors, seeds, position, num_drafts, draw, target):
        """``num_drafts`` sequential steps for ``B`` rows (``seeds``
        ``[B, 1, backbone]``); the proposal has a leading batch axis."""
        token, hidden = anchors.reshape(-1, 1).astype(mx.uint32), seeds
        tokens, logits, log_probs = [], [], []
        for _ in range(num_drafts):
            inputs = mx.concatenate([target.embed(token), hidden], axis=-1)
            step, hidden = self.model(inputs, kv, position)
            if draw is None:
                token, step_log_probs = mx.argmax(step, axis=-1), None
            else:
                token, step_log_probs = draw(step)
            token = token.reshape(-1, 1).astype(mx.uint32)
            tokens.append(token[:, 0])
            logits.append(step)
            log_probs.append(step_log_probs)
        return Proposal(
            tokens=mx.stack(tokens, axis=1),
            logits=mx.stack(logits, axis=1),
            log_probs=None if log_probs[0] is None else mx.stack(log_probs, axis=1),
        )


FIELDS = {
    "backbone_hidden_size": SIZE,
    "text_config": Field("object"),
    "use_ordered_embeddings": FLAG,
    "num_centroids": OPTIONAL_SIZE,
    "centroid_intermediate_top_k": OPTIONAL_SIZE,
}

TEXT_FIELDS = {
    "hidden_size": SIZE,
    "intermediate_size": SIZE,
    "num_hidden_layers": SIZE,
    "num_attention_heads": SIZE,
    "head_dim": SIZE,
    "global_head_dim": SIZE,
    "num_key_value_heads": SIZE,
    "layer_types": Field("list"),
    "sliding_window": Field("integer", 1),
    "rope_parameters": Field("object"),
    "vocab_size": SIZE,
    "num_global_key_value_heads": NULLABLE_SIZE,
    "attention_k_eq_v": FLAG,
    "rms_norm_eps": Field("number", 0, required=False),
    "max_position_embeddings": Field("integer", 1, required=False),
}

# text_config fields and the tensor whose first dimension each one is.
FIRST_DIMS = {
    "vocab_size": "model.embed_tokens.weight",
    "hidden_size": "model.norm.weight",
}


def validate_config(config: dict, path: Path, shapes: dict) -> None:
    check_fields(config, FIELDS, shapes, path, "assistant")
    text = config["text_config"]
    missing = [k for k, f in TEXT_FIELDS.items() if f.required and text.get(k) is None]
    if missing:
        raise ValueError(
            f"{path}/config.json: text_config lacks {', '.join(missing)}. (transformers "
            ">= 5.24 writes global_head_dim and num_global_key_value_heads only under "
            "per_layer_config; add them back as top-level text_config keys.)"
        )
    problems = [
        f"text_config.{p}" for p in field_problems(text, TEXT_FIELDS, shapes)
    ]
    if problems:
        raise invalid_config(path, "assistant", problems)
    problems = shape_problems(text, shapes, FIRST_DIMS)
    layers = layer_count(shapes, "model.layers.")
    if text["num_hidden_layers"] != layers:
        problems.append(
            f"num_hidden_layers is {text['num_hidden_layers']} but the weights "
            f"hold {layers} layers"
        )
    types = text["layer_types"]
    if len(types) != text["num_hidden_layers"] or set(map(str, types)) - {
        "sliding_attention",
        "full_attention",
    }:
        problems.append(
            f"layer_types {types} do not describe {text['num_hidden_layers']} layers"
        )
    for kind in set(map(str, types)):
        rope = text["rope_parameters"].get(kind)
        if not isinstance(rope, dict) or problem(rope.get("rope_theta"), "positive"):
            problems.append(f"rope_parameters has no positive rope_theta for {kind}")
    if config.get("use_ordered_embeddings"):
        centroids = config.get("num_centroids") or 0
        if centroids <= 0 or text["vocab_size"] % centroids:
            problems.append(
                f"num_centroids {centroids} must divide the vocabulary ({text['vocab_size']})"
            )
        top_k = config.get("centroid_intermediate_top_k", 32)
        if top_k > centroids:
            problems.append(
                f"centroid_intermediate_top_k {top_k} exceeds num_centroids {centroids}"
            )
    if problems:
        raise invalid_config(path, "assistant", problems)


def block_size_of(path: Path) -> int:
    """``num_assistant_tokens`` from the checkpoint's generation_config.json."""
    file = path / "generation_config.json"
    if not file.exists():
        return DEFAULT_NUM_ASSISTANT_TOKENS
    tokens = read_json(file).get("num_assistant_tokens")
    if tokens is None:
        return DEFAULT_NUM_ASSISTANT_TOKENS
    return check(tokens, f"{file}: num_assistant_tokens", "integer", 1, MAX_DRAFT_TOKENS)


def load(
    path: Path, config: dict, kv_view: str = "transformers", dtype=None, lazy=False,
    scheduler: Optional[str] = None,
):
    validate_config(config, path, tensor_shapes(path))
    block_size = block_size_of(path)
    model = load_network(path, Model, ModelArgs, dtype, lazy)
    return AssistantDrafter(model, path, block_size, kv_view, scheduler)


def detect(config: dict) -> bool:
    return architecture(config) in ARCHITECTURES or config.get("model_type") in MODEL_TYPES


KIND = DrafterKind(
    name="gemma4-assistant", architectures=ARCHITECTURES, detect=detect, load=load
)


@hookimpl
def mlx_dspark_drafter_kinds():
    return [KIND]
