"""Write a random-weight Gemma-4-12B-shaped target and DSpark/DFlash drafter
to disk, for benchmarks that start real processes (``server_load.py``).

The target is ``shapes.target_config`` in mlx-lm's layout; the drafter is
written as ``mlx_dspark train`` writes one (DeepSpec's released layout) with
the released taps. The tokenizer is the bundled tiny one's word-level
tokenizer widened to the whole vocabulary (``▁w<id>`` for every id), so every
token a random model emits decodes. Weights are random: only timings mean
anything.

    python benchmarks/write_shapes.py --out /tmp/shapes [--scale 16]
"""

import argparse
import json
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

import shapes
from mlx_dspark.drafters import gemma4_dspark
from mlx_dspark.drafters.deepspec_model import Model
from mlx_dspark.training import drafter as training_drafter

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny" / "target_tiny_gemma4"
TARGET_KEYS = dict(
    architectures=["Gemma4ForCausalLM"], bos_token_id=2, eos_token_id=1, pad_token_id=0,
    max_position_embeddings=131072, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
)
SHARD_BYTES = 4 << 30


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    tokenizer = json.loads((TINY / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"▁w{i}"] = i
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY / name, folder / name)


def save_weights(model, folder: Path) -> None:
    """``model-0000N.safetensors`` shards of at most ``SHARD_BYTES``."""
    shards, shard, size = [], {}, 0
    for name, weight in tree_flatten(model.parameters()):
        if shard and size + weight.nbytes > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = weight
        size += weight.nbytes
    shards.append(shard)
    for i, weights in enumerate(shards):
        mx.save_safetensors(str(folder / f"model-{i:05d}.safetensors"), weights, {"format": "mlx"})


def write_target(folder: Path, scale: int, layers: Optional[int] = None) -> dict:
    """The target; with ``layers``, only the first ``layers`` of its layers."""
    config = {**shapes.target_config(scale), **TARGET_KEYS}
    if layers:
        config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers])
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(shapes.make_target_from(config), folder)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(folder, config["vocab_size"])
    return config


def write_drafter(folder: Path, target: dict, variant: str, scale: int) -> None:
    layout = shapes.drafter_config(target, variant, scale)
    config = training_drafter.drafter_config(
        {**target, "model_type": "gemma4_text"}, "gemma4", layout["target_layer_ids"],
        block_size=layout["block_size"], num_layers=layout["num_hidden_layers"],
        markov_rank=layout["markov_rank"], confidence_head=variant == "dspark", dtype="bfloat16",
    )
    model = Model(gemma4_dspark.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    training_drafter.save(model, config, folder)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=["dspark"], choices=["dspark", "dflash"])
    args = p.parse_args()
    mx.random.seed(0)
    target = write_target(args.out / "target", args.scale)
    for variant in args.variants:
        write_drafter(args.out / variant, target, variant, args.scale)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
