"""The speculative round loop (DeepSpec's decode loop, mlx-lm's step protocol).

prefill (tapped) -> the target's first token -> per round: the drafter
proposes a block after the anchor, the target verifies ``[anchor, drafts]`` in
one forward, the longest agreeing prefix is kept plus the target's own next
token, the target caches roll back to the kept prefix and the drafter takes in
the target's taps of the kept positions. Between rounds the target and drafter
caches both hold every position before the anchor, but for rounds without
drafts (the ``cost`` scheduler's pacing parked): their taps wait for the
drafter's next draft, which takes them in in one call. Such a round is read
only once the next round is chosen, and built where it has none either, so
that the device works on it meanwhile, as mlx-lm's plain decoding overlaps
its steps.

Which drafts are kept depends on the request's sampler (see ``speculative.decoding``).
"""

import sys
import warnings
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from ..cache import rollback_depth
from ..confidence.calibration import survival
from ..confidence.costs import live_timer, verify_rows
from ..confidence.schedulers import FixedScheduler, scheduler_for
from ..plugins import find_target_adapter
from ..targets import multirow
from ..validation import (
    check,
    check_callable,
    check_drafter,
    check_max_tokens,
    check_num_draft_tokens,
    check_processors,
    check_prompt,
)
from .decoding import Decoding
from .pacing import pacing_for
from .stats import Round, SpeculativeStats


# Parked rounds leave their taps for the drafter to take in at once when it
# next drafts, at most this many (what is kept for them stays small).
PARKED_TAPS_AT_MOST = 64


def checked_target(model: nn.Module, drafter):
    """``model``'s target adapter, checked against ``drafter``; reads no
    weights (a lazily loaded target stays unread)."""
    check_drafter(drafter)
    target = find_target_adapter(model).adapt(model)
    drafter.check_target(target)
    return target


def adapt_target(model: nn.Module, drafter):
    """``checked_target``, with a 4-bit target's verify routed to the
    multirow kernel where it is faster (MLX-CUDA; timing it reads the
    weights)."""
    target = checked_target(model, drafter)
    if not multirow.available():
        multirow.unroute(model)
    elif not multirow.considered(model) and any(map(multirow.fits, model.modules())):
        multirow.consider(model)
        failed = multirow.works()
        if failed:
            print(
                f"mlx-dspark: the multirow kernel is not used: {failed}. A 4-bit target "
                "verifies on MLX's own kernels (slower at 2-8 rows on MLX-CUDA).",
                file=sys.stderr,
            )
        elif multirow.route(model) and multirow.choose(model):
            print(
                "mlx-dspark: a 4-bit target verifies by the plugin's multirow kernel on "
                "MLX-CUDA, at the shapes and row counts (2-8) where this machine timed "
                "it faster than MLX's kernels. MLX_DSPARK_MULTIROW=0 turns it off.",
                file=sys.stderr,
            )
    return target


def make_prompt_cache(model: nn.Module, drafter) -> List[Any]:
    """The target's rollback-capable caches followed by the drafter's state."""
    target = adapt_target(model, drafter)
    return target.make_cache(verify_rows(drafter.block_size)) + drafter.make_cache()


def _split_prompt_cache(prompt_cache, target, drafter, num_draft_tokens, rows):
    if prompt_cache is None:
        return target.make_cache(rows), drafter.make_cache()
    num_draft = len(drafter.make_cache())
    target_cache, draft_cache = prompt_cache[:-num_draft], prompt_cache[-num_draft:]
    depths = [rollback_depth(c) for c in target_cache]
    if min(depths, default=1) == 0:
        raise ValueError(
            "This prompt cache cannot roll back rejected drafts (mlx_lm's "
            "make_prompt_cache makes a RotatingKVCache for sliding-window layers, "
            "which cannot once its window has filled); make it with "
            "mlx_dspark.make_prompt_cache(model, drafter)."
        )
    if len(target_cache) != len(target.make_cache(1)):
        raise ValueError(
            "The prompt cache was not made for this target and drafter; make it "
            "with mlx_dspark.make_prompt_cache(model, drafter)."
        )
    shallow = [d for d in depths if d < num_draft_tokens + 1]
    if shallow:
        raise ValueError(
            f"This prompt cache can roll back {min(shallow)} tokens, but verifying "
            f"{num_draft_tokens} drafts needs {num_draft_tokens + 1}; lower "
            "num_draft_tokens or make the cache with "
            "mlx_dspark.make_prompt_cache(model, drafter) for this drafter."
        )
    if target_cache[0].offset != draft_cache[0].offset:
        raise ValueError(
            f"The prompt cache's target part covers {target_cache[0].offset} "
            f"tokens but its drafter part {draft_cache[0].offset}; it was used "
            "outside mlx-dspark. Make a new one with mlx_dspark.make_prompt_cache."
        )
    return target_cache, draft_cache


