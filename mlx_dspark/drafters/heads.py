"""DeepSpec's DSpark heads: the Markov heads that correct each draft position
with the previous draft token, and the confidence head."""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn


class VanillaMarkovHead(nn.Module):
    """``bias(x_prev) = W2 · W1[x_prev]``: a low-rank bigram correction."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def initial_state(self, hidden: mx.array):
        return None

    def step(self, prev_embedding: mx.array, hidden: mx.array, state):
        return self.markov_w2(prev_embedding), state


class GatedMarkovHead(VanillaMarkovHead):
    """The bigram correction gated by ``σ(gate_proj([h ; W1[x_prev]]))``."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, prev_embedding, hidden, state):
        gate = mx.sigmoid(
            self.gate_proj(mx.concatenate([hidden, prev_embedding], axis=-1))
        )
        return self.markov_w2(gate.astype(prev_embedding.dtype) * prev_embedding), state


class RNNMarkovHead(VanillaMarkovHead):
    """A GRU-like state carried across the block (paper eq. 6):
    ``[s ; W1[x_prev] ; h] -> (gate, candidate, out)``."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, hidden):
        return mx.zeros((*hidden.shape[:-2], self.rank), hidden.dtype)

    def step(self, prev_embedding, hidden, state):
        z = mx.concatenate(
            [state, prev_embedding.astype(hidden.dtype), hidden], axis=-1
        )
        gate, candidate, out = mx.split(self.joint_proj(z), 3, axis=-1)
        gate = mx.sigmoid(gate)
        state = gate * state + (1.0 - gate) * mx.tanh(candidate)
        return self.markov_w2(mx.tanh(out)), state


MARKOV_HEADS = {
    "vanilla": VanillaMarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RNNMarkovHead,
}


def make_markov_head(
    kind: Optional[str], vocab_size: int, rank: int, hidden_size: int
) -> Optional[VanillaMarkovHead]:
    if rank <= 0:
        return None
    if kind not in MARKOV_HEADS:
        raise ValueError(
            f"Unknown markov_head_type {kind!r}; supported: {', '.join(MARKOV_HEADS)}."
        )
    return MARKOV_HEADS[kind](vocab_size, rank, hidden_size)


class ConfidenceHead(nn.Module):
    """``c_k = w · [h_k ; W1[x_{k-1}]] + b`` (DeepSpec's ``AcceptRatePredictor``):
    the logit of P(draft k survives | drafts before it survived)."""

    def __init__(self, input_dims: int):
        super().__init__()
        self.proj = nn.Linear(input_dims, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return self.proj(features).squeeze(-1).astype(mx.float32)
