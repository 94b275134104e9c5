"""``mlx_dspark calibrate``: fit a DSpark drafter's confidence calibration.

Generates from the prompts with every draft verified (the fixed scheduler),
records each round's confidence logits and how many drafts survived, fits the
STS temperatures on most prompts and reports calibration before and after on
those and on the held-out rest. The result goes to a calibration file that
loading the drafter picks up; the checkpoint itself is never modified.
"""

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import List

import mlx.core as mx
from mlx_lm import load

from ..checkpoints import load_drafter
from ..progress import progress
from ..speculative.engine import speculative_generate_step
from ..speculative.sampling import make_sampler
from ..speculative.stats import SpeculativeStats
from .calibration import (
    Calibration,
    Rounds,
    default_calibration_path,
    fit_sts,
    metrics,
    weighted_mean,
)


def read_prompts(path: Path) -> list:
    """Prompts from a JSONL file (one object per line with ``"prompt"``,
    ``"text"`` or chat ``"messages"``) or a text file (one per line)."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise ValueError(f"Cannot read the prompts file {path} ({e}).") from None
    if not lines:
        raise ValueError(f"The prompts file {path} has no prompts.")
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not valid JSON ({e}).") from None
        prompt = None
        if isinstance(record, dict):
            prompt = (
                record.get("messages") or record.get("prompt") or record.get("text")
            )
        chat = isinstance(prompt, list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt
        )
        if not (chat and prompt) and not (isinstance(prompt, str) and prompt):
            raise ValueError(
                f'{path}:{number} needs a "prompt" or "text" string, or "messages": '
                'a list of {"role": ..., "content": "..."} objects.'
            )
        prompts.append(prompt)
    return prompts


def encode(tokenizer, prompt, chat_template: bool) -> List[int]:
    """Token ids as ``mlx_lm.generate`` makes them."""
    if chat_template and tokenizer.has_chat_template:
        messages = (
            prompt
            if isinstance(prompt, list)
            else [{"role": "user", "content": prompt}]
        )
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if isinstance(prompt, list):
        raise ValueError(
            "Chat messages need a tokenizer with a chat template; drop "
            "--ignore-chat-template or give plain prompts."
        )
    return tokenizer.encode(prompt)


def collect(model, tokenizer, drafter, prompts, args) -> List[SpeculativeStats]:
    """One generation per prompt with every draft verified."""
    sampler = make_sampler(args.temp, args.top_p)
    collected = []
    bar = progress(prompts, desc="calibrate", unit="prompt")
    for prompt in bar:
        ids = encode(tokenizer, prompt, not args.ignore_chat_template)
        stats = SpeculativeStats(drafter.name, drafter.block_size)
        for _ in speculative_generate_step(
            mx.array(ids),
            model,
            drafter,
            max_tokens=args.max_tokens,
            sampler=sampler,
            stop_tokens=tokenizer.eos_token_ids,
            stats=stats,
            scheduler="fixed",
        ):
            pass
        collected.append(stats)
        bar.set_postfix(rounds=stats.rounds, tau=f"{stats.tau:.2f}")
    return collected


def split(count: int, holdout: float, seed: int):
    """Prompt indices to fit on and to hold out."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = min(math.ceil(count * holdout), count - 1) if count > 1 else 0
    return sorted(order[held:]), sorted(order[:held])


def evaluate(rounds: Rounds, temperatures) -> dict:
    if not len(rounds):
        return {}
    return {
        "before": metrics(rounds, [1.0] * len(temperatures)),
        "after": metrics(rounds, temperatures),
    }


