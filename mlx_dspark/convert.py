"""``mlx_dspark convert``: an MLX-quantized or re-typed copy of a drafter checkpoint.

The drafter is loaded with its own kind's loader, quantized with mlx-lm's
``quantize_model`` and written with mlx-lm's ``save_model`` and
``save_config``, so that ``load_drafter`` (through mlx-lm's ``load_model``)
quantizes again exactly the layers whose ``scales`` are in the weights.
Every Linear and Embedding becomes a quantized layer (embeddings and the
Markov head's ``markov_w1`` become quantized lookups) except the confidence
head, whose single output decides how many drafts are verified, and layers
whose weight rows do not split into whole groups. Norms and biases stay
float.
"""

import argparse
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model, save_config, save_model

from .checkpoints import (
    DTYPES,
    load_drafter,
    parse_dtype,
    read_config,
    resolve_checkpoint,
)
from .progress import progress

QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
FLOAT_HEAD = "confidence_head"
# What save_model and save_config write; every other file is copied as is
# (generation_config.json holds the assistant's drafts per round).
WRITTEN_SUFFIXES = (".safetensors", ".safetensors.index.json")


def check_options(q_bits, q_group_size, dtype) -> None:
    if q_bits is None and dtype is None:
        raise ValueError(
            "Nothing to convert: give q_bits (--q-bits), dtype (--dtype) or both."
        )
    if q_bits is not None and q_bits not in QUANT_BITS:
        raise ValueError(
            f"q_bits must be one of {', '.join(map(str, QUANT_BITS))}, got {q_bits!r}."
        )
    if q_group_size not in GROUP_SIZES:
        raise ValueError(
            f"q_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, "
            f"got {q_group_size!r}."
        )
    parse_dtype(dtype)


def check_out(out: Path, source: Path) -> None:
    if out.resolve() == source.resolve():
        raise ValueError(
            f"The output directory {out} is the source checkpoint; pick another "
            "directory."
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"The output {out} is a file; pick a directory.")
    if out.exists() and any(out.iterdir()):
        raise ValueError(
            f"The output directory {out} exists and is not empty; pick another "
            "directory or remove it."
        )


def network_of(drafter, source: Path) -> nn.Module:
    model = getattr(drafter, "model", None)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"The {getattr(drafter, 'name', type(drafter).__name__)} drafter in "
            f"{source} has no network (.model, an mlx.nn.Module) to convert."
        )
    return model


def float_layers(model: nn.Module, group_size: int) -> List[Tuple[str, str]]:
    """The quantizable layers left float, each with the reason."""
    kept = []
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized"):
            continue
        if FLOAT_HEAD in path:
            kept.append((path, "the confidence head stays float"))
        else:
            kept.append(
                (
                    path,
                    (
                        f"its weight's last dimension ({module.weight.shape[-1]}) "
                        f"is not a multiple of the group size {group_size}"
                    ),
                )
            )
    return kept


def copy_other_files(source: Path, out: Path) -> None:
    for file in source.iterdir():
        if (
            file.is_file()
            and file.name != "config.json"
            and not file.name.endswith(WRITTEN_SUFFIXES)
        ):
            shutil.copy(file, out / file.name)


def convert(
    path_or_hub_id: Union[str, Path],
    out: Union[str, Path],
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    revision: Optional[str] = None,
) -> Path:
    """Write the drafter at ``path_or_hub_id`` to ``out`` (a new or empty
    directory), cast to ``dtype`` (``"float32"``, ``"bfloat16"``,
    ``"float16"``) and/or quantized to ``q_bits`` bits in groups of
    ``q_group_size``. Returns ``out``."""
    check_options(q_bits, q_group_size, dtype)
    source = resolve_checkpoint(path_or_hub_id, revision)
    out = Path(out).expanduser()
    check_out(out, source)
    config = read_config(source)
    if q_bits is not None and (
        "quantization" in config or "quantization_config" in config
    ):
        raise ValueError(
            f"{source} is already quantized (its config.json has quantization "
            "settings); quantize the float checkpoint it was made from."
        )
    model = network_of(load_drafter(source, lazy=True), source)

    if dtype is not None:
        model.set_dtype(parse_dtype(dtype))
        config["dtype"] = dtype
    if q_bits is not None:
        model, config = quantize_model(
            model,
            config,
            q_group_size,
            q_bits,
            quant_predicate=lambda path, module: FLOAT_HEAD not in path,
        )
        print(f"Quantized to {q_bits} bits in groups of {q_group_size}.")
        for path, reason in float_layers(model, q_group_size):
            print(f"  kept float: {path} ({reason})")

    # The conversion is lazy until here: reading, casting and quantizing
    # happen tensor by tensor.
    for _, weight in progress(
        tree_flatten(model.parameters()), desc="convert", unit="tensor"
    ):
        mx.eval(weight)
    save_model(out, model)
    save_config(config, out / "config.json")
    copy_other_files(source, out)
    print(f"Wrote {out}")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlx_dspark convert",
        description="Write an MLX-quantized and/or re-typed copy of a drafter "
        "checkpoint, loadable with --draft-model. Norms, biases and the "
        "confidence head stay float.",
    )
    parser.add_argument("drafter", help="drafter checkpoint directory or Hub id")
    parser.add_argument(
        "--out", required=True, help="directory to write (new or empty)"
    )
    parser.add_argument(
        "--q-bits",
        type=int,
        choices=QUANT_BITS,
        help="quantize to this many bits per weight (8 and 4 are the usual)",
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        choices=GROUP_SIZES,
        default=64,
        help="weights per quantization scale (default 64); layers whose weight "
        "rows are not a multiple of it stay float",
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="cast the float weights to this type"
    )
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    args = parser.parse_args(argv)
    try:
        convert(
            args.drafter,
            args.out,
            args.q_bits,
            args.q_group_size,
            args.dtype,
            args.revision,
        )
    except (ValueError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0
