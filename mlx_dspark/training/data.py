"""The prepared training data: shards of sequences with the target's taps.

A data folder holds ``meta.json`` (the target, its taps, the sizes) and
``shard-00000.safetensors`` … Each shard concatenates its sequences:
``input_ids`` and ``loss_mask`` (``[T]``), ``hidden`` (the taps concatenated
in ``target_layer_ids`` order, ``[T, m·d]``, bfloat16), ``last_hidden`` (the
final-normed hidden state, ``[T, d]``, bfloat16) and ``offsets``
(``[sequences + 1]``, where each sequence starts).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List

import mlx.core as mx
import numpy as np

META = "meta.json"


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.safetensors"


def write_shard(folder: Path, index: int, sequences: List[dict]) -> None:
    """Write the sequences (each ``input_ids``, ``loss_mask``, ``hidden``,
    ``last_hidden``) atomically, so an interrupted run leaves whole shards."""
    lengths = [len(s["input_ids"]) for s in sequences]
    arrays = {
        "offsets": mx.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
        "input_ids": mx.concatenate([mx.array(s["input_ids"], mx.int32) for s in sequences]),
        "loss_mask": mx.concatenate([mx.array(s["loss_mask"], mx.uint8) for s in sequences]),
        "hidden": mx.concatenate([s["hidden"] for s in sequences]).astype(mx.bfloat16),
        "last_hidden": mx.concatenate([s["last_hidden"] for s in sequences]).astype(mx.bfloat16),
    }
    final = shard_path(folder, index)
    partial = final.with_name(final.stem + ".partial.safetensors")
    mx.save_safetensors(str(partial), arrays)
    partial.replace(final)


def complete_shards(folder: Path) -> int:
    """How many shards are written, counting from 0."""
    count = 0
    while shard_path(folder, count).exists():
        count += 1
    return count


def read_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / META).read_text())
    except OSError:
        raise ValueError(
            f"{folder} holds no prepared data ({META} is missing); run "
            "`mlx_dspark prepare` first."
        ) from None


@dataclass
class Sequence:
    input_ids: mx.array
    loss_mask: mx.array
    hidden: mx.array
    last_hidden: mx.array


def read_sequences(folder: Path) -> List[Sequence]:
    """Every prepared sequence, in order (tensors are loaded lazily)."""
    sequences = []
    for index in range(complete_shards(folder)):
        shard = mx.load(str(shard_path(folder, index)))
        offsets = shard["offsets"].tolist()
        for start, end in zip(offsets, offsets[1:]):
            sequences.append(
                Sequence(*(shard[k][start:end] for k in ("input_ids", "loss_mask", "hidden", "last_hidden")))
            )
    return sequences


def collate(sequences: List[Sequence], dtype=mx.float32) -> dict:
    """Right-pad to the longest sequence; padding has loss mask 0, so it is
    never an anchor, a label or visible context."""
    length = max(len(s.input_ids) for s in sequences)

    def pad(x):
        widths = [(0, length - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        return mx.pad(x, widths)

    return {
        "input_ids": mx.stack([pad(s.input_ids) for s in sequences]),
        "loss_mask": mx.stack([pad(s.loss_mask) for s in sequences]),
        "hidden": mx.stack([pad(s.hidden) for s in sequences]).astype(dtype),
        "last_hidden": mx.stack([pad(s.last_hidden) for s in sequences]).astype(dtype),
    }
