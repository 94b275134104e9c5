"""``mlx_dspark doctor``: will speculative decoding pay for this target and
drafter on this machine?

1. The install: mlx-lm in the supported range, the activation on, one
   distribution providing ``mlx_dspark``.
2. The pair, from configs and tensor headers (no weights read).
3. This machine's costs at a context depth: a decode step, a verify of
   1 ... 32 tokens, one round of drafts.
4. For the drafter's measured acceptance (rounds run on ``--prompts``, or
   its calibration report) or a typical one, the expected speedup per
   scheduler and number of drafts, and a verdict. The ``threshold``
   scheduler is estimated by replaying its rule on the rounds run on
   ``--prompts`` (it needs each round's confidences, not only averages).

The estimate is ``τ(k) · T_decode / (T_draft + T_verify(k + 1))`` with
``τ(k) = 1 + Σ_{j<=k} a_j``, ``a_j`` the chance that drafts ``1..j`` all
survive: the speedup of rounds with no overhead beyond a draft and a verify
(BENCHMARKS.md's ``bound_speedup``).
"""

import argparse
import contextlib
import json
import sys
from functools import partial
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .distribution import providers

MAX_VERIFY = 32
# DSpark on chat prompts, Gemma-4-12B, block 7: τ ≈ 3.3 (paper, Table 1).
TYPICAL_TAU, TYPICAL_DRAFTS = 3.3, 7
# Below this expected speedup, speculation is not worth its memory and setup.
WORTH_IT = 1.1
# Confidence thresholds the threshold scheduler is estimated at.
THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


def conditional_for_tau(tau: float, drafts: int) -> float:
    """The per-draft acceptance c with 1 + c + c^2 + ... + c^drafts = tau."""
    low, high = 0.0, 1.0
    for _ in range(60):
        c = (low + high) / 2
        if 1 + sum(c**j for j in range(1, drafts + 1)) < tau:
            low = c
        else:
            high = c
    return (low + high) / 2


def typical_survival(drafts: int, tau: float = TYPICAL_TAU) -> List[float]:
    """``a_j = c^j`` for the c of ``tau`` at ``TYPICAL_DRAFTS`` drafts."""
    c = conditional_for_tau(tau, TYPICAL_DRAFTS)
    return [c**j for j in range(1, drafts + 1)]


def measured_survival(calibration) -> Optional[List[float]]:
    """``a_j`` as the calibration run measured it (every draft verified)."""
    report = (calibration.report or {}).get("fit") or {}
    rates = [p["accept_rate"] for p in report.get("before", [])]
    return rates or None


def history_survival(history, positions: int) -> List[float]:
    """``a_j``: the share of rounds verifying draft ``j`` that accepted
    drafts ``1..j``."""
    survival = []
    for j in range(1, positions + 1):
        verified = [r for r in history if r.proposed >= j]
        survival.append(
            sum(r.accepted >= j for r in verified) / len(verified) if verified else 0.0
        )
    return survival


def threshold_estimates(rounds, costs: dict, thresholds=THRESHOLDS) -> List[dict]:
    """The ``threshold`` scheduler's expected speedup at each threshold,
    replayed on ``rounds`` run with every draft verified: a round verifies
    its drafts up to the first with ``σ(z_k) < t`` and keeps those of them it
    accepted (acceptance is a prefix, so the replay is exact for the rounds
    it has)."""
    import numpy as np

    from .confidence.calibration import sigmoid

    verify = np.asarray(costs["verify"])
    rows = []
    for t in thresholds:
        confident = sigmoid(rounds.logits) >= t
        lead = np.cumprod(confident, axis=1).sum(axis=1)
        verified = np.minimum(lead, rounds.verified)
        tokens = 1 + np.minimum(rounds.accepted, verified)
        seconds = costs["draft"] + verify[verified]
        rows.append(
            {
                "scheduler": "threshold",
                "threshold": t,
                "drafts": round(float(verified.mean()), 2),
                "tau": round(float(tokens.mean()), 3),
                "speedup": round(float(tokens.sum() * verify[0] / seconds.sum()), 3),
            }
        )
    return rows


def round_costs(costs: dict):
    """``costs`` (as ``measure`` gives them) as ``RoundCosts``: a drafter
    that drafts one at a time costs less for fewer drafts."""
    from .confidence.costs import RoundCosts

    return RoundCosts(
        costs["draft"], costs["verify"], costs.get("draft_one"), costs.get("drafts", 1)
    )


