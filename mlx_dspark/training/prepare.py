"""``mlx_dspark prepare``: the training data for a drafter of a target.

The target answers every prompt itself (what the drafter must learn to
predict), then one forward over prompt + answer records its taps, as
DeepSpec's ``scripts/data/prepare_target_cache.py`` does with forward hooks.
The answer tokens carry the loss mask. Shards are written as they fill;
running the command again continues after the last complete shard.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from tqdm import tqdm

from ..confidence.calibrate import encode, read_prompts
from ..plugins import find_target_adapter
from ..targets.base import FINAL
from . import data


def default_taps(num_layers: int, count: int = 5) -> List[int]:
    """``count`` layers spread from layer 1 to the third-last (z-lab DFlash's
    ``build_target_layer_ids``); the last layer is never tapped."""
    count = max(1, min(count, num_layers - 1))
    if count == 1:
        return [num_layers // 2]
    start, end = 1, max(num_layers - 3, count)
    return sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)})


def answer(model, prompt_ids: List[int], max_tokens: int, sampler, stop) -> List[int]:
    tokens = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=sampler):
        tokens.append(int(token))
        if token in stop:
            break
    return tokens


def record(target, prompt_ids: List[int], answer_ids: List[int], taps: List[int]) -> dict:
    ids = prompt_ids + answer_ids
    out = target(mx.array(ids)[None], target.make_cache(1), list(taps) + [FINAL])
    hidden = mx.concatenate(out.hidden[:-1], axis=-1)[0]
    sequence = {
        "input_ids": ids,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(answer_ids),
        "hidden": hidden.astype(mx.bfloat16),
        "last_hidden": out.hidden[-1][0].astype(mx.bfloat16),
    }
    mx.eval(sequence["hidden"], sequence["last_hidden"])
    return sequence


def size_estimate(prompt_tokens: int, prompts: int, max_tokens: int, taps: int, hidden: int) -> int:
    """Bytes on disk at most: bf16 taps and last hidden, ids and mask."""
    tokens = prompt_tokens + prompts * max_tokens
    return tokens * ((taps + 1) * hidden * 2 + 5)


def prepare(
    model_path: str,
    prompts_file: Path,
    out: Path,
    taps: Optional[List[int]] = None,
    max_tokens: int = 512,
    temperature: float = 1.0,
    shard_size: int = 64,
    seed: int = 0,
    chat_template: bool = True,
) -> dict:
    model, tokenizer = load(model_path)
    target = find_target_adapter(model).adapt(model)
    prompts = read_prompts(prompts_file)
    taps = list(taps) if taps else default_taps(target.num_layers)
    meta = {
        "model": str(model_path),
        "family": target.family,
        "target_layer_ids": taps,
        "num_target_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "shard_size": shard_size,
        "prompts": str(prompts_file),
        "num_prompts": len(prompts),
    }
    out.mkdir(parents=True, exist_ok=True)
    meta_file = out / data.META
    if meta_file.exists():
        old = json.loads(meta_file.read_text())
        if old != meta:
            changed = sorted(k for k in meta if old.get(k) != meta[k])
            raise ValueError(
                f"{out} holds data prepared with other settings ({', '.join(changed)}); "
                "use another --out folder."
            )
    meta_file.write_text(json.dumps(meta, indent=2) + "\n")

    encoded = [encode(tokenizer, p, chat_template) for p in prompts]
    estimate = size_estimate(
        sum(map(len, encoded)), len(encoded), max_tokens, len(taps), target.hidden_size
    )
    print(
        f"{len(encoded)} prompts, taps {taps}: at most {estimate / 2**20:.1f} MiB in {out}",
        file=sys.stderr,
    )
    done = data.complete_shards(out)
    sampler = make_sampler(temp=temperature)
    stop = set(tokenizer.eos_token_ids)
    bar = tqdm(total=len(encoded), initial=min(done * shard_size, len(encoded)),
               unit="seq", disable=not sys.stderr.isatty())
    for index in range(done, -(-len(encoded) // shard_size)):
        sequences = []
        for number in range(index * shard_size, min((index + 1) * shard_size, len(encoded))):
            # Every prompt has its own seed, so a resumed run samples the same.
            mx.random.seed(seed + number)
            ids = encoded[number]
            sequences.append(record(target, ids, answer(model, ids, max_tokens, sampler, stop), taps))
            bar.update()
        data.write_shard(out, index, sequences)
    bar.close()
    return meta


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark prepare",
        description="Generate the target's own answers to prompts and record its "
        "hidden states: the data `mlx_dspark train` trains a drafter on.",
    )
    p.add_argument("--model", required=True, help="the target model (path or hub id)")
    p.add_argument("--data", required=True, type=Path,
                   help="prompts: JSONL with prompt/text/messages, or a text file, one per line")
    p.add_argument("--out", required=True, type=Path, help="folder for the shards")
    p.add_argument("--taps", type=lambda s: [int(x) for x in s.split(",")],
                   help="target layers to record, e.g. 5,17,29,41,46 (default: 5 spread layers)")
    p.add_argument("--max-tokens", type=int, default=512, help="answer length cap")
    p.add_argument("--temp", type=float, default=1.0, help="sampling temperature of the answers")
    p.add_argument("--shard-size", type=int, default=64, help="sequences per shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-chat-template", action="store_true")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        prepare(args.model, args.data, args.out, args.taps, args.max_tokens, args.temp,
                args.shard_size, args.seed, not args.ignore_chat_template)
    except ValueError as e:
        print(f"mlx_dspark prepare: error: {e}", file=sys.stderr)
        return 1
    return 0
