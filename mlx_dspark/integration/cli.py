"""``mlx_lm.generate`` and ``mlx_lm.server`` command lines with hidden-state
drafters: mlx-dspark's own flags, drafter-aware defaults, a check of the
drafter against the target before anything runs, and one-line errors."""

import argparse
import json
import sys
import threading
from typing import Callable, List, Optional, Tuple

from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import _download, load_model

from ..checkpoints import load_drafter, looks_like_drafter
from ..confidence.costs import launch_settings_for_speculation
from ..confidence.schedulers import SCHEDULERS
from ..speculative.engine import checked_target
from ..plugins import drafter_kinds, find_drafter_kind
from ..validation import (
    check_num_draft_tokens,
    check_token_ids,
    parse_logit_bias,
    vocab_size,
)
from .dispatch import StatsSlot, checkpoint_config, drafter_options, local, preloaded
from .hooks import generation_options, server_options

HELP = """\
mlx-dspark (hidden-state speculative drafters, e.g. DeepSeek DSpark/DFlash):
  --draft-model PATH_OR_HUB_ID   may also be a DSpark/DFlash drafter or a
                                 Gemma-4 assistant checkpoint
  --num-draft-tokens N           with such a drafter: drafts verified per round,
                                 default its trained block size (at most that
                                 for DSpark/DFlash, 32 for a Gemma-4 assistant)
  --draft-confidence-threshold T verify drafts only up to the first whose
                                 confidence is below T (DSpark; default 0: none,
                                 the scheduler decides)
  --draft-scheduler {fixed,threshold,cost}
                                 drafts verified per round: all, up to the
                                 threshold (DSpark), or as many as maximise
                                 expected tokens/s on this machine (measured
                                 costs); default cost, but fixed when sampling
                                 (one seed, one text) other than under
                                 mlx_lm.generate without --seed
  --draft-calibration FILE       the confidence calibration to use (DSpark;
                                 default: the one `mlx_dspark calibrate`
                                 saved, if any)
  --draft-kv-view {transformers,clean}
                                 the K/V a Gemma-4 assistant sees (default
                                 transformers': drafts match transformers')
  Set MLX_DSPARK_DISABLE=1 to run mlx-lm unchanged.
"""

SERVER_HELP = """\
  --draft-batch-policy {cost,fixed,off}
                                 mlx_lm.server with a hidden-state drafter
                                 serves concurrent requests in one batch; each
                                 round verifies the drafts that maximise the
                                 batch's tokens/s on this machine (cost, the
                                 default; 0 drafts = plain batched decoding),
                                 all of them (fixed), or serves one request at
                                 a time (off)
"""

PROCESSOR_HELP = """\
  Logits processors (mlx_lm.generate; the server takes them per request):
  --repetition-penalty P, --repetition-context-size N (default 20),
  --presence-penalty P, --frequency-penalty P, --logit-bias '{"id": bias, ...}'
"""

class _Parser(argparse.ArgumentParser):
    """Flag errors as ValueError, so that they end in one ``error:`` line."""

    def error(self, message):
        raise ValueError(message)


def _parser(with_processors: bool) -> argparse.ArgumentParser:
    parser = _Parser(add_help=False)
    parser.add_argument("--draft-confidence-threshold", type=float, default=0.0)
    parser.add_argument("--draft-kv-view", choices=("transformers", "clean"))
    parser.add_argument("--draft-scheduler", choices=SCHEDULERS)
    parser.add_argument("--draft-calibration")
    if not with_processors:  # mlx_lm.server
        parser.add_argument(
            "--draft-batch-policy", choices=("cost", "fixed", "off"), default="cost"
        )
    if with_processors:
        parser.add_argument("--repetition-penalty", type=float)
        parser.add_argument("--repetition-context-size", type=int, default=20)
        parser.add_argument("--presence-penalty", type=float)
        parser.add_argument("--frequency-penalty", type=float)
        parser.add_argument("--logit-bias")
    return parser


def _set_processors(ours: argparse.Namespace) -> None:
    generation_options.clear()
    bias = ours.logit_bias
    if bias is not None:
        try:
            bias = json.loads(bias)
        except json.JSONDecodeError:
            pass  # parse_logit_bias says what it must be
        bias = generation_options["logit_bias"] = parse_logit_bias(bias, "--logit-bias")
    processors = make_logits_processors(
        logit_bias=bias,
        repetition_penalty=ours.repetition_penalty,
        repetition_context_size=ours.repetition_context_size,
        presence_penalty=ours.presence_penalty,
        frequency_penalty=ours.frequency_penalty,
    )
    if processors:
        generation_options["logits_processors"] = processors


