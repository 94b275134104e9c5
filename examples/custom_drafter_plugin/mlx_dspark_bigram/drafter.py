"""The ``bigram`` drafter kind: ``next_token[t]`` is the draft after ``t``.

A checkpoint is a directory with ``config.json`` (``"architectures":
["BigramDrafter"]``, ``vocab_size``, ``block_size``) and ``model.safetensors``
holding ``next_token`` (``[vocab_size]``).
"""

import json
from pathlib import Path

import mlx.core as mx
from mlx_dspark.drafters.base import Proposal
from mlx_dspark.plugins import DrafterKind, architecture, hookimpl
from mlx_dspark.targets.base import FINAL

ARCHITECTURE = "BigramDrafter"


class Positions:
    """The drafter's state: only how many positions it has taken in, so that
    a prompt cache trims it with the target's caches."""

    offset = 0

    @property
    def state(self):
        return []

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n


class BigramDrafter:
    name = "bigram"
    # The engine hands the drafter these taps of every final position; this
    # drafter only counts them.
    taps = (FINAL,)

    def __init__(self, path: Path, next_token: mx.array, block_size: int):
        self.path = path
        self.next_token = next_token
        self.block_size = self.max_draft_tokens = block_size

    def __repr__(self):
        return f"<bigram drafter, block {self.block_size}, from {self.path}>"

    def check_target(self, target):
        if target.vocab_size != self.next_token.size:
            raise ValueError(
                f"The bigram drafter {self.path} has {self.next_token.size} tokens, "
                f"the target {target.vocab_size}."
            )

    def make_cache(self):
        return [Positions()]

    def commit(self, cache, hidden, proposal=None):
        cache[0].offset += hidden[0].shape[1]

    def propose(
        self, cache, anchor, num_drafts, draw=None, target=None, target_cache=None
    ):
        token = anchor.reshape(1)
        tokens, log_probs = [], []
        for _ in range(num_drafts):
            token = self.next_token[token]
            if draw is not None:
                # All mass on the table's token: rejection sampling then
                # accepts it with the target's probability of it.
                vocab = mx.arange(self.next_token.size)
                logits = mx.where(vocab == token, 0.0, -mx.inf)[None]
                token, log_q = draw(logits)
                if log_q is not None:
                    log_probs.append(log_q)
            tokens.append(token.reshape(1).astype(mx.uint32))
        return Proposal(
            tokens=mx.concatenate(tokens),
            log_probs=mx.concatenate(log_probs) if log_probs else None,
        )


def load(path: Path, config: dict, lazy: bool = False) -> BigramDrafter:
    """``lazy``: mlx-dspark checks a pair before running it with
    ``lazy=True``; the table is small, so it is read either way."""
    weights = mx.load(str(path / "model.safetensors"))
    if "next_token" not in weights:
        raise ValueError(f"{path}/model.safetensors has no next_token table.")
    return BigramDrafter(path, weights["next_token"], config["block_size"])


def save(path: Path, next_token: mx.array, block_size: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCHITECTURE],
        "vocab_size": next_token.size,
        "block_size": block_size,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), {"next_token": next_token})


@hookimpl
def mlx_dspark_drafter_kinds():
    return [
        DrafterKind(
            name="bigram",
            architectures=(ARCHITECTURE,),
            detect=lambda config: architecture(config) == ARCHITECTURE,
            load=load,
        )
    ]
