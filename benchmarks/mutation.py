"""Mutation testing before a release: a curated list of plausible bugs, each
put into a copy of the tree on its own, and the tests that should catch it
run there with a timeout. A mutant is killed when those tests fail.

    python benchmarks/mutation.py [--only NAME ...] [--report PATH]

Writes a markdown report (default ``benchmarks/results/mutation.md``) with
the score and, for every survivor, why it is not a bug worth a test (or the
test to write). Every mutant's text must occur exactly once in its file, so a
refactoring that moves the code makes the list fail loudly, not pass.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "benchmarks" / "results" / "mutation.md"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: Tuple[str, ...]
    # Why the mutant may survive without a missing test (None: it must die).
    equivalent: Optional[str] = None


SPEC = "mlx_dspark/speculative/"
MUTANTS = [
    # The six the first round of mutation testing found uncaught (issue 15).
    Mutant(
        "residual from position 0's proposal",
        SPEC + "acceptance.py",
        "residual(p[:n], q)",
        "residual(p[:n], q[:1])",
        ("tests/test_sampling.py", "-k", "residual or every_offset"),
    ),
    Mutant(
        "threshold compared with >",
        "mlx_dspark/confidence/schedulers.py",
        "sigmoid(logits) >= self.threshold",
        "sigmoid(logits) > self.threshold",
        ("tests/test_confidence.py", "-k", "threshold"),
    ),
    Mutant(
        "STS temperatures shifted by one position (survival)",
        "mlx_dspark/confidence/calibration.py",
        "z = z / np.asarray(temperatures[: len(z)])",
        "z = z / np.roll(np.asarray(temperatures[: len(z)]), 1)",
        ("tests/test_confidence.py", "-k", "temperature"),
    ),
    Mutant(
        "STS temperatures shifted by one position (fit)",
        "mlx_dspark/confidence/calibration.py",
        "prefix = prefix * sigmoid(rounds.logits[:, k] / temperatures[k])",
        "prefix = prefix * sigmoid(rounds.logits[:, k] / temperatures[k - 1])",
        ("tests/test_confidence.py", "-k", "temperature or sts"),
    ),
    Mutant(
        "drafts one past the token budget",
        SPEC + "engine.py",
        "return min(num_draft_tokens, max_tokens - emitted - 1)",
        "return min(num_draft_tokens, max_tokens - emitted)",
        ("tests/test_lossless.py", "-k", "budget"),
    ),
    Mutant(
        "clean K/V view one position too many",
        "mlx_dspark/drafters/gemma4_assistant.py",
        "return anchor, most(0, anchor - window + 1), anchor",
        "return anchor, most(0, anchor - window), anchor",
        ("tests/test_assistant.py", "-k", "clean"),
    ),
    Mutant(
        "prompt cache never settled with an ordinary draft model",
        "mlx_dspark/integration/dispatch.py",
        "        _settle(model, target_cache, history, start)\n"
        "        _settle(draft_model, draft_cache, history, start)\n",
        "        pass\n",
        ("tests/test_integration.py", "-k", "settled"),
    ),
    # The three caught only by chance or by one unrelated test.
    Mutant(
        "logits processors ignored at verified rows",
        SPEC + "decoding.py",
        "self.log_probs(logits[k : k + 1], verified[: context.size + k])",
        "log_softmax(logits[k : k + 1])",
        ("tests/test_sampling.py", "-k", "every_offset and biased"),
    ),
    Mutant(
        "bonus token dropped when every draft is accepted",
        SPEC + "engine.py",
        "emitted = tokens[: accepted + 1].tolist()",
        "emitted = tokens[: accepted + (accepted < num_verify or not num_verify)]"
        ".tolist()",
        ("tests/test_lossless.py", "-k", "budget"),
    ),
    Mutant(
        "server hands back a longer cached context untrimmed",
        "mlx_dspark/integration/server.py",
        "                c.trim(drop)\n",
        "                pass\n",
        ("tests/test_integration.py", "-k", "trims_a_longer"),
    ),
    # Acceptance rules.
    Mutant(
        "acceptance at u * q == p",
        SPEC + "acceptance.py",
        "accept = u[:n] * q_x < p_x",
        "accept = u[:n] * q_x <= p_x",
        ("tests/test_sampling.py", "-k", "accepted or residual or emitted"),
    ),
    Mutant(
        "greedy acceptance counts matches after a mismatch",
        SPEC + "acceptance.py",
        "return mx.cumprod(matches.astype(mx.int32), axis=-1).sum(axis=-1)",
        "return matches.astype(mx.int32).sum(axis=-1)",
        ("tests/test_lossless.py", "-k", "any_draft"),
    ),
    Mutant(
        "inverse CDF off by one at the boundary",
        SPEC + "acceptance.py",
        "index = (cdf <= u * cdf[..., -1:]).sum(axis=-1)",
        "index = (cdf < u * cdf[..., -1:]).sum(axis=-1)",
        ("tests/test_sampling.py", "-k", "inverse_cdf or emitted or residual"),
    ),
    Mutant(
        "residual falls back to q instead of p",
        SPEC + "acceptance.py",
        "return mx.where(mass > 1e-8, r / mx.maximum(mass, 1e-30), p)",
        "return mx.where(mass > 1e-8, r / mx.maximum(mass, 1e-30), q)",
        ("tests/test_sampling.py", "-k", "residual or accepted or emitted"),
        equivalent="the fallback is taken only where p <= q everywhere, that is "
        "p == q up to rounding, so q is p there; and a draft from q == p is always "
        "accepted, so no residual is drawn at all.",
    ),
    # Per-sequence decoding.
    Mutant(
        "drafter's processors do not see the drafts so far",
        SPEC + "decoding.py",
        "history = mx.concatenate([context, *drafted]) if self.processors else None",
        "history = context if self.processors else None",
        ("tests/test_sampling.py", "-k", "drafts_so_far or every_offset and biased"),
    ),
    Mutant(
        "verify processors see the token they score",
        SPEC + "decoding.py",
        "verified[: context.size + k])",
        "verified[: context.size + k + 1])",
        ("tests/test_sampling.py", "-k", "logprobs or greedy_with or every_offset"),
    ),
    # The single-stream engine.
    Mutant(
        "stop token in the last accepted draft missed",
        SPEC + "engine.py",
        "for i, t in enumerate(emitted[:accepted]):",
        "for i, t in enumerate(emitted[: accepted - 1]):",
        ("tests/test_lossless.py", "tests/test_sampling.py", "-k", "stop_token"),
    ),
    Mutant(
        "stop tokens among accepted drafts ignored",
        SPEC + "engine.py",
        "if t in stop_tokens:",
        "if False:",
        ("tests/test_lossless.py", "tests/test_sampling.py", "-k", "stop_token"),
    ),
    Mutant(
        "stream_generate ignores a stop token at the first token",
        "mlx_dspark/generation.py",
        "            if token in tokenizer.eos_token_ids:\n                break",
        "            if token in tokenizer.eos_token_ids and n:\n                break",
        ("tests/test_sampling.py", "-k", "sampled_stop"),
    ),
    Mutant(
        "target cache keeps one rejected draft",
        SPEC + "engine.py",
        "c.trim(num_verify + padding - accepted)",
        "c.trim(max(num_verify + padding - accepted - 1, 0))",
        ("tests/test_lossless.py", "-k", "any_draft"),
    ),
    Mutant(
        "drafter takes in one tap too many",
        SPEC + "engine.py",
        "[h[:, : accepted + 1] for h in out.hidden]",
        "[h[:, : accepted + 2] for h in out.hidden]",
        ("tests/test_oracle_deepspec.py", "-k", "every_round"),
    ),
    Mutant(
        "settled prompt cache one token long",
        SPEC + "engine.py",
        "base = keep - 1 if yielded_tokens else keep",
        "base = keep",
        ("tests/test_lossless.py", "-k", "prompt_cache"),
    ),
    # The batched generator and its cache.
    Mutant(
        "batch drafts one past the token budget",
        "mlx_dspark/batching/generator.py",
        "min(s.num_draft_tokens, s.remaining - 1)",
        "min(s.num_draft_tokens, s.remaining)",
        ("tests/test_batching.py", "-k", "alone"),
    ),
    Mutant(
        "batch rows roll back one token short",
        "mlx_dspark/batching/generator.py",
        "rejected = k - accepted",
        "rejected = mx.maximum(k - accepted - 1, 0)",
        ("tests/test_batching.py", "-k", "greedy or roll_back"),
    ),
    Mutant(
        "batch statistics count drafts after a stop",
        "mlx_dspark/batching/generator.py",
        "kept = min(accepted[b], len(emitted))",
        "kept = accepted[b]",
        ("tests/test_batching.py", "-k", "alone or sampled_stop"),
    ),
    Mutant(
        "batch stop among accepted drafts does not end the row's round",
        "mlx_dspark/batching/generator.py",
        "                if reason:\n                    break\n",
        "",
        ("tests/test_batching.py", "-k", "sampled_stop"),
    ),
    Mutant(
        "batch stop tokens among accepted drafts ignored",
        "mlx_dspark/batching/generator.py",
        "reason = self._finish_reason(s, t)\n",
        "reason = self._finish_reason(s, t) if len(emitted) > accepted[b] else None\n",
        ("tests/test_batching.py", "-k", "sampled_stop"),
    ),
    Mutant(
        "batch stop token in the last accepted draft missed",
        "mlx_dspark/batching/generator.py",
        "reason = self._finish_reason(s, t)\n",
        "reason = self._finish_reason(s, t) if len(emitted) != accepted[b] else None\n",
        ("tests/test_batching.py", "-k", "sampled_stop"),
    ),
    Mutant(
        "batch rejection row judged with the next row's drafter distribution",
        "mlx_dspark/batching/generator.py",
        "draft_log_probs = proposal.log_probs[b] if",
        "draft_log_probs = proposal.log_probs[(b + 1) % len(sequences)] if",
        ("tests/test_batching.py", "-k", "every_offset"),
    ),
    Mutant(
        "batch rejection row judged with its first draft's distribution everywhere",
        "mlx_dspark/batching/generator.py",
        "draft_log_probs = proposal.log_probs[b] if",
        "draft_log_probs = mx.broadcast_to(proposal.log_probs[b, :1], "
        "proposal.log_probs[b].shape) if",
        ("tests/test_batching.py", "-k", "every_offset"),
    ),
    Mutant(
        "batch processors' history misses the anchor",
        "mlx_dspark/batching/generator.py",
        "return mx.array(self.tokens + [self.anchor], mx.uint32)",
        "return mx.array(self.tokens, mx.uint32)",
        ("tests/test_batching.py", "-k", "own_history"),
    ),
    Mutant(
        "pipelined round built from the host's anchors of the round before",
        "mlx_dspark/batching/generator.py",
        "ahead = self._launch(self._in_flight.anchors)",
        "ahead = self._launch(self._anchors())",
        ("tests/test_batching.py", "-k", "pipelined or greedy"),
    ),
    Mutant(
        "pipelined round reuses slots the round before still holds",
        "mlx_dspark/batching/generator.py",
        "rows.settle([k - a for a in accepted], reuse)",
        "rows.settle([k - a for a in accepted], True)",
        ("tests/test_batching.py", "-k", "pipelined or greedy"),
    ),
    Mutant(
        "finished row's cache handed back with what was written after it",
        "mlx_dspark/batching/cache.py",
        "mx.where(live < end, live, -1)",
        "mx.where(live >= 0, live, -1)",
        ("tests/test_batching.py", "-k", "mid_pipeline or continues"),
    ),
    Mutant(
        "parked rounds' taps missing from a finished row's drafter cache",
        "mlx_dspark/batching/generator.py",
        "self._commit_parked()  # its caches are handed back",
        "pass",
        ("tests/test_batching.py", "-k", "greedy"),
    ),
    Mutant(
        "batch policy ignores the realised round times",
        "mlx_dspark/batching/policy.py",
        "costs = self.realised(measured, batch)",
        "costs = measured",
        ("tests/test_batching.py", "-k", "policy"),
    ),
    Mutant(
        "batch policy takes the (upper) median of recent rounds' overheads",
        "mlx_dspark/batching/policy.py",
        "self.overheads[kind] = min(self._recent[kind])",
        "self.overheads[kind] = sorted(self._recent[kind])[len(self._recent[kind]) // 2]",
        ("tests/test_batching.py", "-k", "probe_as_fast"),
    ),
    Mutant(
        "batch policy borrows each kind's overhead from its own nearest batch size",
        "mlx_dspark/batching/policy.py",
        "        if paired is not None:",
        "        if paired == batch:",
        ("tests/test_batching.py", "-k", "takes_both"),
    ),
    Mutant(
        "batch policy drafts the fastest count on paper, whatever the noise",
        "mlx_dspark/batching/policy.py",
        "NEAR_BEST = 0.03",
        "NEAR_BEST = 0.0",
        ("tests/test_batching.py", "-k", "about_as_fast"),
    ),
    Mutant(
        "batch policy drafts when plain decoding is about as fast",
        "mlx_dspark/batching/policy.py",
        "if k and speed > speeds[0] and speed >= near]",
        "if k and speed >= near]",
        ("tests/test_batching.py", "-k", "about_as_fast"),
    ),
    Mutant(
        "a round never pads past the drafts its rows judge",
        "mlx_dspark/batching/generator.py",
        "        if not drafts or width is None:",
        "        if True:",
        ("tests/test_batching.py", "-k", "padded_rounds"),
    ),
    Mutant(
        "padded rows are judged as drafts",
        "mlx_dspark/batching/generator.py",
        "        return [0 if s.finished else min(k, next(caps)) for s in rows.sequences]",
        "        return [0 if s.finished else self._width(rows, k) for s in rows.sequences]",
        ("tests/test_batching.py", "-k", "padded_rounds"),
    ),
    Mutant(
        "a padded round is observed against the drafts judged",
        "mlx_dspark/batching/policy.py",
        "            self._chosen[-1] = (batch, drafts, True, seconds)",
        "            pass",
        ("tests/test_batching.py", "-k", "cost_of_its_width"),
    ),
    Mutant(
        "a round pads to the cheapest width only",
        "mlx_dspark/batching/policy.py",
        "    near = [w for w in widths if seconds[w] <= cheapest * (1 + NEAR_BEST)]\n"
        "    return keep if switch and keep in near else max(near)",
        "    near = [w for w in widths if seconds[w] <= cheapest]\n"
        "    return keep if switch and keep in near else min(near)",
        ("tests/test_batching.py", "-k", "about_the_same"),
    ),
    Mutant(
        "a probe lasts one round",
        "mlx_dspark/batching/policy.py",
        "PROBE_ROUNDS = 2",
        "PROBE_ROUNDS = 1",
        ("tests/test_batching.py", "-k", "probes_second_round"),
    ),
    Mutant(
        "the round after costs were measured is observed",
        "mlx_dspark/batching/generator.py",
        "after_measuring, self._measured = self._measured, False",
        "after_measuring, self._measured = False, False",
        ("tests/test_batching.py", "-k", "after_costs_were_measured"),
    ),
    Mutant(
        "a round pads up to the drafter's most drafts, not its rows'",
        "mlx_dspark/batching/generator.py",
        "            most = max(s.num_draft_tokens for s in rows.sequences if not s.finished)",
        "            most = self.drafter.max_draft_tokens",
        ("tests/test_batching.py", "-k", "padded_rounds"),
    ),
    Mutant(
        "a policy that times no rounds probes plain rounds",
        "mlx_dspark/batching/policy.py",
        "        if not self._observed or (batch, drafted) in self.overheads:",
        "        if (batch, drafted) in self.overheads:",
        ("tests/test_pacing.py", "-k", "jagged"),
    ),
    Mutant(
        "a probe of a kind never timed lasts as long as any probe",
        "mlx_dspark/batching/policy.py",
        "LEARNING_ROUNDS = 2 * (WARM_ROUNDS + 1)",
        "LEARNING_ROUNDS = PROBE_ROUNDS",
        ("tests/test_batching.py", "-k", "from_one_probe"),
    ),
    Mutant(
        "a probe of a kind never timed lasts until one is, however long",
        "mlx_dspark/batching/policy.py",
        "LEARNING_ROUNDS = 2 * (WARM_ROUNDS + 1)",
        "LEARNING_ROUNDS = REPROBE_EVERY",
        ("tests/test_batching.py", "-k", "times_nothing"),
    ),
    Mutant(
        "a batch size that timed one kind never probes the other",
        "mlx_dspark/batching/policy.py",
        "        return self._overhead(batch, drafted) is None or (batch, not drafted) in self.overheads",
        "        return self._overhead(batch, drafted) is None",
        ("tests/test_batching.py", "-k", "only_drafted"),
    ),
    Mutant(
        "a round faster than its forwards takes its shortfall off the costs",
        "mlx_dspark/batching/policy.py",
        "        excess = max(0.0 if drafted else -predicted / 2, seconds - predicted)",
        "        excess = seconds - predicted",
        ("tests/test_batching.py", "-k", "faster_than"),
    ),
    Mutant(
        "a pipelined plain round's shortfall is no overhead",
        "mlx_dspark/batching/policy.py",
        "        excess = max(0.0 if drafted else -predicted / 2, seconds - predicted)",
        "        excess = max(0.0, seconds - predicted)",
        ("tests/test_batching.py", "-k", "pipelined_plain_rounds"),
    ),
    Mutant(
        "a plain round's shortfall learnt elsewhere may exceed half of one here",
        "mlx_dspark/batching/policy.py",
        "        plain = max(plain, -costs.verify[0] / 2)\n",
        "",
        ("tests/test_batching.py", "-k", "shortfall_learnt_elsewhere"),
    ),
    Mutant(
        "a probe's interval is re-weighed within the probe",
        "mlx_dspark/batching/policy.py",
        "                if not _probing(self.parked, length, self._reprobe):",
        "                if True:",
        ("tests/test_batching.py", "-k", "whatever_its_first_round"),
    ),
    Mutant(
        "a parked policy probes every 16 rounds whatever its probes lose",
        "mlx_dspark/batching/policy.py",
        "    while every < REPROBE_AT_MOST and length * loss > PROBE_SHARE * every * plain:",
        "    while False:",
        ("tests/test_pacing.py", "-k", "jagged"),
    ),
    Mutant(
        "a probe's loss is weighed for one of its rounds",
        "mlx_dspark/batching/policy.py",
        "    while every < REPROBE_AT_MOST and length * loss > PROBE_SHARE * every * plain:",
        "    while every < REPROBE_AT_MOST and loss > PROBE_SHARE * every * plain:",
        ("tests/test_batching.py", "-k", "lose_at_most"),
    ),
    Mutant(
        "a parked policy's probe of drafting never timed lasts two rounds",
        "mlx_dspark/batching/policy.py",
        "        return LEARNING_ROUNDS if self._learning(batch, drafted=True) else PROBE_ROUNDS",
        "        return PROBE_ROUNDS",
        ("tests/test_batching.py", "-k", "learns_what_drafting_costs"),
    ),
    Mutant(
        "a pipelined round is timed from its call",
        "mlx_dspark/batching/generator.py",
        "                elapsed += away",
        "                pass",
        ("tests/test_batching.py", "-k", "timed_from_the_last_read"),
    ),
    Mutant(
        "a pipelined round done while the caller was away is timed",
        "mlx_dspark/batching/generator.py",
        "            if away > elapsed:",
        "            if False:",
        ("tests/test_batching.py", "-k", "timed_from_the_last_read"),
    ),
    Mutant(
        "a drafted round verifying none pays the plain rounds' overhead too",
        "mlx_dspark/batching/policy.py",
        "        realised = RoundCosts(realised.drafting(drawn), measured.verify)",
        "        realised = RoundCosts(realised.drafting(drawn), realised.verify)",
        ("tests/test_batching.py", "-k", "verifies_none_pays"),
    ),
    Mutant(
        "a round's overhead is taken as a ratio of its drafter's cost",
        "mlx_dspark/batching/policy.py",
        "            draft=costs.draft + drafting,",
        "            draft=costs.draft * (1 + drafting / (costs.draft + costs.verify[1])),",
        ("tests/test_batching.py", "-k", "overhead_is_added"),
    ),
    Mutant(
        "a batch near its depth bucket's end takes up the bucket's measurement",
        "mlx_dspark/batching/generator.py",
        "        ahead = self._next_buckets(depth)\n",
        "        ahead = {}\n",
        ("tests/test_batching.py", "-k", "buckets_end"),
    ),
    Mutant(
        "a batch near its depth bucket's end goes on measuring it after each round",
        "mlx_dspark/batching/generator.py",
        "        if batch not in measured and self._next_buckets(depth):\n            return\n",
        "",
        ("tests/test_batching.py", "-k", "buckets_end"),
    ),
    Mutant(
        "rows joining leave no room for the next round's write (a second copy)",
        "mlx_dspark/batching/cache.py",
        "capacity = _rounded_up(width + self.max_rollback + 1, self.step)",
        "capacity = width",
        ("tests/test_batching.py", "-k", "leave_room"),
    ),
    Mutant(
        "packed caches leave no room for the next round's write (a second copy)",
        "mlx_dspark/batching/cache.py",
        "room = _rounded_up(width + self.max_rollback + 1, self.step) - width",
        "room = 0",
        ("tests/test_batching.py", "-k", "leave_room"),
    ),
    Mutant(
        "batch buffers grow to exactly what a write needs, not to the step",
        "mlx_dspark/batching/cache.py",
        "grow = _rounded_up(need, self.step) - capacity",
        "grow = need - capacity",
        ("tests/test_cache.py", "-k", "multiples_of_the_step"),
    ),
    Mutant(
        "batch cache cursor reuses slots a row still holds",
        "mlx_dspark/batching/cache.py",
        "self._idx -= min(counts)",
        "self._idx -= max(counts)",
        ("tests/test_batching.py", "-k", "greedy or roll_back"),
    ),
    # Confidence.
    Mutant(
        "survival without the product",
        "mlx_dspark/confidence/calibration.py",
        "    return np.cumprod(kept_rates(logits, temperatures)).tolist()\n",
        "    return kept_rates(logits, temperatures)\n",
        ("tests/test_confidence.py",),
    ),
    # What the assistant is handed: the proposal its commit takes, and the
    # target's K/V it borrows.
    Mutant(
        "assistant commit ignores the proposal the forward verified",
        "mlx_dspark/drafters/gemma4_assistant.py",
        "length = None if proposal is None else proposal.tokens.shape[-1] + 1",
        "length = None",
        ("tests/test_assistant.py", "-k", "every_round"),
    ),
    Mutant(
        "borrowed sliding K/V one position too many",
        "mlx_dspark/cache.py",
        "b = max(min(end, self._end) - self._start, a)",
        "b = max(min(end + 1, self._end) - self._start, a)",
        ("tests/test_assistant.py", "-k", "every_round or clean"),
    ),
    # The assistant in a batch: each row its own view, position and seed.
    Mutant(
        "batched assistant rows read the first row's K/V view",
        "mlx_dspark/batching/cache.py",
        "visible = (positions >= start[:, None]) & (positions < end[:, None])",
        "visible = (positions >= start[:1, None]) & (positions < end[:1, None])",
        ("tests/test_batching.py", "-k", "assistant_row"),
    ),
    Mutant(
        "batched assistant rows draft at the first row's RoPE position",
        "mlx_dspark/drafters/gemma4_assistant.py",
        "kv, anchors, state.seeds(), state.offset, num_drafts, draw, target",
        "kv, anchors, state.seeds(), state.offset[0], num_drafts, draw, target",
        ("tests/test_batching.py", "-k", "assistant_row"),
    ),
    Mutant(
        "batched assistant seed not rolled back with its row",
        "mlx_dspark/drafters/gemma4_assistant.py",
        "self.last = self.last - counts",
        "self.last = self.last",
        ("tests/test_batching.py", "-k", "assistant_row"),
    ),
    # The rollback caches.
    # The batch's visibility rule.
    Mutant(
        "sliding-window mask one key too wide",
        "mlx_dspark/cache.py",
        "mask = mask & (keys > queries - window)",
        "mask = mask & (keys >= queries - window)",
        ("tests/test_batching.py",),
    ),
    Mutant(
        "a RotatingKVCache counted as able to roll back",
        "mlx_dspark/cache.py",
        "if isinstance(cache, RotatingKVCache) or not cache.is_trimmable():",
        "if not cache.is_trimmable():",
        ("tests/test_cache.py", "-k", "contract"),
    ),
    Mutant(
        "rollback allowed one token past the kept history",
        "mlx_dspark/cache.py",
        "return max(0, self.offset - (self.window - 1) - self._start)",
        "return max(0, self.offset - (self.window - 2) - self._start)",
        ("tests/test_cache.py",),
    ),
    Mutant(
        "a forward's slice starts one position before its first query's window",
        "mlx_dspark/cache.py",
        "return max(self._start, self.offset - self.window + 1)",
        "return max(self._start, self.offset - self.window)",
        ("tests/test_cache.py",),
    ),
    Mutant(
        "a compaction keeps one entry too few for a rollback",
        "mlx_dspark/cache.py",
        "start = o + n - self.capacity",
        "start = o + n - self.capacity + 1",
        ("tests/test_cache.py",),
    ),
    Mutant(
        "a cache trimmed deeper than the ring allowed joins a batch without its whole window",
        "mlx_dspark/cache.py",
        "min(self._end - self.capacity, self.offset - self.window + 1),",
        "self._end - self.capacity,",
        ("tests/test_cache.py", "-k", "joins_a_batch"),
    ),
    Mutant(
        "a prompt chunk's entries stay slices of its concatenation",
        "mlx_dspark/cache.py",
        "        self._make_room(1, keys, values)\n",
        "",
        ("tests/test_cache.py",),
    ),
    Mutant(
        "a one-token forward is handed a mask it does not need",
        "mlx_dspark/cache.py",
        "if N == 1 and not return_array:",
        "if N == 0 and not return_array:",
        ("tests/test_cache.py", "-k", "launches"),
    ),
    Mutant(
        "a scheduler of one's own with a costs method is paced",
        SPEC + "pacing.py",
        "    if isinstance(scheduler, CostScheduler):",
        '    if callable(getattr(scheduler, "costs", None)):',
        ("tests/test_confidence.py", "-k", "ones_own"),
    ),
    Mutant(
        "a stream's first round is built only after the prompt's token is read",
        SPEC + "engine.py",
        "            if max_tokens != 1 and not pacing.measures(start):\n",
        "            if False:\n",
        ("tests/test_pacing.py", "-k", "builds_each_round"),
    ),
    Mutant(
        "the prompt's token waits for a measurement of the first round's costs",
        SPEC + "engine.py",
        "            if max_tokens != 1 and not pacing.measures(start):\n",
        "            if max_tokens != 1:\n",
        ("tests/test_pacing.py", "-k", "waits_for_no_measurement"),
    ),
    Mutant(
        "a generation's rounds chosen and never run count for the later ones",
        SPEC + "engine.py",
        "            pacing.abandon()\n",
        "            pass\n",
        ("tests/test_pacing.py", "-k", "never_run"),
    ),
    Mutant(
        "an abandoned round takes back the counts of another generation's rounds",
        SPEC + "pacing.py",
        "        if self._counts and _counts(self.policy) == self._counts[-1][1]:\n",
        "        if self._counts:\n",
        ("tests/test_pacing.py", "-k", "abandoned_round"),
    ),
    Mutant(
        "a stream asked for the prompt's token alone builds a round after it",
        SPEC + "engine.py",
        "            if max_tokens != 1 and not pacing.measures(start):\n",
        "            if not pacing.measures(start):\n",
        ("tests/test_pacing.py", "-k", "builds_each_round"),
    ),
    Mutant(
        "a joining sequence starts from the fixed prior",
        "mlx_dspark/batching/generator.py",
        "s.acceptance = self._recent.newcomer()",
        "s.acceptance = Acceptance(self.drafter.max_draft_tokens)",
        ("tests/test_batching.py", "-k", "recent_acceptance or queued_request"),
    ),
    # Measuring round costs on this machine (session 9).
    Mutant(
        "costs read as the last of their repeats, not the fastest",
        "mlx_dspark/confidence/costs.py",
        "            fastest[i] = min(fastest[i], clock() - tic)",
        "            fastest[i] = clock() - tic",
        ("tests/test_confidence.py", "-k", "fastest"),
    ),
    Mutant(
        "profiles measured the old way found again",
        "mlx_dspark/confidence/costs.py",
        '            "timing": TIMING,\n',
        "",
        ("tests/test_confidence.py", "-k", "measured_another_way"),
    ),
    Mutant(
        "batch costs timed as each round is chosen, after the tokens went out",
        "mlx_dspark/batching/generator.py",
        "        if not (measured or ahead or under_way):\n            return self._measure(batch, depth)",
        "        if batch & (batch - 1) == 0 or not (measured or ahead or under_way):\n"
        "            return self._measure(batch, depth)",
        ("tests/test_batching.py", "-k", "measures_a_few"),
    ),
    Mutant(
        "a batch that left the size being measured drafts under that size's part",
        "mlx_dspark/batching/generator.py",
        "        starts = batch & (batch - 1) == 0 or not measured",
        "        starts = batch & (batch - 1) == 0",
        ("tests/test_batching.py", "-k", "left_the_size"),
    ),
    Mutant(
        "rounds that hand caches back timed for the policy",
        "mlx_dspark/batching/generator.py",
        '    if handed_back:\n        return "rounds handing caches back"',
        '    if False:\n        return "rounds handing caches back"',
        ("tests/test_batching.py", "-k", "come_and_go or logs_its_slow"),
    ),
    Mutant(
        "a verify timed on the live caches trims one row short",
        "mlx_dspark/batching/generator.py",
        "        for c in rows.target_cache:\n            c.trim(n)",
        "        for c in rows.target_cache:\n            c.trim(n - 1)",
        ("tests/test_batching.py", "-k", "timing_round_costs"),
    ),
    Mutant(
        "a pipelined round the costs timing waited for is timed",
        "mlx_dspark/batching/generator.py",
        "                self._in_flight.waited_for = True  # the timing waited for it",
        "                pass",
        ("tests/test_batching.py", "-k", "costs_timing_waited"),
    ),
    Mutant(
        "finished rows leave at once (no ski rental)",
        "mlx_dspark/batching/generator.py",
        "        return self._rent >= statistics.median(self._copies)",
        "        return True",
        ("tests/test_batching.py", "-k", "ride_along"),
    ),
    Mutant(
        "finished rows owe the whole round, not their share",
        "mlx_dspark/batching/generator.py",
        "        self._rent += seconds * launched.idle / len(launched.sequences)",
        "        self._rent += seconds * launched.idle",
        ("tests/test_batching.py", "-k", "ride_along"),
    ),
    Mutant(
        "finished rows ride along before a copy's price is known",
        "mlx_dspark/batching/generator.py",
        "        if finished == len(self._generation) or not self._copies:",
        "        if finished == len(self._generation):",
        ("tests/test_batching.py", "-k", "ride_along"),
    ),
    Mutant(
        "a copy priced at the whole round after it",
        "mlx_dspark/batching/generator.py",
        "            self._copies.append(max(0.0, seconds - self._last_round))",
        "            self._copies.append(seconds)",
        ("tests/test_batching.py", "-k", "ride_along or price_taking"),
    ),
    Mutant(
        "the round after rows joined prices a copy",
        "mlx_dspark/batching/generator.py",
        "            self._joining = Rows()\n            self._last_round = None",
        "            self._joining = Rows()",
        ("tests/test_batching.py", "-k", "price_taking"),
    ),
    Mutant(
        "the policy prices a round at its live rows only",
        "mlx_dspark/batching/policy.py",
        "        batch = batch or len(caps)\n        if not caps or max(caps) == 0:",
        "        batch = len(caps)\n        if not caps or max(caps) == 0:",
        ("tests/test_batching.py", "-k", "prices_finished"),
    ),
    Mutant(
        "a finished row riding along removed before the parked taps are taken in",
        "mlx_dspark/batching/generator.py",
        "if s.finished or s.uid not in uids]",
        "if s.uid not in uids]",
        ("tests/test_batching.py", "-k", "removed_by_the_server"),
    ),
    Mutant(
        "finished rows riding along keep waiting requests out of a full batch",
        "mlx_dspark/batching/generator.py",
        "        busy = live + len(self._joining)",
        "        busy = len(self._generation) + len(self._joining)",
        ("tests/test_batching.py", "-k", "makes_room"),
    ),
    Mutant(
        "a generation's pacing forgets the drafter's earlier generations",
        "mlx_dspark/speculative/pacing.py",
        "self.acceptance = self.recent.newcomer()",
        "self.acceptance = Acceptance(drafts)",
        ("tests/test_pacing.py", "-k", "recent_acceptance"),
    ),
    Mutant(
        "cost repeats in a row, not passes over the parts",
        "mlx_dspark/confidence/costs.py",
        "    for _ in range(repeats):\n        for i, fn in enumerate(fns):\n",
        "    for i, fn in enumerate(fns):\n        for _ in range(repeats):\n",
        ("tests/test_confidence.py", "-k", "burst or shape or fastest"),
    ),
    Mutant(
        "a part timed without an untimed run of its shape before",
        "mlx_dspark/confidence/costs.py",
        "            mx.eval(fn())\n            tic = clock()\n",
        "            tic = clock()\n",
        ("tests/test_confidence.py", "-k", "burst or shape or fastest"),
    ),
    Mutant(
        "a change of drafts pays nothing for the change",
        "mlx_dspark/batching/policy.py",
        "costs.drafting(w) + (switch if w != keep else 0.0)",
        "costs.drafting(w)",
        ("tests/test_batching.py", "-k", "keeps_its_drafts or width_stays"),
    ),
    Mutant(
        "a change of width pays nothing for the change",
        "mlx_dspark/batching/policy.py",
        "costs.verify[w] + (switch if w != keep else 0.0)",
        "costs.verify[w]",
        ("tests/test_batching.py", "-k", "keeps_its_drafts or width_stays"),
    ),
    Mutant(
        "changes of shape also taken for their kind's overhead",
        "mlx_dspark/batching/policy.py",
        "            self.switch_cost = statistics.median(self._switches)\n            return\n",
        "            self.switch_cost = statistics.median(self._switches)\n",
        ("tests/test_batching.py", "-k", "round_after_round"),
    ),
    Mutant(
        "every round taken for a change of shape",
        "mlx_dspark/batching/policy.py",
        "if before not in (None, (batch, drafts)) and kind in self.overheads:",
        "if before is not None and kind in self.overheads:",
        ("tests/test_batching.py", "-k", "keeps_its_drafts or width_stays"),
    ),
    Mutant(
        "draft counts weighed at their own width, not the one they are padded to",
        "mlx_dspark/batching/policy.py",
        "w = width(k) if k and width else k",
        "w = k",
        ("tests/test_batching.py", "-k", "budgets_ends"),
    ),
    Mutant(
        "a round nobody could draft in forgets the round's shape",
        "mlx_dspark/batching/policy.py",
        "self._shape = (batch, 0) if caps else None",
        "self._shape = None",
        ("tests/test_batching.py", "-k", "nobody_could"),
    ),
    Mutant(
        "a scheduler named per call is made anew each generation",
        "mlx_dspark/confidence/schedulers.py",
        "    if choice not in named:\n",
        "    if True:\n",
        ("tests/test_confidence.py", "-k", "named_per_call"),
    ),
    Mutant(
        "a verify pads to a lone cheap row count",
        "mlx_dspark/confidence/costs.py",
        "if self.verify[n - 1] <= saving and self.verify[n] <= saving",
        "if self.verify[n - 1] <= saving",
        ("tests/test_pacing.py", "-k", "lone"),
    ),
    Mutant(
        "a verify pads for any saving",
        "mlx_dspark/confidence/costs.py",
        "saving = self.verify[tokens - 1] * (1 - PAD_SAVING)",
        "saving = self.verify[tokens - 1]",
        ("tests/test_pacing.py", "-k", "jagged or lone"),
    ),
    Mutant(
        "a round nobody could draft in leaves no shape to observe",
        "mlx_dspark/batching/policy.py",
        "self._chosen.append(self._shape and (batch, 0, False, None))",
        "self._chosen.append(None)",
        ("tests/test_batching.py", "-k", "nobody_could"),
    ),
    Mutant(
        "costs measured ahead at the bucket above the one named",
        "mlx_dspark/batching/measure.py",
        "        depth = bucket * 3 // 4\n        for batch in batches:\n",
        "        depth = bucket + 1\n        for batch in batches:\n",
        ("tests/test_costs_command.py",),
    ),
    Mutant(
        "costs measured ahead at the first prompts' batch size only",
        "mlx_dspark/batching/measure.py",
        "while len(started) < batch:",
        "while not started:",
        ("tests/test_costs_command.py",),
    ),
    Mutant(
        "timing a round on the live caches draws from the random state",
        "mlx_dspark/confidence/costs.py",
        "        return proposal.tokens, proposal.confidence\n",
        "        mx.random.uniform()\n        return proposal.tokens, proposal.confidence\n",
        ("tests/test_confidence.py", "-k", "timing_on_the_live"),
    ),
    Mutant(
        "timing a round on the live caches leaves a verified row behind",
        "mlx_dspark/confidence/costs.py",
        "            c.trim(n)\n",
        "            c.trim(n - 1)\n",
        ("tests/test_confidence.py", "-k", "timing_on_the_live or any_schedule_is_lossless"),
    ),
    Mutant(
        "a long-lived scheduler keeps its costs in the cache folder of its first use",
        "mlx_dspark/confidence/schedulers.py",
        "            key = self._keys[where] = path or timer.key\n",
        "            key = self._keys[where] = timer.key\n",
        ("tests/test_confidence.py", "-k", "long_lived"),
    ),
    Mutant(
        "a long-lived scheduler remembers its profile's file whatever the cache folder",
        "mlx_dspark/confidence/schedulers.py",
        "        where = (timer.key, *(os.environ.get(name) for name in CACHE_SETTINGS))\n",
        "        where = (timer.key,)\n",
        ("tests/test_confidence.py", "-k", "long_lived"),
    ),
    Mutant(
        "the drafter drafts without the parked rounds' taps",
        SPEC + "engine.py",
        "                take_in_parked_taps()\n                proposal = drafter.propose(",
        "                proposal = drafter.propose(",
        ("tests/test_pacing.py", "-k", "leave_their_taps"),
    ),
    Mutant(
        "a generation that ends parked leaves its taps untaken",
        SPEC + "engine.py",
        "                take_in_parked_taps()\n                settle(first_position, yielded)",
        "                settle(first_position, yielded)",
        ("tests/test_pacing.py", "-k", "leave_their_taps"),
    ),
    Mutant(
        "a sequence's acceptance remembers 10 rounds",
        "mlx_dspark/batching/policy.py",
        "DECAY = 0.97",
        "DECAY = 0.9",
        ("tests/test_pacing.py", "-k", "seldom_parks"),
    ),
    Mutant(
        "parked rounds keep their taps without bound",
        SPEC + "engine.py",
        "            if len(parked_taps) == PARKED_TAPS_AT_MOST:",
        "            if False:",
        ("tests/test_pacing.py", "-k", "leave_their_taps"),
    ),
    Mutant(
        "a single stream's pacing observes no round's time",
        SPEC + "pacing.py",
        "            self.policy.observe(seconds)\n",
        "            pass\n",
        ("tests/test_pacing.py", "-k", "slower_than_measured"),
    ),
    Mutant(
        "a single stream's pacing learns anew every generation",
        SPEC + "pacing.py",
        "        self.policy = _policy(scheduler.paced_policies, (drafts, getattr(timer, \"key\", None)))\n",
        "        self.policy = BatchPolicy(probe_first=True)\n",
        ("tests/test_pacing.py", "-k", "slower_than_measured or probes_once_not_every"),
    ),
    Mutant(
        "plain rounds' overhead left out of a plain round's cost",
        "mlx_dspark/batching/policy.py",
        "            verify=[costs.verify[0] + plain] + list(costs.verify[1:]),\n",
        "            verify=[costs.verify[0]] + list(costs.verify[1:]),\n",
        ("tests/test_pacing.py", "-k", "every_round_keeps"),
    ),
    Mutant(
        "a round its confidences cut short is weighed against the drafts chosen",
        SPEC + "engine.py",
        "                    if num_verify != num_drafts:\n"
        "                        pacing.verifies(num_verify, start, num_drafts)\n",
        "",
        ("tests/test_pacing.py", "-k", "fewer_drafts"),
    ),
    Mutant(
        "a single stream's pacing forgets what a round verifies",
        SPEC + "pacing.py",
        "            self.policy.verifies(drafts, known.padded(), drawn=drawn)\n",
        "            pass\n",
        ("tests/test_pacing.py", "-k", "fewer_drafts"),
    ),
    Mutant(
        "a failed generation's last choice is the next generation's first observed",
        "mlx_dspark/batching/policy.py",
        "        self._chosen = deque() if chosen is None else chosen\n",
        "        self._chosen = self._chosen if chosen is None else chosen\n",
        ("tests/test_pacing.py", "-k", "fails_mid_round"),
    ),
    Mutant(
        "CUDA graphs turned off for quantized targets too",
        "mlx_dspark/confidence/costs.py",
        '    if model_fingerprint(model)["quantization"] or not mx.cuda.is_available():\n',
        "    if not mx.cuda.is_available():\n",
        ("tests/test_confidence.py", "-k", "cuda_graphs"),
    ),
    Mutant(
        "the commands' preflight leaves CUDA graphs on",
        "mlx_dspark/integration/cli.py",
        "    launch_settings_for_speculation(target)\n",
        "",
        ("tests/test_confidence.py", "-k", "cuda_graphs"),
    ),
    Mutant(
        "a hidden-state drafter without --model reaches the target's load",
        "mlx_dspark/integration/cli.py",
        "    if model_path is None:\n",
        "    if False:\n",
        ("tests/test_activation.py", "-k", "no_model"),
    ),
    Mutant(
        "replayed acceptance leaves the drafter's own confidences",
        "benchmarks/speculative.py",
        "    Proposal.__init__ = replayed_confidence\n",
        "",
        ("tests/test_benchmarks.py", "-k", "replayed"),
    ),
    Mutant(
        "a --variant left out of --modes is ignored",
        "benchmarks/server_load.py",
        "        if name not in modes:\n",
        "        if False:\n",
        ("tests/test_benchmarks.py", "-k", "variant"),
    ),
    # Session 20: cost measurements across rounds in passes; parked rounds
    # built ahead.
    Mutant(
        "a measurement across rounds times every repeat of a length at once",
        "mlx_dspark/confidence/costs.py",
        "draft=start == 1, repeats=1)",
        "draft=start == 1)",
        ("tests/test_confidence.py", "-k", "at_a_time or fastest_pass"),
    ),
    Mutant(
        "a later pass's time replaces the fastest so far",
        "mlx_dspark/confidence/costs.py",
        "verify[n - 1] = min(verify[n - 1], seconds)",
        "verify[n - 1] = seconds",
        ("tests/test_confidence.py", "-k", "fastest_pass"),
    ),
    Mutant(
        "a measurement across rounds times the draft every call",
        "mlx_dspark/confidence/costs.py",
        "draft=start == 1, repeats=1)",
        "draft=True, repeats=1)",
        ("tests/test_confidence.py", "-k", "at_a_time"),
    ),
    Mutant(
        "a measurement past its first pass does not stand in as measured",
        "mlx_dspark/confidence/costs.py",
        "            if batch not in found and len(under_way.verify) == tokens:\n",
        "            if False:\n",
        ("tests/test_batching.py", "-k", "powers_of_two"),
    ),
    Mutant(
        "a parked round is read before the next one is built",
        SPEC + "engine.py",
        "            if num_drafts:\n                return None, (start, num_drafts)\n",
        "            if True:\n                return None, (start, num_drafts)\n",
        ("tests/test_pacing.py", "-k", "builds_each"),
    ),
    Mutant(
        "a round built ahead leaves its anchor out of the processors' context",
        SPEC + "engine.py",
        "built, chosen = ahead(tokens, context, start + 1",
        "built, chosen = ahead(tokens, context[:-1], start + 1",
        ("tests/test_sampling.py", "-k", "greedy_with_logits_processors"),
    ),
    Mutant(
        "the first round, built ahead, leaves the prompt's token out of the processors' context",
        SPEC + "engine.py",
        "built, chosen = ahead(anchor, context, start, 1)",
        "built, chosen = ahead(anchor, context[:-1], start, 1)",
        ("tests/test_sampling.py", "-k", "greedy_with_logits_processors"),
    ),
    Mutant(
        "a parked round in flight while costs were measured is observed",
        SPEC + "pacing.py",
        "            self._began = deque(None for _ in self._began)\n            self._read = None\n",
        "            pass\n",
        ("tests/test_pacing.py", "-k", "parks_when"),
    ),
    Mutant(
        "generations advanced in turn observe each other's rounds",
        SPEC + "pacing.py",
        "            self._read = read\n            self.policy.restart(self._chosen)\n",
        "            self._read = read\n",
        ("tests/test_pacing.py", "-k", "own_rounds"),
    ),
    Mutant(
        "rounds built ahead are each observed at their own shifted time",
        SPEC + "pacing.py",
        "                seconds = self._overlapped[0] / self._overlapped[1]\n",
        "",
        ("tests/test_pacing.py", "-k", "every_round_keeps"),
    ),
    Mutant(
        "a measurement under way never expires",
        "mlx_dspark/confidence/costs.py",
        "        if under_way is not None and not 0 <= time.time() - under_way.started <= self.max_age:\n",
        "        if False:\n",
        ("tests/test_confidence.py", "-k", "expires_and"),
    ),
    Mutant(
        "a failed timing leaves an empty measurement under way",
        "mlx_dspark/confidence/costs.py",
        "                under_way = self._under_way(key) or _Partial()\n",
        "                under_way = self._under_way(key) or _Partial()\n"
        "                self._partial[key] = under_way\n",
        ("tests/test_confidence.py", "-k", "expires_and"),
    ),
    # Session 22.
    Mutant(
        "a depth near its bucket's end measures its own bucket",
        "mlx_dspark/confidence/costs.py",
        "            ahead = _entry_key(depth + NEAR_BUCKET_END, batch)\n",
        "            ahead = _entry_key(depth, batch)\n",
        ("tests/test_confidence.py", "-k", "buckets_end"),
    ),
    Mutant(
        "Algorithm 1 stops at the first draft that does not pay alone",
        "mlx_dspark/confidence/schedulers.py",
        "            for m in range(1, len(ahead) + 1)\n",
        "            for m in range(1, 2)\n",
        ("tests/test_confidence.py", "-k", "cliff or schedule or appendix"),
    ),
    Mutant(
        "a batch's truncation stops at the first position that does not pay alone",
        "mlx_dspark/batching/policy.py",
        "        if not pays and not _pays_further(survival, caps, costs, j, top, tokens, current):\n",
        "        if not pays:\n",
        ("tests/test_batching.py", "-k", "cliff or drafted_round"),
    ),
    Mutant(
        "the lookahead reads the last draft's survival (peeks past j)",
        "mlx_dspark/confidence/schedulers.py",
        "    rate = min(1.0, survival / before) if before > 0 else 0.0\n",
        "    rate = min(1.0, row[-1] / survival) if survival > 0 else 0.0\n",
        ("tests/test_confidence.py", "tests/test_batching.py", "-k", "never_looks or each_position"),
    ),
    Mutant(
        "probes leave their changes of shape out of their loss",
        "mlx_dspark/batching/policy.py",
        "                    loss += 2 * self.switch_cost / length\n",
        "",
        ("tests/test_batching.py", "-k", "changes_of_shape"),
    ),
    Mutant(
        "a measured bucket's end takes the next bucket's costs",
        "mlx_dspark/confidence/costs.py",
        "        if batch is None and self._fresh(key, tokens) is None:\n",
        "        if batch is None:\n",
        ("tests/test_confidence.py", "-k", "buckets_end"),
    ),
    Mutant(
        "a batch's bucket end takes the next bucket's costs",
        "mlx_dspark/confidence/costs.py",
        "        if batch is None and self._fresh(key, tokens) is None:\n",
        "        if self._fresh(key, tokens) is None:\n",
        ("tests/test_confidence.py", "-k", "buckets_end"),
    ),
    Mutant(
        "the lookahead keeps later drafts at draft j's survival, not its rate",
        "mlx_dspark/confidence/schedulers.py",
        "    rate = min(1.0, survival / before) if before > 0 else 0.0\n",
        "    rate = survival\n",
        ("tests/test_confidence.py", "-k", "geometric or cliff"),
    ),
    Mutant(
        "a plain round's overhead is clamped only once a drafting one is known",
        "mlx_dspark/batching/policy.py",
        "        plain = min(plain, drafting)\n",
        "        plain = min(plain, drafting) if drafting else plain\n",
        ("tests/test_batching.py", "-k", "slow_plain"),
    ),
    Mutant(
        "a plain round's overhead may exceed a drafting round's",
        "mlx_dspark/batching/policy.py",
        "        plain = min(plain, drafting)\n",
        "",
        ("tests/test_batching.py", "-k", "slow_plain or no_acceptance"),
    ),
    Mutant(
        "refused drafts count without the decay",
        "mlx_dspark/batching/policy.py",
        "            self.verified[j] = self.decay * self.verified[j] + 1.0\n"
        "            self.accepted[j] = self.decay * self.accepted[j] + rate\n",
        "            self.verified[j] = self.verified[j] + 1.0\n"
        "            self.accepted[j] = self.decay * self.accepted[j] + rate\n",
        ("tests/test_batching.py", "-k", "bring_every_later_rate"),
    ),
    Mutant(
        "refused drafts count as kept",
        "mlx_dspark/batching/policy.py",
        "            self.accepted[j] = self.decay * self.accepted[j] + rate\n",
        "            self.accepted[j] = self.decay * self.accepted[j] + 1.0\n",
        ("tests/test_batching.py", "-k", "bring_every_later_rate"),
    ),
    Mutant(
        "a single stream learns nothing from the drafts it refused",
        "mlx_dspark/speculative/engine.py",
        "                    pacing.expect(num_verify, logits)\n",
        "                    pass\n",
        ("tests/test_pacing.py", "-k", "refuse_its_drafts"),
    ),
    Mutant(
        "a batch learns nothing from the drafts it refused",
        "mlx_dspark/batching/generator.py",
        "                self._expect(s, n, launched.confidences[b])\n",
        "                pass\n",
        ("tests/test_batching.py", "-k", "refuse_its_drafts"),
    ),
    Mutant(
        "refused drafts count at their raw confidences, not the calibrated ones",
        "mlx_dspark/speculative/pacing.py",
        "        rates = kept_rates(logits, getattr(self.scheduler, \"temperatures\", None))[first:]\n",
        "        rates = kept_rates(logits)[first:]\n",
        ("tests/test_pacing.py", "-k", "refuse_its_drafts"),
    ),
    # Session 24: what a reviewer's mutants showed the first tests missed.
    Mutant(
        "a single stream counts refused drafts after rejecting a verified one",
        "mlx_dspark/speculative/engine.py",
        "                if next_token is not None and accepted == verified == num_verify < num_drafts:\n",
        "                if num_verify < num_drafts:\n",
        ("tests/test_pacing.py", "-k", "refused_drafts_count_only"),
    ),
    Mutant(
        "a stream's refused drafts take the temperatures of the first positions",
        "mlx_dspark/speculative/pacing.py",
        "        rates = kept_rates(logits, getattr(self.scheduler, \"temperatures\", None))[first:]\n",
        "        rates = kept_rates(logits[first:], getattr(self.scheduler, \"temperatures\", None))\n",
        ("tests/test_pacing.py", "-k", "refused_drafts_count_only"),
    ),
    Mutant(
        "a stream's refused drafts are not kept for the drafter's later generations",
        "mlx_dspark/speculative/pacing.py",
        "        self.recent.expect(first, rates)\n",
        "        pass\n",
        ("tests/test_pacing.py", "-k", "refused_drafts_count_only"),
    ),
    Mutant(
        "a batch row's refused drafts take the temperatures of the first positions",
        "mlx_dspark/batching/generator.py",
        "            rates = kept_rates(confidence, self.drafter.calibration.temperatures)[first:]\n",
        "            rates = kept_rates(confidence[first:], self.drafter.calibration.temperatures)\n",
        ("tests/test_batching.py", "-k", "refused_drafts"),
    ),
    Mutant(
        "mlx_dspark costs measures a single stream with other drafts a round than it runs",
        "mlx_dspark/batching/measure.py",
        "scheduler=scheduler,\n            num_draft_tokens=num_draft_tokens,\n",
        "scheduler=scheduler,\n            num_draft_tokens=drafter.block_size - 1,\n",
        ("tests/test_costs_command.py", "-k", "single_stream"),
    ),
    Mutant(
        "a fresh stream parked on its prior waits REPROBE_EVERY rounds for its first probe",
        "mlx_dspark/speculative/pacing.py",
        "        policy = latest[-1].newcomer() if latest else BatchPolicy(probe_first=True)\n",
        "        policy = latest[-1].newcomer() if latest else BatchPolicy()\n",
        ("tests/test_pacing.py", "-k", "probes_its_acceptance_at_once"),
    ),
    Mutant(
        "a batch row's refused drafts are not kept for later requests",
        "mlx_dspark/batching/generator.py",
        "            self._recent.expect(first, rates)\n",
        "            pass\n",
        ("tests/test_batching.py", "-k", "refused_drafts"),
    ),
    Mutant(
        "a parked stream probes at once only if it never drafted",
        "mlx_dspark/batching/policy.py",
        "                first = self.probe_first and hopeful > self.deepest\n",
        "                first = self.probe_first and self.drafting == 0 and self.parked <= length\n",
        ("tests/test_pacing.py", "-k", "as_it_goes"),
    ),
    Mutant(
        "a parked stream forgets how deep its rounds drafted",
        "mlx_dspark/batching/policy.py",
        "        self.deepest = max(self.deepest, k)\n",
        "        pass\n",
        ("tests/test_pacing.py", "-k", "as_it_goes or probes_once_not_every"),
    ),
    Mutant(
        "mlx_dspark costs run again prefills every bucket it has",
        "mlx_dspark/batching/measure.py",
        "        kept = key_timer and scheduler.profile(key_timer).measured(depth, key_timer)\n",
        "        kept = None\n",
        ("tests/test_costs_command.py", "-k", "run_again"),
    ),
    Mutant(
        "the pacing's policy keeps the last generation's timer (and caches)",
        "mlx_dspark/speculative/pacing.py",
        "            self.policy.costs = None\n",
        "            pass\n",
        ("tests/test_pacing.py", "-k", "leaves_its_caches"),
    ),
    Mutant(
        "a per-call cost on a default-loaded drafter learns apart from the default",
        "mlx_dspark/confidence/schedulers.py",
        "        named[choice] = own.pacing_sampling()\n",
        "        pass\n",
        ("tests/test_pacing.py", "-k", "per_call_goes_on"),
    ),
    Mutant(
        "a per-call fixed on a default-loaded drafter gets the default's cost twin",
        "mlx_dspark/confidence/schedulers.py",
        "    if choice not in named and choice == \"cost\" and isinstance(own, CostScheduler):\n",
        "    if choice not in named and isinstance(own, CostScheduler):\n",
        ("tests/test_pacing.py", "-k", "per_call_goes_on"),
    ),
    Mutant(
        "paired.py runs bf16 rows with MLX's launch settings, not the commands'",
        "benchmarks/paired.py",
        "        launch_settings_for_speculation(model)\n",
        "        pass\n",
        ("tests/test_benchmarks.py", "-k", "launch_settings"),
    ),
    Mutant(
        "a proposal of fewer drafts is charged as a whole one",
        "mlx_dspark/confidence/costs.py",
        "        if self.draft_one is None or self.drafts <= 1:\n            return self.draft\n",
        "        return self.draft\n",
        ("tests/test_confidence.py", "tests/test_batching.py", "-k", "one_at_a_time or timed_at_its_drafts"),
    ),
    Mutant(
        "a server's batch times its drafts at the drafter's limit",
        "mlx_dspark/batching/generator.py",
        "                self.num_draft_tokens,\n                self._time_verify,\n",
        "                self.drafter.max_draft_tokens,\n                self._time_verify,\n",
        ("tests/test_batching.py", "-k", "rounds_draw"),
    ),
    Mutant(
        "a round is observed at the drafts it verifies, not at those it drew",
        "mlx_dspark/batching/policy.py",
        "measured.drafting(max(drawn or drafts, 1))",
        "measured.drafting(max(drafts, 1))",
        ("tests/test_batching.py", "-k", "drew"),
    ),
    Mutant(
        "a profile's write drops what other processes wrote meanwhile",
        "mlx_dspark/confidence/costs.py",
        "            if self._rank(entry) > self._rank(self.entries.get(key)):\n",
        "            if False:\n",
        ("tests/test_confidence.py", "-k", "two_processes"),
    ),
    Mutant(
        "a stale whole measurement on disk beats the one under way",
        "mlx_dspark/confidence/costs.py",
        "        return (2 if fresh else 0, when)\n",
        "        return (2, when)\n",
        ("tests/test_confidence.py", "-k", "stale_profile"),
    ),
    Mutant(
        "a measurement under way is kept in memory only",
        "mlx_dspark/confidence/costs.py",
        "                    self.entries[key] = under_way.entry(depth)\n",
        "",
        ("tests/test_confidence.py", "-k", "leaves_unfinished"),
    ),
    Mutant(
        "a profile's key leaves out the drafter network's precision",
        "mlx_dspark/confidence/costs.py",
        '"network": model_fingerprint(network) if isinstance(network, nn.Module) else None,',
        '"network": None,',
        ("tests/test_confidence.py", "-k", "drafter_precision"),
    ),
    Mutant(
        "the doctor charges every count of drafts a whole proposal",
        "mlx_dspark/doctor.py",
        '    seconds = round_costs(costs).drafting(drafts) + costs["verify"][drafts]\n',
        '    seconds = costs["draft"] + costs["verify"][drafts]\n',
        ("tests/test_doctor.py", "-k", "one_at_a_time"),
    ),
    Mutant(
        "a server's batch after a drain paces with a fresh policy",
        "mlx_dspark/integration/server.py",
        '    if policy is None or getattr(policy, "costs", None) is not None:\n',
        "    if True:\n",
        ("tests/test_batching.py", "-k", "across_drains"),
    ),
    Mutant(
        "mlx_lm.generate sampling without a seed drafts every round",
        "mlx_dspark/integration/cli.py",
        '        generation_options["scheduler"] = "cost"\n',
        "        pass\n",
        ("tests/test_integration.py", "-k", "paces_sampling"),
    ),
    Mutant(
        "a server request sampling without a seed, served alone, drafts every round",
        "mlx_dspark/integration/server.py",
        '    local.scheduler = None if chosen or getattr(args, "seed", None) is not None else "cost"\n',
        "    local.scheduler = None\n",
        ("tests/test_server_batch.py", "-k", "alone_is_paced"),
    ),
    Mutant(
        "a stream on a new thread paces with a fresh policy",
        SPEC + "pacing.py",
        "        policy = latest[-1].newcomer() if latest else BatchPolicy(probe_first=True)\n",
        "        policy = BatchPolicy(probe_first=True)\n",
        ("tests/test_pacing.py", "-k", "new_thread"),
    ),
    Mutant(
        "a scheduler keeps a policy for every thread that ever paced",
        SPEC + "pacing.py",
        "    while len(policies) > THREADS_KEPT:\n",
        "    while False:\n",
        ("tests/test_pacing.py", "-k", "new_thread"),
    ),
    Mutant(
        "an entry's costs are built once a key, not once an entry",
        "mlx_dspark/confidence/costs.py",
        "        if built is None or built[0] is not entry:\n",
        "        if built is None:\n",
        ("tests/test_confidence.py", "tests/test_pacing.py", "-k", "profile or measurement or cost"),
    ),
    Mutant(
        "a cost entry never goes stale",
        "mlx_dspark/confidence/costs.py",
        '        if not 0 <= time.time() - entry["measured_at"] <= self.max_age:\n',
        "        if False:\n",
        ("tests/test_confidence.py", "-k", "stale"),
    ),
    Mutant(
        "two writers of one profile do not wait for each other",
        "mlx_dspark/confidence/costs.py",
        "                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "                pass\n",
        ("tests/test_confidence.py", "-k", "writing"),
    ),
    Mutant(
        "a profile's writer waits for a held lock for good",
        "mlx_dspark/confidence/costs.py",
        "                if time.monotonic() > deadline:\n",
        "                if False:\n",
        ("tests/test_confidence.py", "-k", "held_too_long"),
    ),
    Mutant(
        "every drafts count is weighed at each sequence's whole cap",
        "mlx_dspark/batching/policy.py",
        "        tokens = sum(e[min(k, len(e) - 1)] for e in emitted)\n",
        "        tokens = sum(e[-1] for e in emitted)\n",
        ("tests/test_batching.py", "-k", "best_drafts or policy"),
    ),
    Mutant(
        "a later position's prior is its own, not moved with the position before it",
        "mlx_dspark/batching/policy.py",
        "            if j and self.prior[j - 1] > 0:\n",
        "            if False:\n",
        ("tests/test_batching.py", "-k", "acceptance or never_verified or refused or probabilities"),
    ),
    Mutant(
        "a later position's prior is the rate before it, not the newcomer's own moved with it",
        "mlx_dspark/batching/policy.py",
        "                prior = min(1.0, prior * rates[-1] / self.prior[j - 1])\n",
        "                prior = rates[-1]\n",
        ("tests/test_batching.py", "-k", "acceptance or never_verified or refused or probabilities"),
    ),
    Mutant(
        "a later position's moved prior is not held to 1",
        "mlx_dspark/batching/policy.py",
        "                prior = min(1.0, prior * rates[-1] / self.prior[j - 1])\n",
        "                prior = prior * rates[-1] / self.prior[j - 1]\n",
        ("tests/test_batching.py", "-k", "acceptance or never_verified or refused or probabilities"),
    ),
    Mutant(
        "a drafting round is weighed with the drafting rounds' one overhead, whatever its drafts",
        "mlx_dspark/batching/policy.py",
        "        seconds += (beyond or {}).get(w, 0.0)\n",
        "        seconds += 0.0\n",
        ("tests/test_batching.py", "-k", "few_drafts_slower"),
    ),
    Mutant(
        "a count of drafts' own overhead is not recorded",
        "mlx_dspark/batching/policy.py",
        "            self._by_drafts[batch, drafts].append(excess)\n",
        "            pass\n",
        ("tests/test_batching.py", "-k", "few_drafts_slower"),
    ),
    Mutant(
        "a count of drafts' overhead is its slowest recent round's",
        "mlx_dspark/batching/policy.py",
        "            drafts: min(recent) - overhead\n",
        "            drafts: max(recent) - overhead\n",
        ("tests/test_batching.py", "-k", "few_drafts_slower"),
    ),
    Mutant(
        "a drafting round that verified none counts as a count of 0 drafts",
        "mlx_dspark/batching/policy.py",
        "        if drafts:  # (a drafting round that verified none is no count's)\n",
        "        if drafted:\n",
        ("tests/test_batching.py", "-k", "few_drafts_slower"),
    ),
    Mutant(
        "a count of drafts' own overhead is never forgotten",
        "mlx_dspark/batching/policy.py",
        "            if b == batch and self._timed[batch] - self._timed_at[b, drafts] <= FORGET_AFTER\n",
        "            if b == batch\n",
        ("tests/test_batching.py", "-k", "few_drafts_slower"),
    ),
    Mutant(
        "a batch size weighs its counts against an overhead a neighbour's stands in for",
        "mlx_dspark/batching/policy.py",
        "        if (batch, False) not in self.overheads or (batch, True) not in self.overheads:\n",
        "        if (batch, True) not in self.overheads:\n",
        ("tests/test_batching.py", "-k", "few_drafts_slower"),
    ),
    Mutant(
        "a generation parks on its first rounds' own rates",
        "mlx_dspark/batching/policy.py",
        "YOUNG_ROUNDS = 3",
        "YOUNG_ROUNDS = 0",
        ("tests/test_pacing.py", "tests/test_batching.py", "-k", "unlucky"),
    ),
    Mutant(
        "a sequence's first rounds go by its drafter's rates for good",
        "mlx_dspark/batching/policy.py",
        "        self.read += 1\n",
        "",
        ("tests/test_pacing.py", "tests/test_batching.py", "-k", "unlucky"),
    ),
    Mutant(
        "a server's requests choose by their own rates from their first round",
        "mlx_dspark/batching/generator.py",
        "[s.acceptance.round_rates(cap) for s, cap in zip(live, caps)]",
        "[s.acceptance.rates() for s in live]",
        ("tests/test_batching.py", "-k", "unlucky"),
    ),
    Mutant(
        "a fresh drafter's first rounds go by the fixed guess",
        "mlx_dspark/batching/policy.py",
        "untried=not any(self.verified)",
        "untried=False",
        ("tests/test_pacing.py", "tests/test_batching.py", "-k", "never_pay_probes_once or joining_sequence"),
    ),
    Mutant(
        "the multirow kernel outside a verify",
        "mlx_dspark/targets/multirow.py",
        "    if not _verifying.get():\n        return None\n",
        "",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel for one row",
        "mlx_dspark/targets/multirow.py",
        "ROWS = range(2, 9)",
        "ROWS = range(1, 9)",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel routes 8-bit modules",
        "mlx_dspark/targets/multirow.py",
        "and module.bits == 4\n",
        "",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "MLX_DSPARK_MULTIROW=0 ignored",
        "mlx_dspark/targets/multirow.py",
        'os.environ.get("MLX_DSPARK_MULTIROW", "1") != "0"',
        "True",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "adapt_target never routes",
        SPEC + "engine.py",
        "        elif multirow.route(model) and multirow.choose(model):",
        "        elif False:",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "a routed target reads MLX's cost profiles",
        "mlx_dspark/confidence/costs.py",
        '            identity["multirow"] = routed\n',
        "            pass\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel takes a biased projection",
        "mlx_dspark/targets/multirow.py",
        'and "bias" not in module\n',
        "",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel computes the first sequence's rows only",
        "mlx_dspark/targets/multirow.py",
        "flat = x.reshape(rows, x.shape[-1])",
        "flat = x.reshape(-1, x.shape[-1])[: x.shape[-2]] if x.ndim > 2 and x.shape[0] > 1 else x.reshape(rows, x.shape[-1])",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "routing stays once turned off",
        SPEC + "engine.py",
        "    if not multirow.available():\n        multirow.unroute(model)\n",
        "    if not multirow.available():\n        pass\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel routed unchecked",
        SPEC + "engine.py",
        "        failed = multirow.works()\n",
        "        failed = ''\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel at rows it was timed slower at",
        "mlx_dspark/targets/multirow.py",
        "    if rows not in module.kernel_rows or",
        "    if rows not in ROWS or",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel chosen where it was slower",
        "mlx_dspark/targets/multirow.py",
        "    return kernel < mlx\n",
        "    return kernel > mlx\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel timed side by side",
        "mlx_dspark/targets/multirow.py",
        "                inputs = x + 0 * y[:, :1]\n",
        "                inputs = x\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "a shape the multirow kernel is never faster at stays routed",
        "mlx_dspark/targets/multirow.py",
        "            if rows:\n",
        "            if True:\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow choices are not kept",
        "mlx_dspark/targets/multirow.py",
        "        partial.replace(path)\n",
        "        partial.unlink()\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "an unwritable multirow choices folder stops generation",
        "mlx_dspark/targets/multirow.py",
        "    except OSError:\n        pass  # an unwritable cache",
        "    except ValueError:\n        pass  # an unwritable cache",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow kernel's time read as MLX's",
        "mlx_dspark/targets/multirow.py",
        "    kernel, mlx = costs.fastest_seconds(chained(by_kernel), chained(by_mlx), clock=clock)",
        "    mlx, kernel = costs.fastest_seconds(chained(by_kernel), chained(by_mlx), clock=clock)",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "a new multirow shape's choice drops the others",
        "mlx_dspark/targets/multirow.py",
        "json.dumps({**_read_choices(path), **choices}",
        "json.dumps(choices",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "multirow rows read from a file unchecked",
        "mlx_dspark/targets/multirow.py",
        "        if isinstance(rows, list) and all(isinstance(r, int) and r in ROWS for r in rows)\n",
        "",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "a multirow kernel failing at one shape stops generation",
        "mlx_dspark/targets/multirow.py",
        "    except RuntimeError as e:\n        print(",
        "    except ValueError as e:\n        print(",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "routing a target tried again each generation",
        SPEC + "engine.py",
        "    elif not multirow.considered(model) and",
        "    elif not multirow.routed_count(model) and",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow choices outlive a change of how they were timed",
        "mlx_dspark/targets/multirow.py",
        '        "timing": [TIMING, costs.REPEATS],\n',
        "",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "mlx_lm.generate's preflight routes and times the unread target",
        "mlx_dspark/integration/cli.py",
        "from ..speculative.engine import checked_target\n",
        "from ..speculative.engine import adapt_target as checked_target\n",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "the multirow choices are another device's",
        "mlx_dspark/targets/multirow.py",
        '        "device": costs.device_identity(),\n',
        "",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "adapt_target routes without choosing",
        SPEC + "engine.py",
        "        elif multirow.route(model) and multirow.choose(model):",
        "        elif multirow.route(model):",
        ("tests/test_multirow.py",),
    ),
    Mutant(
        "Gemma-4's forward is no verify",
        "mlx_dspark/targets/gemma4.py",
        "        with multirow.verifying():\n            return self._forward(inputs, cache, taps)",
        "        return self._forward(inputs, cache, taps)",
        ("tests/test_multirow.py",),
    ),
]


def copy_tree(destination: Path) -> None:
    """The package, tests, benchmark scripts (which tests import) and
    project files, without virtual environments, git metadata or results."""
    ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "results")
    for name in ("mlx_dspark", "tests", "examples", "benchmarks", "pyproject.toml"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=ignore)
        else:
            shutil.copy(source, destination / name)


def check(mutant: Mutant, tree: Path) -> str:
    """The text of the mutant's file in ``tree``, which holds the text to
    mutate exactly once."""
    text = (tree / mutant.path).read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(
            f"{mutant.name}: the text to mutate occurs {text.count(mutant.old)} "
            f"times in {mutant.path} (expected once); update the mutant."
        )
    return text


def apply(mutant: Mutant, tree: Path) -> None:
    text = check(mutant, tree)
    (tree / mutant.path).write_text(text.replace(mutant.old, mutant.new))


def run(mutant: Mutant, timeout: float) -> Tuple[str, float]:
    """``"killed"`` (a test failed), ``"survived"`` or ``"timeout"`` (counted
    as killed: the tests did not pass), and the seconds taken."""
    with tempfile.TemporaryDirectory(prefix="mlx-dspark-mutant-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        apply(mutant, tree)
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        start = time.perf_counter()
        try:
            result = subprocess.run(
                [*command, *mutant.tests],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start
        elapsed = time.perf_counter() - start
        if result.returncode not in (0, 1) or "mutant-" not in _imported_from(
            tree, env
        ):
            raise SystemExit(
                f"{mutant.name}: the tests did not run on the copy "
                f"(pytest exit status {result.returncode}):\n{result.stdout[-2000:]}"
            )
    return ("survived" if result.returncode == 0 else "killed"), elapsed


def _imported_from(tree: Path, env: dict) -> str:
    return subprocess.run(
        [sys.executable, "-c", "import mlx_dspark; print(mlx_dspark.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    ).stdout


def report(results) -> str:
    killed = sum(outcome != "survived" for _, outcome, _ in results)
    lines = [
        "# Mutation testing",
        "",
        f"Score: **{killed}/{len(results)}** mutants killed "
        "(`python benchmarks/mutation.py`; each mutant on its own copy of the "
        "tree, only the tests listed run).",
        "",
        "| mutant | file | tests | outcome | seconds |",
        "|---|---|---|---|---|",
    ]
    for mutant, outcome, seconds in results:
        tests = " ".join(mutant.tests).replace("|", "\\|")
        lines.append(
            f"| {mutant.name} | `{mutant.path}` | `{tests}` | {outcome} | {seconds:.0f} |"
        )
    survivors = [m for m, outcome, _ in results if outcome == "survived"]
    if survivors:
        lines += ["", "## Survivors", ""]
        for mutant in survivors:
            why = mutant.equivalent or "**not explained: write the test that kills it.**"
            lines.append(f"- {mutant.name}: {why}")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant names (substrings)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args()
    mutants = [
        m for m in MUTANTS if not args.only or any(s in m.name for s in args.only)
    ]
    for mutant in mutants:  # all of them before the first run (an hour)
        check(mutant, ROOT)
    results = []
    for mutant in mutants:
        outcome, seconds = run(mutant, args.timeout)
        print(f"{outcome:9} {seconds:6.0f}s  {mutant.name}", flush=True)
        results.append((mutant, outcome, seconds))
    args.report.write_text(report(results))
    print(f"{args.report}: {report(results).splitlines()[2]}")


if __name__ == "__main__":
    main()
