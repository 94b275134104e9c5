"""DeepSpec's ``Qwen3DSparkModel``: the DSpark and DFlash drafters for Qwen3.

The network is ``deepspec_model.Model`` on Qwen3's geometry: plain embeddings
(no sqrt(d) scale), no logit soft-cap, separate K and V projections with q/k
RMSNorm and no V norm, 1/sqrt(head_dim) attention scaling, standard RoPE,
pre-norm SwiGLU layers.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from mlx_lm.models.base import BaseModelArgs

from ..checkpoints import SIZE, Field
from ..plugins import hookimpl
from ..validation import problem
from .deepspec import drafter_kind
from .deepspec_model import Geometry
from .layers import PreNormDecoderLayer


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: List[int]
    mask_token_id: int
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    rope_parameters: Optional[Dict] = None
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    markov_rank: int = 0
    markov_head_type: Optional[str] = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    def __post_init__(self):
        # transformers >= 5 nests rope_theta and rope_scaling under rope_parameters.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None:
                self.rope_scaling = self.rope_parameters

    @property
    def geometry(self) -> Geometry:
        return Geometry(
            head_dim=self.head_dim,
            num_key_value_heads=self.num_key_value_heads,
            attention_scale=self.head_dim**-0.5,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            decoder_layer=PreNormDecoderLayer,
        )


FIELDS = {
    "head_dim": SIZE,
    "rope_theta": Field("positive", required=False, nullable=True),
    "rope_scaling": Field("object", required=False, nullable=True),
    "rope_parameters": Field("object", required=False, nullable=True),
    "hidden_act": Field("string", required=False),
}


def config_problems(config: dict) -> list:
    problems = []
    theta = config.get("rope_theta")
    if theta is None:
        theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        problems.append("there is no rope_theta (top level or in rope_parameters)")
    elif problem(theta, "positive"):
        problems.append(f"rope_theta must be a number > 0, got {theta!r}")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        problems.append(f"hidden_act {activation!r} is not supported")
    return problems


KIND = drafter_kind("qwen3", "Qwen3DSparkModel", ModelArgs, FIELDS, config_problems)


@hookimpl
def mlx_dspark_drafter_kinds():
    return [KIND]