def speedup(survival: Sequence[float], drafts: int, costs: dict) -> dict:
    tau = 1 + sum(survival[:drafts])
    seconds = round_costs(costs).drafting(drafts) + costs["verify"][drafts]
    return {
        "drafts": drafts,
        "tau": round(tau, 3),
        "speedup": round(tau * costs["verify"][0] / seconds, 3),
    }


def estimate(
    survival: Sequence[float], costs: dict, drafter: dict
) -> List[dict]:
    """Expected speedup of each way to run the drafter (``drafter`` as
    ``describe_pair`` gives it): ``fixed`` (every draft of the block),
    ``fixed`` with the best ``--num-draft-tokens``, and, for a drafter with
    confidences, ``cost``, which chooses per round and is estimated at the
    number of drafts its rule settles on (``best_drafts``: of the counts
    about as fast as the best, the most). Where its rule would park, the
    row shows what drafting the best count would give (below 1x)."""
    from .batching.policy import best_drafts

    limit = min(len(survival), len(costs["verify"]) - 1, drafter["max_draft_tokens"])
    block_size = min(drafter["block_size"], limit)

    def gain(k):
        return speedup(survival, k, costs)["speedup"]

    best = max(range(1, limit + 1), key=gain)
    rows = [{"scheduler": "fixed", **speedup(survival, block_size, costs)}]
    if best != block_size:
        rows.append({"scheduler": "fixed", **speedup(survival, best, costs)})
    if drafter["confidence"]:
        # Survival to each position's acceptance given the ones before it.
        survived = [1.0, *survival[:limit]]
        rates = [s / p if p else 0.0 for p, s in zip(survived, survived[1:])]
        chosen = best_drafts([rates], [limit], round_costs(costs))
        rows.append({"scheduler": "cost", **speedup(survival, chosen or best, costs)})
    return rows


def verdict(rows: List[dict]) -> dict:
    """The best row (the first of equals: the default, then the fewest
    flags) and a one-line verdict."""
    best = max(rows, key=lambda r: r["speedup"])
    flags = "the default settings"
    if best is not rows[0]:
        flags = f"--num-draft-tokens {best['drafts']}"
    if best["scheduler"] == "cost":
        flags = "--draft-scheduler cost"
    if best["scheduler"] == "threshold":
        flags = f"--draft-scheduler threshold --draft-confidence-threshold {best['threshold']}"
    if best["speedup"] >= WORTH_IT:
        line = (
            f"Speculate: expect about {best['speedup']:.2f}x plain decoding "
            f"with {flags}."
        )
    elif best["speedup"] >= 1:
        line = (
            f"Marginal: at best {best['speedup']:.2f}x plain decoding ({flags}); "
            "plain decoding is about as fast."
        )
    else:
        line = (
            f"Do not speculate here: at best {best['speedup']:.2f}x, plain "
            "decoding is faster on this machine."
        )
    return {"speculate": best["speedup"] >= WORTH_IT, "best": best, "line": line}


def check_install() -> dict:
    import mlx_lm

    from .activation import PostImportHook, disabled
    from .integration import mlx_lm_version_supported
    from .plugins import drafter_kinds

    generate = sys.modules.get("mlx_lm.generate")
    result = {
        "mlx_lm": mlx_lm.__version__,
        "mlx_lm_supported": mlx_lm_version_supported(mlx_lm.__version__),
        "activation": any(isinstance(f, PostImportHook) for f in sys.meta_path),
        "disabled": disabled(),
        "patched": getattr(generate, "_mlx_dspark_originals", None) is not None,
        "distributions": providers(),
        "drafter_kinds": [k.name for k in drafter_kinds()],
    }
    problems = []
    if not result["mlx_lm_supported"]:
        problems.append(
            f"mlx-lm {mlx_lm.__version__} is outside the supported range "
            ">=0.32,<0.33: pip install 'mlx-lm>=0.32,<0.33'"
        )
    if result["disabled"]:
        problems.append("MLX_DSPARK_DISABLE is set: mlx_lm's commands run unchanged")
    elif not (result["activation"] and result["patched"]):
        problems.append(
            "the activation is off (mlx_dspark.pth did not run): reinstall with "
            "pip, or use `mlx_dspark generate|server`"
        )
    if len(result["distributions"]) > 1:
        problems.append(
            "several installed distributions provide the mlx_dspark package ("
            + ", ".join(result["distributions"])
            + "): uninstall all but one"
        )
    result["problems"] = problems
    return result