def format_report(report: dict, temperatures) -> str:
    lines = []
    for name, title in (("fit", "fitted on"), ("held_out", "held out")):
        result = report.get(name)
        if not result:
            continue
        lines.append(
            f"{title}: {report['rounds'][name]} rounds\n"
            "  pos  rounds  accept   T      ECE before/after   "
            "AUROC before/after   Brier before/after"
        )
        for before, after in zip(result["before"], result["after"]):
            k = before["position"]

            def auc(m):
                return "  -  " if m["auroc"] is None else f"{m['auroc']:.3f}"

            lines.append(
                f"  {k:>3}  {before['rounds']:>6}  {before['accept_rate']:6.3f}  "
                f"{temperatures[k - 1]:5.2f}   {before['ece']:.4f} / {after['ece']:.4f}"
                f"    {auc(before)} / {auc(after)}"
                f"      {before['brier']:.4f} / {after['brier']:.4f}"
            )
        means = [
            (weighted_mean(result["before"], key), weighted_mean(result["after"], key))
            for key in ("ece", "brier")
        ]
        lines.append(
            f"  mean ECE {means[0][0]:.4f} -> {means[0][1]:.4f}, "
            f"mean Brier {means[1][0]:.4f} -> {means[1][1]:.4f}"
        )
    return "\n".join(lines)


def require_confidence(drafter) -> None:
    if getattr(getattr(drafter, "model", None), "confidence_head", None) is None:
        raise ValueError(
            f"{drafter!r} has no confidence head; only DSpark drafters have "
            "confidences to calibrate."
        )


def calibrate(
    model, tokenizer, drafter, target_name: str, prompts, args
) -> Calibration:
    """Collect rounds, fit on some prompts, report on all."""
    collected = collect(model, tokenizer, drafter, prompts, args)
    fit_ids, held_ids = split(len(prompts), args.holdout, args.seed)

    def rounds_of(ids):
        history = [r for i in ids for r in collected[i].history]
        return Rounds.from_history(history, drafter.block_size)

    fit_rounds, held_rounds = rounds_of(fit_ids), rounds_of(held_ids)
    if not (fit_rounds.verified > 0).any():
        raise ValueError(
            "No round verified a draft; give more prompts or a larger --max-tokens."
        )
    temperatures = fit_sts(fit_rounds)
    report = {
        "rounds": {"fit": len(fit_rounds), "held_out": len(held_rounds)},
        "fit": evaluate(fit_rounds, temperatures),
        "held_out": evaluate(held_rounds, temperatures),
    }
    return Calibration(
        temperatures=temperatures,
        drafter=drafter.fingerprint,
        target=target_name,
        sampling_temperature=args.temp,
        rounds=len(fit_rounds),
        report=report,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark calibrate",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", required=True, help="the target (path or Hub id)")
    p.add_argument("--draft-model", required=True, help="the DSpark drafter")
    p.add_argument(
        "--prompts",
        required=True,
        type=Path,
        help="a .jsonl file (prompt/text/messages per line) or a text file",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="sampling temperature to calibrate for (acceptance depends on it)",
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--holdout",
        type=float,
        default=0.25,
        help="fraction of prompts held out for the report (default 0.25)",
    )
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument(
        "--out",
        type=Path,
        help="where to write the calibration (default: where loading the "
        "drafter picks it up)",
    )
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be positive, got {args.max_tokens}.")
        if not 0 <= args.holdout < 1:
            raise ValueError(f"--holdout must be in [0, 1), got {args.holdout}.")
        if not 0 <= args.temp < math.inf:
            raise ValueError(f"--temp must be >= 0, got {args.temp}.")
        if not 0 < args.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}.")
        if args.out is not None and args.out.is_dir():
            raise ValueError(f"--out {args.out} is a directory; give a file path.")
        prompts = read_prompts(args.prompts)
        drafter = load_drafter(args.draft_model)
        require_confidence(drafter)
        try:
            model, tokenizer = load(args.model)
        except (OSError, ValueError) as e:
            raise ValueError(f"Cannot load the target {args.model}: {e}") from None
        mx.random.seed(args.seed)
        calibration = calibrate(model, tokenizer, drafter, args.model, prompts, args)
        out = args.out or default_calibration_path(drafter.fingerprint)
        calibration.save(out)
    except (ValueError, OSError) as e:
        print(f"mlx_dspark calibrate: error: {e}", file=sys.stderr)
        return 1
    print(format_report(calibration.report, calibration.temperatures))
    print(f"Calibration written to {out}")
    return 0
