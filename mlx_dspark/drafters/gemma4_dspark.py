"""DeepSpec's ``Gemma4DSparkModel``: the DSpark and DFlash drafters for Gemma-4.

The network is ``deepspec_model.Model`` on the target's global attention
geometry for every layer (``global_head_dim``, proportional RoPE, K = V when
``attention_k_eq_v``, V normed without weight, no ``1/sqrt(head_dim)``: q/k
norms stand in for it), with Gemma-4's decoder layer, embeddings scaled by
``sqrt(d)`` and soft-capped logits.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from mlx_lm.models.base import BaseModelArgs

from ..checkpoints import FLAG, NULLABLE_SIZE, SIZE, Field
from ..plugins import hookimpl
from ..validation import problem
from .deepspec import drafter_kind
from .deepspec_model import Geometry
from .layers import GemmaDecoderLayer


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    global_head_dim: int
    vocab_size: int
    rope_parameters: Dict
    block_size: int
    num_target_layers: int
    target_layer_ids: List[int]
    mask_token_id: int
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: Optional[float] = None
    max_position_embeddings: int = 131072
    hidden_activation: str = "gelu_pytorch_tanh"
    markov_rank: int = 0
    markov_head_type: Optional[str] = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    @property
    def geometry(self) -> Geometry:
        rope = self.rope_parameters["full_attention"]
        return Geometry(
            head_dim=self.global_head_dim,
            num_key_value_heads=(
                self.num_global_key_value_heads
                if self.attention_k_eq_v
                else self.num_key_value_heads
            ),
            attention_scale=1.0,  # q_norm and k_norm stand in for 1/sqrt(head_dim)
            rope_theta=rope["rope_theta"],
            rope_scaling=rope,
            decoder_layer=GemmaDecoderLayer,
            k_eq_v=self.attention_k_eq_v,
            v_norm=True,
            embed_scale=True,
            logit_softcap=self.final_logit_softcapping,
        )


FIELDS = {
    "global_head_dim": SIZE,
    "rope_parameters": Field("object"),
    "num_global_key_value_heads": NULLABLE_SIZE,
    "attention_k_eq_v": FLAG,
    "final_logit_softcapping": Field("positive", required=False, nullable=True),
    "hidden_activation": Field("string", required=False),
}


def config_problems(config: dict) -> list:
    problems = []
    if config.get("attention_k_eq_v") and not config.get("num_global_key_value_heads"):
        problems.append("attention_k_eq_v needs num_global_key_value_heads")
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {activation!r} is not supported")
    if config.get("enable_moe_block") or config.get("hidden_size_per_layer_input"):
        problems.append(
            "MoE blocks and per-layer inputs are not part of DSpark drafters"
        )
    full = config["rope_parameters"].get("full_attention")
    if not isinstance(full, dict) or full.get("rope_theta") is None:
        problems.append(
            "rope_parameters has no 'full_attention' entry with a rope_theta"
        )
        return problems
    if problem(full["rope_theta"], "positive"):
        problems.append(f"rope_theta must be a number > 0, got {full['rope_theta']!r}")
    factor = full.get("partial_rotary_factor", 1.0)
    if problem(factor, "number", 0, 1):
        problems.append(f"partial_rotary_factor must be a number in [0, 1], got {factor!r}")
    return problems


KIND = drafter_kind("gemma4", "Gemma4DSparkModel", ModelArgs, FIELDS, config_problems)


@hookimpl
def mlx_dspark_drafter_kinds():
    return [KIND]