def load_pair(model_path: str, draft_path: str, calibration: Optional[str]):
    """The target and drafter, checked against each other with their weights
    unread."""
    from mlx_lm import load

    from .checkpoints import load_drafter
    from .speculative.engine import adapt_target

    options = {} if calibration is None else {"calibration": Path(calibration)}
    drafter = load_drafter(draft_path, lazy=True, **options)
    try:
        model, tokenizer = load(model_path, lazy=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot load the target {model_path}: {e}") from None
    target = adapt_target(model, drafter)
    return model, tokenizer, drafter, target


def precision(fingerprint: dict) -> str:
    if fingerprint["quantization"]:
        return ", ".join(
            f"{bits}-bit (group {group}, {mode})"
            for bits, group, mode in fingerprint["quantization"]
        )
    return "/".join(d.replace("mlx.core.", "") for d in fingerprint["dtypes"])


def describe_pair(model, drafter, target) -> dict:
    from .confidence.costs import model_fingerprint
    from .targets.multirow import routed_count

    network = getattr(drafter, "model", None)
    return {
        "target": {
            "model_type": target.model_type,
            "layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "precision": precision(model_fingerprint(model)),
            # Modules whose 2-8 verify rows the multirow kernel computes (MLX-CUDA, 4-bit).
            "multirow": routed_count(model),
        },
        "drafter": {
            "kind": drafter.name,
            "block_size": drafter.block_size,
            "max_draft_tokens": drafter.max_draft_tokens,
            "precision": precision(model_fingerprint(network)) if network else None,
            "confidence": getattr(network, "confidence_head", None) is not None,
            "calibration": getattr(drafter, "calibration", None) is not None,
        },
    }


def measure(model, drafter, target, depth: int, verify: int):
    """Costs of a decode step, verifies of 1..``verify`` tokens and one round
    of drafts, on caches holding ``depth`` tokens of context; and a function
    that times the round of drafts of another drafter (a quantized copy) on
    the same context."""
    import mlx.core as mx

    from .confidence.costs import REPEATS, fastest_seconds, live_timer
    from .progress import progress

    target_cache = target.make_cache(verify)
    draft_cache = drafter.make_cache()
    prompt = mx.random.randint(0, target.vocab_size, (depth,), key=mx.random.key(0))
    taps = []
    for start in range(0, depth, 512):
        out = target(prompt[None, start : start + 512], target_cache, drafter.taps)
        drafter.commit(draft_cache, out.hidden)
        mx.eval([c.state for c in target_cache + draft_cache], out.hidden)
        taps.append(out.hidden)
    anchor = prompt[-1:]
    timer = live_timer(
        model,
        drafter,
        target,
        target_cache,
        draft_cache,
        drafter.block_size,
        lambda: anchor,
    )
    drafts = min(drafter.block_size, 2)  # proposals timed: of the block and of one
    bar = progress(total=REPEATS * (verify + drafts), desc="measuring", unit="timing")
    costs = timer(range(1, verify + 1), tick=bar.update)
    bar.close()

    def draft_seconds(other) -> Tuple[float, float]:
        """Seconds for ``other``'s proposal of a block, and of one draft."""
        cache = other.make_cache()
        for hidden in taps:
            other.commit(cache, hidden)
        mx.eval([c.state for c in cache])

        def draft(count):
            proposal = other.propose(
                cache, anchor, count, target=target, target_cache=target_cache
            )
            return proposal.tokens, proposal.confidence

        block, one = fastest_seconds(partial(draft, other.block_size), partial(draft, 1))
        return block, one

    return {
        "device": mx.device_info().get("device_name", str(mx.default_device())),
        "depth": depth,
        "decode": costs.verify[0],
        "draft": costs.draft,
        "draft_one": costs.draft_one,
        "drafts": costs.drafts,
        "verify": costs.verify,
    }, draft_seconds


def is_float(drafter) -> bool:
    from .confidence.costs import model_fingerprint

    network = getattr(drafter, "model", None)
    return network is not None and not model_fingerprint(network)["quantization"]


def quantized_copy(draft_path: str, bits: int):
    """The drafter at ``draft_path`` quantized in memory as ``mlx_dspark
    convert --q-bits`` writes it (the confidence head stays float)."""
    from mlx_lm.utils import quantize_model

    from .checkpoints import load_drafter, read_config, resolve_checkpoint
    from .convert import FLOAT_HEAD

    drafter = load_drafter(draft_path, lazy=True)
    config = read_config(resolve_checkpoint(draft_path, None))
    # mlx-lm reports the bits per weight on stdout, which --json keeps for JSON.
    with contextlib.redirect_stdout(sys.stderr):
        quantize_model(
            drafter.model,
            config,
            64,
            bits,
            quant_predicate=lambda path, module: FLOAT_HEAD not in path,
        )
    return drafter


def precisions(draft_path: str, drafter, draft_seconds, survival, costs) -> List[dict]:
    """For a float drafter, the expected speedup at each drafts count's best
    with the drafter quantized to 8 and 4 bits: its measured draft cost, and
    acceptance assumed unchanged (quantizing changes the drafter's cost more
    than its acceptance; ``examples/quantize_drafter.py`` measures both)."""
    rows = []
    limit = min(len(survival), len(costs["verify"]) - 1, drafter.max_draft_tokens)
    for bits in (8, 4):
        seconds, one = draft_seconds(quantized_copy(draft_path, bits))
        at = {**costs, "draft": seconds, "draft_one": one}
        best = max(
            (speedup(survival, k, at) for k in range(1, limit + 1)),
            key=lambda row: row["speedup"],
        )
        rows.append(
            {"precision": f"{bits}-bit", "draft": seconds, "draft_one": one, **best}
        )
    return rows


def read_costs(path: str) -> dict:
    """Costs as ``measure`` gives them (``draft`` and ``verify`` seconds at
    least), from a JSON file."""
    try:
        costs = json.loads(Path(path).read_text())
        seconds = [costs["draft"], *costs["verify"]]
        if "draft_one" in costs:
            seconds.append(costs["draft_one"])
        if len(seconds) < 3 or not all(
            isinstance(c, (int, float)) and c > 0 for c in seconds
        ):
            raise ValueError("costs must be positive")
        drafts = costs.get("drafts", 1)
        if not isinstance(drafts, int) or drafts < 1:
            raise ValueError("drafts must be a positive integer")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} needs positive seconds: "
            '{"draft": s, "verify": [s for 1 token, 2 tokens, ...]}, and may have '
            '"draft_one": s and "drafts": n (a draft of one, of n) '
            f"({type(e).__name__}: {e})"
        ) from None
    return {"decode": costs["verify"][0], **costs}


