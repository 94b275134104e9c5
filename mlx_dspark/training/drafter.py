"""A new DeepSpec drafter for a target (``deepspec/modeling/dspark/*/config.py:
build_draft_config``, ``initialize_embeddings_and_head``), and checkpoints in
DeepSpec's released layout: ``config.json`` plus one ``model.safetensors``
with unprefixed names, the target's embedding and ``lm_head`` included."""

import copy
import json
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..drafters import gemma4_dspark, qwen3_dspark
from ..drafters.deepspec_model import Model

FAMILIES = {
    "gemma4": ("Gemma4DSparkModel", gemma4_dspark),
    "qwen3": ("Qwen3DSparkModel", qwen3_dspark),
}
# Gemma's tokenizer family: 0 pad, 1 eos, 2 bos, 3 unk, 4 <mask>.
MASK_TOKEN_IDS = {"gemma4": 4}


def drafter_config(
    target_config: dict,
    family: str,
    target_layer_ids: List[int],
    block_size: int = 7,
    num_layers: int = 5,
    mask_token_id: Optional[int] = None,
    num_anchors: int = 512,
    markov_rank: int = 256,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
    dtype: str = "float32",
) -> dict:
    """The drafter's config: the target's text config with DeepSpec's
    overrides (``markov_rank=0`` and no confidence head make a DFlash)."""
    if family not in FAMILIES:
        raise ValueError(f"No drafter for {family} targets; supported: {', '.join(FAMILIES)}.")
    if mask_token_id is None:
        if family not in MASK_TOKEN_IDS:
            raise ValueError(f"Give the mask token id of this {family} tokenizer (--mask-token-id).")
        mask_token_id = MASK_TOKEN_IDS[family]
    text = copy.deepcopy(target_config.get("text_config", target_config))
    config = dict(text)
    config.update(
        architectures=[FAMILIES[family][0]],
        target_model_type=target_config.get("model_type"),
        target_text_model_type=text.get("model_type"),
        num_target_layers=text["num_hidden_layers"],
        num_hidden_layers=num_layers,
        block_size=block_size,
        tie_word_embeddings=False,
        mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids),
        num_anchors=num_anchors,
        enable_confidence_head=confidence_head,
        markov_rank=markov_rank,
        dtype=dtype,
    )
    if family == "gemma4":
        config["layer_types"] = ["full_attention"] * num_layers
    if confidence_head:
        config["confidence_head_with_markov"] = markov_rank > 0
    if markov_rank > 0:
        config["markov_head_type"] = markov_head_type
    return config


def target_embeddings(model):
    """The target's input embedding and output head weights (dequantized)."""
    lm = getattr(model, "language_model", model)

    def weight(layer):
        if hasattr(layer, "scales"):
            return mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
        return layer.weight

    embed = weight(lm.model.embed_tokens)
    head = weight(lm.lm_head) if "lm_head" in lm else embed
    return embed, head


def build(config: dict, family: str, target_model, seed: int = 0) -> nn.Module:
    """The drafter network, initialised as transformers' ``_init_weights``
    does (normal(0, initializer_range) matrices, zero biases, unit norms),
    then given the target's embedding and head."""
    module = FAMILIES[family][1]
    model = Model(module.ModelArgs.from_dict(config))
    std = config.get("initializer_range", 0.02)
    key = mx.random.key(seed)

    def init(path, p):
        nonlocal key
        if path.endswith("layer_scalar") or "norm" in path:
            return mx.ones_like(p)
        if path.endswith("bias"):
            return mx.zeros_like(p)
        key, sub = mx.random.split(key)
        return std * mx.random.normal(p.shape, p.dtype, key=sub)

    model.update(tree_map_with_path(lambda path, p: init(path, p), model.parameters()))
    embed, head = target_embeddings(target_model)
    model.embed_tokens.weight = embed.astype(mx.float32)
    model.lm_head.weight = head.astype(mx.float32)
    mx.eval(model.parameters())
    return model


def save(model: nn.Module, config: dict, folder: Path) -> None:
    """``config.json`` and ``model.safetensors`` as DeepSpec saves them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(
        str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "pt"}
    )