def _rollback_capacity(target_cache, rows: int) -> int:
    """The most rows a verify may have: what every cache can roll back."""
    return min([rows] + [rollback_depth(c) for c in target_cache])


def _check_options(kv_bits):
    if kv_bits is not None:
        raise ValueError(
            "A quantized KV cache (kv_bits) cannot roll back rejected drafts; "
            "leave kv_bits unset for speculative decoding."
        )


def _check_choice(scheduler, num_verify, num_drafts: int) -> None:
    if (
        not isinstance(num_verify, int)
        or isinstance(num_verify, bool)
        or not 0 <= num_verify <= num_drafts
    ):
        raise ValueError(
            f"The {scheduler.name} scheduler chose to verify {num_verify!r} drafts "
            f"of {num_drafts}; a scheduler must return an int in [0, {num_drafts}]."
        )


def _check_calibrated_for(calibration, rule: str, spec) -> None:
    """Warn when the calibration was fitted at another sampling temperature
    (acceptance, hence calibration, depends on it)."""
    temperature = 0.0 if rule == "greedy" else getattr(spec, "temp", None)
    if temperature is None:
        return
    if abs(temperature - calibration.sampling_temperature) > 0.05:
        warnings.warn(
            f"The drafter's calibration was fitted at temperature "
            f"{calibration.sampling_temperature:g}, this generation samples at "
            f"{temperature:g}; run `mlx_dspark calibrate --temp {temperature:g}` "
            "for schedules that fit.",
            stacklevel=3,
        )


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    drafter,
    stream=generation_stream,
    *,
    num_draft_tokens: Optional[int] = None,
    max_tokens: int = 256,
    sampler: Optional[Callable] = None,
    logits_processors: Optional[list] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stop_tokens: Sequence[int] = (),
    stats: Optional[SpeculativeStats] = None,
    scheduler=None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding with a hidden-state drafter, lossless.

    Yields ``(token, logprobs, from_draft)`` like mlx-lm's
    ``speculative_generate_step``; ``logprobs`` are the target's processed
    log-probabilities at that position, as mlx-lm's ``generate_step`` yields
    them. ``sampler`` and ``logits_processors`` are mlx-lm's; the sampler
    decides the acceptance rule (see the module docstring). ``stop_tokens``
    end a round inside the accepted drafts (so no work is done past them);
    ``stats``, if given, is filled in as rounds complete. ``scheduler``
    (``"fixed"``, ``"threshold"``, ``"cost"`` or a scheduler object, see
    ``mlx_dspark.confidence.schedulers``) decides how many drafts each round
    verifies; by default the one the drafter was loaded with. A ``prompt_cache``
    (see ``make_prompt_cache``) afterwards holds the prompt and every yielded
    token, target and drafter alike, as after mlx-lm's ``generate_step``.
    """
    _check_options(kv_bits)
    check_drafter(drafter)
    if check_max_tokens(max_tokens) == 0:
        return
    block_size = drafter.block_size
    if num_draft_tokens is None:
        num_draft_tokens = block_size
    check_num_draft_tokens(num_draft_tokens, drafter)
    check(prefill_step_size, "prefill_step_size", "integer", 1)
    check_callable(sampler, "sampler")
    check_callable(prompt_progress_callback, "prompt_progress_callback")
    check_processors(logits_processors)
    target = adapt_target(model, drafter)
    prompt = check_prompt(prompt, target.vocab_size)
    decoding = Decoding(sampler, tuple(logits_processors or ()))
    scheduler = scheduler_for(scheduler, drafter)
    if decoding.rule != "greedy" and not getattr(scheduler, "paces_sampling", True):
        scheduler = FixedScheduler()
    # Padded verifies need rows to pad into (and measured costs for them).
    rows = num_draft_tokens + 1
    if scheduler.name == "cost":
        rows = verify_rows(num_draft_tokens)
    target_cache, draft_cache = _split_prompt_cache(
        prompt_cache, target, drafter, num_draft_tokens, rows
    )
    rows = min(rows, _rollback_capacity(target_cache, rows))
    rule, spec = decoding.rule, decoding.spec
    if stats is None:
        stats = SpeculativeStats(drafter.name, block_size)
    stats.acceptance_rule = rule
    stop_tokens = set(stop_tokens)
    taps = drafter.taps
    stats.scheduler = scheduler.name
    calibration = getattr(drafter, "calibration", None)
    temperatures = calibration.temperatures if calibration else None
    if scheduler.name == "cost" and calibration is not None:
        _check_calibrated_for(calibration, rule, spec)
    progress = prompt_progress_callback or (lambda *_: None)

    def forward(tokens):
        """Target forward on new tokens; the drafter takes in their taps only
        once they are final (see ``commit``)."""
        return target(tokens[None], target_cache, taps)

    timer = live_timer(
        model,
        drafter,
        target,
        target_cache,
        draft_cache,
        num_draft_tokens,
        lambda: anchor,
        rows,
        lambda: take_in_parked_taps(),  # defined with the rounds, below
    )
    pacing = pacing_for(scheduler, timer, num_draft_tokens)

    def settle(first_position, yielded_tokens):
        """Leave the caches holding the prompt and every yielded token."""
        keep = first_position + len(yielded_tokens)
        base = keep - 1 if yielded_tokens else keep
        for c in target_cache + draft_cache:
            c.trim(c.offset - base)
        if yielded_tokens:
            out = forward(mx.array(yielded_tokens[-1:], mx.uint32))
            drafter.commit(draft_cache, out.hidden)
        mx.eval([c.state for c in target_cache + draft_cache])

    with mx.stream(stream):
        total, done = prompt.size, 0
        progress(done, total)
        while prompt.size - done > 1:
            n = min(prefill_step_size, prompt.size - done - 1)
            drafter.commit(draft_cache, forward(prompt[done : done + n]).hidden)
            mx.eval([c.state for c in target_cache + draft_cache])
            done += n
            progress(done, total)
            mx.clear_cache()
        out = forward(prompt[done:])
        drafter.commit(draft_cache, out.hidden)
        log_probs = decoding.log_probs(out.logits[0, -1:], prompt)
        anchor = decoding.next_token(log_probs)
        mx.eval(anchor)
        progress(total, total)
        first_position = target_cache[0].offset
        context = mx.concatenate([prompt, anchor])
        yielded = []
        parked_taps = []  # of parked rounds, which the drafter has yet to take in

        def cap(emitted):
            """No drafts past what can still be emitted (the round's own
            target token is one of them)."""
            if max_tokens <= 0:
                return num_draft_tokens
            return min(num_draft_tokens, max_tokens - emitted - 1)

        def plain_round(anchor, context, start):
            """A round without drafts, built and started: its
            log-probabilities and token (unread). It keeps what a round that
            accepted nothing keeps."""
            padding = pacing.rows(1, start) - 1
            out = forward(mx.repeat(anchor.reshape(1), 1 + padding))
            log_probs, _, tokens = decoding.judge(
                mx.array([], mx.uint32), None, out.logits[0, :1], context, num_draft_tokens + 1
            )
            for c in target_cache:
                c.trim(padding)
            mx.async_eval(log_probs, tokens)
            parked_taps.append([h[:, :1] for h in out.hidden])
            if len(parked_taps) == PARKED_TAPS_AT_MOST:
                take_in_parked_taps()
            return log_probs, tokens[:1]

        def ahead(anchor, context, start, emitted):
            """The next round chosen, and built and started if it has no
            drafts, before the round before it is read: the device works on
            it meanwhile, as mlx-lm's plain decoding overlaps its steps
            (its work is wasted if that round's token stops). Returns
            ``(built, chosen)``."""
            num_drafts = pacing.drafts(cap(emitted), start)
            if num_drafts:
                return None, (start, num_drafts)
            return (start, *plain_round(anchor, context, start)), None

        def take_in_parked_taps():
            """The drafter takes in the parked rounds' taps, in one call:
            projecting n positions costs a DSpark drafter about what one
            does. (Each parked round's own intake, left unevaluated until the
            next draft, had a 4-bit 12B DSpark stream parked in every round
            at 0.79x of mlx-lm's plain decoding on an H200.)"""
            if parked_taps:
                hidden = [mx.concatenate(taps, axis=1) for taps in zip(*parked_taps)]
                drafter.commit(draft_cache, hidden, None)
                parked_taps.clear()
                mx.async_eval([c.state for c in draft_cache])

        try:
            # The first round too, before the prompt's token is read, as
            # generate_step starts its second step before yielding its first;
            # but not where choosing it would time verifies first: the
            # prompt's token does not wait for a measurement.
            built = chosen = None
            start = target_cache[0].offset
            if max_tokens != 1 and not pacing.measures(start):
                built, chosen = ahead(anchor, context, start, 1)
            token = anchor.item()
            yielded.append(token)
            yield token, log_probs[0], False
            while token not in stop_tokens and len(yielded) != max_tokens:
                plain = None
                if built is not None:
                    start, plain, num_drafts = built[0], built[1:], 0
                elif chosen is not None:
                    start, num_drafts = chosen
                else:
                    start = target_cache[0].offset
                    num_drafts = pacing.drafts(cap(len(yielded)), start)
                built = chosen = None
                if num_drafts == 0:
                    if plain is None:
                        plain = plain_round(anchor, context, start)
                    log_probs, tokens = plain
                    context = mx.concatenate([context, tokens])
                    if max_tokens <= 0 or len(yielded) + 1 < max_tokens:
                        built, chosen = ahead(tokens, context, start + 1, len(yielded) + 1)
                    token = tokens.item()
                    pacing.update(0, 0)
                    stats.history.append(
                        Round(
                            start=start, anchor=yielded[-1], drafts=[], confidence=None,
                            proposed=0, accepted=0, next_token=token, predicted=None,
                        )
                    )
                    yielded.append(token)
                    yield token, log_probs[0], False
                    anchor = tokens[0]
                    continue
                take_in_parked_taps()
                proposal = drafter.propose(
                    draft_cache,
                    anchor,
                    num_drafts,
                    decoding.draw_for(context),
                    target=target,
                    target_cache=target_cache,
                )
                num_verify = num_drafts
                if scheduler.needs_confidence:
                    logits = proposal.confidence[:num_drafts].tolist()
                    num_verify = scheduler.choose(logits, start, timer)
                    _check_choice(scheduler, num_verify, num_drafts)
                    if num_verify != num_drafts:
                        pacing.verifies(num_verify, start, num_drafts)
                else:
                    # Let the device draft while the host builds the verify.
                    mx.async_eval(proposal.tokens)

                drafts = proposal.tokens[:num_verify]
                padding = pacing.rows(num_verify + 1, start) - num_verify - 1
                rows_in = [anchor.reshape(1), drafts]
                if padding:
                    rows_in.append(mx.repeat(anchor.reshape(1), padding))
                out = forward(mx.concatenate(rows_in))
                log_probs, accepted, tokens = decoding.judge(
                    drafts,
                    proposal.log_probs,
                    out.logits[0, : num_verify + 1],
                    context,
                    num_draft_tokens + 1,
                )
                mx.eval(accepted, tokens, proposal.tokens, proposal.confidence)

                accepted = accepted.item()
                emitted = tokens[: accepted + 1].tolist()
                next_token, verified = emitted[-1], num_verify
                for i, t in enumerate(emitted[:accepted]):
                    if t in stop_tokens:
                        # DeepSpec: the round ends at the stop token, no bonus.
                        accepted = verified = i + 1
                        emitted, next_token = emitted[:accepted], None
                        break

                for c in target_cache:
                    c.trim(num_verify + padding - accepted)
                pacing.update(verified, accepted)
                if next_token is not None and accepted == verified == num_verify < num_drafts:
                    pacing.expect(num_verify, logits)
                drafter.commit(draft_cache, [h[:, : accepted + 1] for h in out.hidden], proposal)
                confidence = predicted = None
                if proposal.confidence is not None:
                    confidence = proposal.confidence.tolist()
                    predicted = sum(survival(confidence[:verified], temperatures))
                stats.history.append(
                    Round(
                        start=start,
                        anchor=token,
                        drafts=proposal.tokens.tolist(),
                        confidence=confidence,
                        proposed=verified,
                        accepted=accepted,
                        next_token=next_token,
                        predicted=predicted,
                    )
                )

                context = mx.concatenate([context, tokens[: len(emitted)]])
                for i, token in enumerate(emitted):
                    yielded.append(token)
                    yield token, log_probs[i], i < accepted
                    if token in stop_tokens or len(yielded) == max_tokens:
                        break
                anchor = tokens[accepted]
        finally:
            pacing.abandon()
            if prompt_cache is not None:
                take_in_parked_taps()
                settle(first_position, yielded)