def run_prompts(model, tokenizer, drafter, path: Path, max_tokens: int):
    """Rounds of greedy generations on the prompts at ``path``, every draft
    verified (as ``mlx_dspark calibrate`` collects them)."""
    from .confidence.calibrate import collect, read_prompts
    from .confidence.calibration import Rounds

    options = argparse.Namespace(
        temp=0.0, top_p=1.0, max_tokens=max_tokens, ignore_chat_template=False
    )
    collected = collect(model, tokenizer, drafter, read_prompts(path), options)
    history = [r for stats in collected for r in stats.history]
    return Rounds.from_history(history, drafter.block_size), history


def diagnose(args) -> dict:
    from .confidence.costs import launch_settings_for_speculation

    report = {"install": check_install()}
    try:
        model, tokenizer, drafter, target = load_pair(
            args.model, args.draft_model, args.draft_calibration
        )
    except (ValueError, OSError, RuntimeError) as e:
        report["pair"] = {"ok": False, "problem": str(e)}
        return report
    report["pair"] = {"ok": True, **describe_pair(model, drafter, target)}
    # Rounds timed as mlx-lm's commands would run them with this drafter.
    launch_settings_for_speculation(model)
    draft_seconds = None
    if args.costs is not None:
        costs = read_costs(args.costs)
    else:
        costs, draft_seconds = measure(model, drafter, target, args.depth, MAX_VERIFY)
    report["costs"] = costs

    rounds = None
    if args.prompts is not None:
        rounds, history = run_prompts(model, tokenizer, drafter, args.prompts, args.max_tokens)
        if not history:
            raise ValueError(f"No round ran on {args.prompts}; give longer --max-tokens.")
    calibration = getattr(drafter, "calibration", None)
    if rounds is not None and args.tau is None:
        source = f"measured on {args.prompts}"
        survival = history_survival(history, drafter.max_draft_tokens)
    else:
        survival = measured_survival(calibration) if calibration else None
        source = "calibration"
    if survival is None or args.tau is not None:
        source = "typical" if args.tau is None else "--tau"
        survival = typical_survival(drafter.max_draft_tokens, args.tau or TYPICAL_TAU)
    report["acceptance"] = {"source": source, "survival": survival}
    rows = estimate(survival, costs, report["pair"]["drafter"])
    if rounds is not None and len(rounds):
        rows += threshold_estimates(rounds, costs)
    report["schedulers"] = rows
    report["verdict"] = verdict(rows)
    if draft_seconds is not None and args.precisions and is_float(drafter):
        report["precisions"] = precisions(
            args.draft_model, drafter, draft_seconds, survival, costs
        )
    return report


