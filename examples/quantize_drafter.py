"""Quantize a drafter (`mlx_dspark convert`) and compare acceptance and
speed of the float, 8-bit and 4-bit drafters on the same prompts.

Quantizing changes what a draft costs and may change which drafts are
accepted, never the output: the target verifies every draft.
"""

import argparse
import tempfile
import time
from pathlib import Path

from mlx_lm import load

import mlx_dspark
from mlx_dspark.convert import convert

HERE = Path(__file__).resolve().parent
TINY = HERE.parent / "tests" / "fixtures" / "deepspec-tiny"


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument("--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4"))
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--q-group-size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4, help="how many prompts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", help="directory for the converted drafters")
    args = parser.parse_args()

    out = Path(args.out or tempfile.mkdtemp())
    drafters = {"float": args.draft_model}
    for bits in args.bits:
        drafters[f"{bits}-bit"] = convert(
            args.draft_model, out / f"{bits}bit", q_bits=bits,
            q_group_size=args.q_group_size,
        )  # fmt: skip

    model, tokenizer = load(args.model)
    lines = (HERE / "calibration" / "tiny_prompts.txt").read_text().splitlines()
    prompts = lines[: args.prompts]
    reference = None
    print("\ndrafter   size MB  tok/s   tau  acceptance by position")
    for name, path in drafters.items():
        drafter = mlx_dspark.load_drafter(path)
        stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
        outputs, count = [], 0
        for timed in (False, True):  # a warm-up pass, then the timed one
            tic = time.perf_counter()
            for prompt in prompts:
                responses = list(
                    mlx_dspark.stream_generate(
                        model, tokenizer, prompt, draft=drafter,
                        max_tokens=args.max_tokens,
                    )  # fmt: skip
                )
                if timed:
                    stats.history += responses[-1].stats.history
                    outputs.append([r.token for r in responses])
                    count += len(responses)
        speed = count / (time.perf_counter() - tic)
        by_position = " ".join(
            "-" if a is None else f"{a:.2f}" for a in stats.acceptance_by_position
        )
        print(
            f"{name:<8} {size_mb(path):8.2f}  {speed:5.1f}  {stats.tau:4.2f}  "
            f"{by_position}"
        )
        reference = reference or outputs
        assert outputs == reference, "a quantized drafter changed the output"
    print("Every drafter gave the same output.")


if __name__ == "__main__":
    main()