def _probe(argv: List[str]) -> argparse.Namespace:
    probe = _Parser(add_help=False)
    probe.add_argument("--model")
    probe.add_argument("--draft-model")
    probe.add_argument("--num-draft-tokens", type=int)
    probe.add_argument("--seed", type=int)
    return probe.parse_known_args(argv)[0]


def prepare(argv: List[str], with_processors: bool = False) -> Tuple[List[str], object]:
    """Take mlx-dspark's flags out of ``argv``, check a hidden-state drafter
    given as ``--draft-model`` (without reading its weights) and default
    ``--num-draft-tokens`` to its block size. Returns the arguments for
    mlx-lm and the drafter (``None`` for no draft model or an ordinary one)."""
    ours, rest = _parser(with_processors).parse_known_args(argv)
    if with_processors:
        _set_processors(ours)
    else:
        server_options["batch_policy"] = ours.draft_batch_policy
    options = {}
    if ours.draft_confidence_threshold:
        options["confidence_threshold"] = ours.draft_confidence_threshold
    if ours.draft_kv_view is not None:
        options["kv_view"] = ours.draft_kv_view
    if ours.draft_scheduler is not None:
        options["scheduler"] = ours.draft_scheduler
    if ours.draft_calibration is not None:
        options["calibration"] = ours.draft_calibration
    args = _probe(rest)
    config = checkpoint_config(args.draft_model) if args.draft_model else None
    if config is not None and looks_like_drafter(config):
        find_drafter_kind(config, args.draft_model)  # says which kinds exist
    if config is None or not any(kind.detect(config) for kind in drafter_kinds()):
        if options:
            raise ValueError(
                f"{', '.join('--draft-' + k.replace('_', '-') for k in options)} "
                "need a hidden-state drafter as --draft-model."
            )
        return rest, None
    drafter = load_drafter(args.draft_model, lazy=True, **options)
    if with_processors and args.seed is None and not (
        ours.draft_scheduler or ours.draft_confidence_threshold
    ):
        # Without --seed, mlx-lm's sampling differs from run to run anyway
        # (MLX seeds its generator from the clock): a sampled generation is
        # paced as a greedy one is, by the default ``cost`` scheduler, which
        # otherwise leaves sampling to ``fixed`` so that one seed gives one
        # text (``CostScheduler.paces_sampling``).
        generation_options["scheduler"] = "cost"
    if args.num_draft_tokens is None:
        rest += ["--num-draft-tokens", str(drafter.block_size)]
    else:
        check_num_draft_tokens(args.num_draft_tokens, drafter, "--num-draft-tokens")
    drafter_options.clear()
    drafter_options.update(options)
    return rest, drafter


def preflight(model_path: str, draft_path: str, drafter) -> None:
    """Check that ``drafter`` fits the target, from the target's config and
    tensor headers (no weights read); keep it for mlx-lm's load."""
    if model_path is None:
        raise ValueError(
            f"A hidden-state drafter ({draft_path}) needs --model, the target it "
            "drafts for."
        )
    target, _ = load_model(_download(model_path), lazy=True)
    checked_target(target, drafter)
    launch_settings_for_speculation(target)
    preloaded[draft_path] = (threading.get_ident(), drafter)


def _fail(prog: str, error: Exception):
    print(f"{prog}: error: {error}", file=sys.stderr)
    sys.exit(1)


def main(
    original: Callable,
    prog: str,
    default_model: Optional[str] = None,
    with_processors: bool = False,
):
    """An mlx-lm ``main`` that understands hidden-state drafters (for a
    command line with one of mlx-dspark's flags or ``--draft-model``)."""
    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        print(HELP + (PROCESSOR_HELP if with_processors else SERVER_HELP))
        return original()
    try:
        argv, drafter = prepare(argv, with_processors)
        if drafter is not None:
            args = _probe(argv)
            preflight(args.model or default_model, args.draft_model, drafter)
    except ValueError as e:
        _fail(prog, e)
    sys.argv = sys.argv[:1] + argv
    try:
        return original()
    except ValueError as e:
        _fail(prog, e)
    finally:
        generation_options.clear()  # the command's alone, not a later call's in this process


def generate(original: Callable, model, tokenizer, prompt, verbose=False, **kwargs):
    """``mlx_lm.generate.generate`` that applies the logits processors the
    command line asked for (their logit bias checked against the model) and,
    when verbose, also prints the speculative statistics."""
    if "logit_bias" in generation_options:
        check_token_ids(generation_options["logit_bias"], vocab_size(model), "--logit-bias")
    if "logits_processors" in generation_options:
        kwargs.setdefault("logits_processors", generation_options["logits_processors"])
    local.slot = StatsSlot()
    try:
        text = original(model, tokenizer, prompt, verbose=verbose, **kwargs)
    finally:
        slot, local.slot = local.slot, None
    if verbose and slot.stats is not None:
        print(f"Speculative: {slot.stats.summary()}")
    return text