def format_report(report: dict) -> str:
    install = report["install"]
    lines = [
        f"install: mlx-lm {install['mlx_lm']}, activation "
        f"{'on' if install['activation'] and install['patched'] else 'off'}, "
        f"provided by {', '.join(install['distributions']) or '?'}, "
        f"drafter kinds {', '.join(install['drafter_kinds'])}",
        *(f"  problem: {p}" for p in install["problems"]),
    ]
    pair = report["pair"]
    if not pair["ok"]:
        lines.append(f"pair: {pair['problem']}")
        return "\n".join(lines)
    t, d = pair["target"], pair["drafter"]
    lines.append(
        f"pair: {t['model_type']} target ({t['layers']} layers, {t['precision']}"
        + (f", verified by the multirow kernel in {t['multirow']} modules" if t["multirow"] else "")
        + ") "
        f"and {d['kind']} drafter (block {d['block_size']}, up to "
        f"{d['max_draft_tokens']} drafts, {d['precision']}) fit"
    )
    costs = report["costs"]
    verify = costs["verify"]
    curve = " ".join(
        f"{k}:{verify[k - 1] / verify[0]:.2f}"
        for k in (1, 2, 4, 8, 16, 32)
        if k <= len(verify)
    )
    lines.append(
        f"costs at depth {costs.get('depth', '?')} on {costs.get('device', '?')}: "
        f"decode {costs['decode'] * 1e3:.2f} ms, draft {costs['draft'] * 1e3:.2f} ms, "
        f"verify of k tokens / decode: {curve}"
    )
    acceptance = report["acceptance"]
    lines.append(
        f"acceptance ({acceptance['source']}): drafts survive "
        + " ".join(f"{a:.2f}" for a in acceptance["survival"][:8])
        + (" ..." if len(acceptance["survival"]) > 8 else "")
    )
    for row in report["schedulers"]:
        name = row["scheduler"]
        if name == "threshold":
            name = f"threshold {row['threshold']}"
        lines.append(
            f"  {name:<13} {row['drafts']:>4} drafts: tau {row['tau']:.2f}, "
            f"expected {row['speedup']:.2f}x"
        )
    for row in report.get("precisions", []):
        lines.append(
            f"  drafter {row['precision']:<6} draft {row['draft'] * 1e3:.2f} ms: "
            f"expected {row['speedup']:.2f}x with {row['drafts']} drafts "
            "(acceptance assumed unchanged)"
        )
    lines.append(report["verdict"]["line"])
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark doctor",
        description="Check the install and a target/drafter pair, measure this "
        "machine's round costs and say whether speculative decoding pays.",
    )
    p.add_argument("--model", required=True, help="the target (path or Hub id)")
    p.add_argument("--draft-model", required=True, help="the drafter (path or Hub id)")
    p.add_argument(
        "--draft-calibration",
        help="a calibration file from `mlx_dspark calibrate` (default: the "
        "drafter's own, if calibrated)",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=512,
        help="context depth to measure the costs at (default 512)",
    )
    p.add_argument(
        "--tau",
        type=float,
        help=f"assume this mean accepted length for {TYPICAL_DRAFTS} drafts "
        f"instead of the measured one (default without a calibration: "
        f"{TYPICAL_TAU}, DSpark on chat)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        help="run the pair on these prompts (.jsonl with prompt/text/messages, "
        "or a text file) to measure its acceptance, and estimate the threshold "
        "scheduler from the rounds' confidences",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="tokens to generate per prompt with --prompts (default 128)",
    )
    p.add_argument(
        "--precisions",
        action="store_true",
        help="also time the drafter quantized to 8 and 4 bits (in memory) and "
        "estimate the speedup with each",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    # Costs from a file instead of measuring them (tests, what-if questions).
    p.add_argument("--costs", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    problem = None
    if args.depth < 1:
        problem = "--depth must be positive"
    elif args.max_tokens < 1:
        problem = "--max-tokens must be positive"
    elif args.tau is not None and not 1 <= args.tau <= TYPICAL_DRAFTS + 1:
        problem = f"--tau must be in [1, {TYPICAL_DRAFTS + 1}]"
    if problem is None:
        try:
            report = diagnose(args)
        except ValueError as e:
            problem = str(e)
    if problem:
        print(f"mlx_dspark doctor: error: {problem}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    ok = report["pair"]["ok"] and not report["install"]["problems"]
    return 0 if ok else 1
