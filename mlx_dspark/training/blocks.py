"""DeepSpec's training blocks: anchors, the block inputs and labels, and
which keys each block sees (``deepspec/modeling/dspark/common.py``).

A sequence ``x`` of length ``S`` holds ``n`` blocks. Block ``j`` starts at an
anchor ``p_j``: its inputs are ``[x_{p_j}, mask × (B-1)]`` at positions
``p_j + 0..B-1`` and its labels ``x_{p_j+1 .. p_j+B}``. It sees the context
strictly before the anchor and its own ``B`` keys. Sequences with fewer than
``n`` anchor candidates are filled with dummy blocks (anchor 0, ``keep``
False) that see nothing and weigh nothing.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator):
    """Up to ``num_anchors`` anchors per row, drawn uniformly without
    replacement among the positions ``p <= S-2`` where ``loss_mask[p]`` and
    ``loss_mask[p+1]`` are both set, sorted; the missing ones are dummies at 0
    at the end. Returns ``(anchors [b, n] int32, keep [b, n] bool)``."""
    loss_mask = np.asarray(loss_mask, dtype=bool)
    rows = loss_mask.shape[0]
    anchors = np.zeros((rows, num_anchors), np.int32)
    keep = np.zeros((rows, num_anchors), bool)
    for i, row in enumerate(loss_mask):
        candidates = np.flatnonzero(row[:-1] & row[1:])
        chosen = np.sort(rng.permutation(candidates)[:num_anchors])
        anchors[i, : len(chosen)] = chosen
        keep[i, : len(chosen)] = True
    return anchors, keep


@dataclass
class Blocks:
    """The blocks of a batch (``b`` rows, ``n`` blocks of ``B``).

    Args:
        anchors, keep: ``[b, n]``.
        inputs: The block input ids, ``[b, n·B]``.
        labels: The ids each slot predicts, ``[b, n, B]``.
        prev: The teacher-forced previous tokens of the Markov and confidence
            heads, ``[anchor, labels[:-1]]``, ``[b, n, B]``.
        eval_mask: Which slots count: the label is inside the sequence, in the
            loss mask, in a kept block and every slot before it counts too.
        aligned: The position whose target hidden state predicts each label.
        mask: The visibility ``[b, 1, n·B, S + n·B]`` (True = visible).
    """

    anchors: mx.array
    keep: mx.array
    inputs: mx.array
    labels: mx.array
    prev: mx.array
    eval_mask: mx.array
    aligned: mx.array
    mask: mx.array

    @property
    def position_ids(self) -> mx.array:
        """``[arange(S) ‖ p_j + 0..B-1 for each block]``, ``[b, S + n·B]``."""
        b, n, B = self.labels.shape
        S = self.mask.shape[-1] - n * B
        blocks = (self.anchors[..., None] + mx.arange(B)).reshape(b, n * B)
        return mx.concatenate([mx.broadcast_to(mx.arange(S), (b, S)), blocks], axis=1)

    def attention_mask(self):
        """The mask and the row weights the forward uses. A dummy block's row
        sees nothing, which MLX's attention turns into NaN: let it see its own
        block and zero its output instead (the reference's output is 0)."""
        b, n, B = self.labels.shape
        own = mx.repeat(mx.repeat(mx.eye(n, dtype=mx.bool_), B, 0), B, 1)
        mask = self.mask.astype(mx.bool_)
        S = mask.shape[-1] - n * B
        mask = mx.concatenate([mask[..., :S], mask[..., S:] | own], axis=-1)
        keep = mx.repeat(self.keep, B, axis=1).astype(mx.float32)
        return mask, keep.reshape(b, 1, n * B, 1)


def make_blocks(
    input_ids: mx.array,
    loss_mask: mx.array,
    anchors: mx.array,
    keep: mx.array,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """The blocks at ``anchors`` (``[b, n]``; see ``sample_anchors``)."""
    b, S = input_ids.shape
    n = anchors.shape[1]
    B = block_size
    anchors = anchors.astype(mx.int32)
    keep = keep.astype(mx.bool_)
    rows = mx.arange(b)[:, None, None]

    first = mx.where(keep, input_ids[mx.arange(b)[:, None], anchors], mask_token_id)
    inputs = mx.concatenate(
        [first[..., None], mx.full((b, n, B - 1), mask_token_id, input_ids.dtype)],
        axis=-1,
    ).reshape(b, n * B)

    index = anchors[..., None] + mx.arange(1, B + 1)
    safe = mx.where(keep[..., None], mx.minimum(index, S - 1), 0)
    labels = input_ids[rows, safe]
    prev = mx.concatenate([input_ids[rows, anchors[..., None]], labels[..., :-1]], -1)
    valid = (index < S) & loss_mask.astype(mx.bool_)[rows, safe] & keep[..., None]
    eval_mask = mx.cumprod(valid.astype(mx.int32), axis=-1).astype(mx.bool_)

    context = mx.arange(S) < anchors[..., None]  # [b, n, S]
    own = mx.eye(n, dtype=mx.bool_)[None] & keep[..., None]  # [b, n, n]
    visible = mx.concatenate(
        [context & keep[..., None], mx.repeat(own, B, axis=-1)], axis=-1
    )
    mask = mx.repeat(visible, B, axis=1)[:, None]
    return Blocks(
        anchors=anchors,
        keep=keep,
        inputs=inputs,
        labels=labels,
        prev=prev,
        eval_mask=eval_mask,
        aligned=mx.maximum(safe - 1, 0),
        mask=mask,
    )
