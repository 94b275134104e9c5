"""What the benchmarks under ``benchmarks/`` read and replay: a report is only
as right as its parsing of the server's logs and its replayed acceptance."""

import datetime
import json
import importlib
import logging
import math
import os
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.batching.policy import Acceptance, FixedPolicy
from mlx_dspark.confidence.costs import LAUNCH_SETTINGS
from mlx_dspark.confidence.schedulers import scheduler_for
from mlx_dspark.doctor import conditional_for_tau
from mlx_dspark.integration.batch import ServerBatchGenerator
from mlx_dspark.speculative.engine import adapt_target
from mlx_dspark.speculative.pacing import Pacing
from mlx_dspark.speculative.stats import Round

from test_lossless import trained

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Imports a benchmark script as its own folder's scripts import each other."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


def test_a_variant_is_a_mode_served_with_its_own_environment(bench):
    server_load = bench("server_load")
    bases, envs = server_load.mode_table(
        ["stock", "quick"], ["quick=batched-fixed-pipelined:MLX_USE_CUDA_GRAPHS=0,A=b=c"]
    )
    assert bases["quick"] == "batched-fixed-pipelined"
    assert envs["quick"] == {
        "MLX_DSPARK_SERVER_PIPELINE": "1", "MLX_USE_CUDA_GRAPHS": "0", "A": "b=c",
    }
    refused = {
        "no name": ("=batched:A=1", "expected NAME=MODE"),
        "an unknown mode": ("x=fast:A=1", "expected NAME=MODE"),
        "a mode's own name": ("stock=batched:A=1", "expected NAME=MODE"),
        "a setting without a value": ("x=batched:A", "each setting is VAR=VALUE"),
    }
    for text, message in refused.values():
        with pytest.raises(ValueError, match=message):
            server_load.mode_table(["", "x", "stock"], [text])
    with pytest.raises(ValueError, match="list x in --modes"):
        server_load.mode_table(["stock"], ["x=batched:A=1"])
    with pytest.raises(ValueError, match="no mode fast"):
        server_load.mode_table(["stock", "fast"], [])


def test_the_load_benchmark_reads_the_servers_load_lines(bench, monkeypatch, tmp_path, caplog):
    """``server_load.load_parts`` over a log that ``ServerBatchGenerator``
    wrote in ``mlx_lm.server``'s format counts every part of every call and
    every round's split, with their times to the log's rounding."""
    monkeypatch.setattr(ServerBatchGenerator, "LOAD_LOG_SECONDS", 0.0)  # a line each call
    log = tmp_path / "server.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
    root = logging.getLogger()
    caplog.set_level(logging.DEBUG)
    root.addHandler(handler)
    model, drafter = trained("gemma4")
    generator = ServerBatchGenerator(model, drafter, policy=FixedPolicy())
    generator.insert([[5, 6, 7, 8, 9], [10, 20, 30]], max_tokens=[8, 12])
    counts, seconds, split, rounds = {}, {}, [0.0, 0.0, 0.0], 0
    try:
        while any(generator.next()):  # as the server calls it
            for kind, _, spent in generator.phases:
                counts[kind] = counts.get(kind, 0) + 1
                seconds[kind] = seconds.get(kind, 0.0) + spent
            if generator.round_split is not None:
                split = [a + b for a, b in zip(split, generator.round_split)]
                rounds += 1
    finally:
        root.removeHandler(handler)
        handler.close()

    parts = bench("server_load").load_parts(log, datetime.datetime.min)
    split_parts = dict(zip(("a round: building", "waiting", "reading"), split))
    assert rounds > 2 and set(parts) == set(counts) | set(split_parts)
    for kind, (count, spent) in parts.items():
        if kind in split_parts:  # means to 0.1 ms, a line each round
            assert count == rounds
            assert spent == pytest.approx(split_parts[kind], abs=5e-5 * rounds + 1e-9)
        else:  # means to whole ms, a line each call
            assert count == counts[kind]
            assert spent == pytest.approx(seconds[kind], abs=5e-4 * count + 1e-9)


def test_replayed_rounds_replay_the_drafters_confidences_too(bench):
    """Under replayed acceptance every draft's confidence is the logit of the
    profile's rate, so a cost schedule reads confidences that match the
    acceptance replayed; outside it, the drafter's own come back."""
    speculative = bench("speculative")
    model, drafter = trained("gemma4")
    target = adapt_target(model, drafter)
    draft_cache = drafter.make_cache()
    drafter.commit(draft_cache, target(mx.array([[5, 6, 7]]), target.make_cache(5), drafter.taps).hidden)
    rate = conditional_for_tau(3.3, drafter.block_size)

    def confidences():
        anchor = mx.array(8, mx.uint32)
        return drafter.propose(draft_cache, anchor, drafter.block_size).confidence.tolist()

    own = confidences()
    with speculative.replayed_acceptance(3.3, drafter.block_size):
        replayed = confidences()
    assert replayed == pytest.approx([math.log(rate / (1 - rate))] * drafter.block_size, abs=1e-5)
    assert own != pytest.approx(replayed, abs=1e-3) and confidences() == pytest.approx(own)


@pytest.mark.parametrize("bits, settings", [(16, {"MLX_USE_CUDA_GRAPHS": "0"}), (4, {})])
def test_paired_runs_with_the_launch_settings_the_commands_set(
    bench, monkeypatch, tmp_path, bits, settings
):
    """On MLX-CUDA ``mlx_lm.generate`` with a drafter turns CUDA graphs off
    for an unquantized target: the paired table's rows run so too (its bf16
    rows ran with them on, which no user with a drafter gets), set before
    MLX's first evaluation (where it reads them), and say so."""
    paired = bench("paired")
    for name in LAUNCH_SETTINGS:
        monkeypatch.setenv(name, "unset below; restored after")
        monkeypatch.delenv(name)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    at_first_eval, evaluate = [], mx.eval

    def recorded(*args):
        if not at_first_eval:
            at_first_eval.append({n: os.environ[n] for n in LAUNCH_SETTINGS if n in os.environ})
        return evaluate(*args)

    monkeypatch.setattr(mx, "eval", recorded)
    out = tmp_path / "paired.jsonl"
    argv = ["paired.py", "--scale", "16", "--context", "32", "--taus", "3.3", "--max-tokens", "4"]
    argv += ["--pairs", "1", "--drafters", "dspark", "--target-bits", str(bits), "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    paired.main()
    assert at_first_eval == [settings]
    assert json.loads(out.read_text())["launch_settings"] == settings


def test_paired_fresh_runs_pace_as_a_fresh_process_and_keep_the_costs(bench):
    """``--fresh``: before each speculative run the drafter's ``cost``
    scheduler forgets the acceptance and policy its generations taught it,
    so the run starts untried, as ``mlx_lm.generate``'s only generation
    does; the costs it measured stay (a fresh process reads them from
    disk). The ``fixed`` scheduler has nothing to forget."""
    paired = bench("paired")
    model, drafter = trained("gemma4")
    prompt = mx.array([5, 6, 7, 8, 9])
    list(mlx_dspark.speculative_generate_step(prompt, model, drafter, max_tokens=12, scheduler="cost"))
    scheduler = scheduler_for("cost", drafter)
    profiles = dict(scheduler.profiles)
    assert scheduler.recent_acceptance and scheduler.paced_policies and profiles
    paired.forget_pacing(drafter, "cost")
    assert not scheduler.recent_acceptance and not scheduler.paced_policies
    assert scheduler.profiles == profiles
    paired.forget_pacing(drafter, "fixed")


def test_paired_fresh_forgets_the_pacing_before_each_speculative_run(bench, monkeypatch, tmp_path):
    """``--fresh`` forgets before the warm-up and before each pair's run,
    and says so in its row."""
    paired = bench("paired")
    forgotten = []
    monkeypatch.setattr(paired, "forget_pacing", lambda *args: forgotten.append(args[1]))
    out = tmp_path / "paired.jsonl"
    argv = ["paired.py", "--scale", "16", "--context", "32", "--taus", "3.3", "--max-tokens", "4"]
    argv += ["--pairs", "2", "--drafters", "dspark", "--schedulers", "cost", "--fresh", "--out", str(out)]
    argv += ["--mlx-launch-settings"]  # none set for the rest of the process
    monkeypatch.setattr("sys.argv", argv)
    paired.main()
    assert forgotten == ["cost"] * 3 and json.loads(out.read_text())["fresh"] is True


def test_paired_rows_say_when_the_engine_verified_by_the_multirow_kernel(bench, monkeypatch, tmp_path):
    """Where the engine routes the 4-bit target (MLX-CUDA; here a stand-in
    that dequantizes takes the kernel's place), the kernel computes the
    speculative runs' verifies and the rows say how many modules it took; on
    this CPU they say nothing of it."""
    from mlx_dspark.targets import multirow

    paired = bench("paired")
    rows_seen = []

    def stand_in(x, w, scales, biases, group_size):
        rows_seen.append(x.shape[0])
        return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=4).T

    monkeypatch.setattr(multirow, "multirow_matmul", stand_in)
    monkeypatch.setattr(multirow, "kernel_faster", lambda modules, rows: True)  # not this CPU's timing
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "costs"))
    argv = ["paired.py", "--scale", "16", "--context", "32", "--taus", "6", "--max-tokens", "6"]
    argv += ["--pairs", "1", "--drafters", "dspark", "--schedulers", "fixed", "--target-bits", "4"]
    records = []
    for available in (False, True):
        monkeypatch.setattr(multirow, "available", lambda: available)
        out = tmp_path / f"paired-{available}.jsonl"
        monkeypatch.setattr("sys.argv", argv + ["--out", str(out)])
        paired.main()
        records.append(json.loads(out.read_text()))
    assert "multirow" not in records[0]
    assert records[1]["multirow"] > 0
    assert rows_seen


def test_every_mutant_names_code_that_occurs_once(bench):
    """Each mutant of ``benchmarks/mutation.py`` names its code by its text,
    which must occur once in its file, and no two mutants are one: code
    that moved fails here, in CI, not at the next mutation run."""
    mutation = bench("mutation")
    for mutant in mutation.MUTANTS:
        mutation.check(mutant, mutation.ROOT)
    assert len({(m.path, m.old, m.new) for m in mutation.MUTANTS}) == len(mutation.MUTANTS)
    assert len({m.name for m in mutation.MUTANTS}) == len(mutation.MUTANTS)


def test_batch_runs_a_4_bit_target_through_the_multirow_kernel(bench, monkeypatch, tmp_path):
    """``batch.py --target-bits 4``: the batched generator's verifies on a
    4-bit target, by the multirow kernel where the engine routes it (here a
    stand-in), and the JSON says how many modules it took."""
    from mlx_dspark.targets import multirow

    batch = bench("batch")
    rows_seen = []

    def stand_in(x, w, scales, biases, group_size):
        rows_seen.append(x.shape[0])
        return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=4).T

    monkeypatch.setattr(multirow, "multirow_matmul", stand_in)
    monkeypatch.setattr(multirow, "kernel_faster", lambda modules, rows: True)  # not this CPU's timing
    monkeypatch.setattr(multirow, "available", lambda: True)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "batch.json"
    argv = ["batch.py", "--scale", "16", "--context", "16", "--max-tokens", "4", "--repeats", "1"]
    argv += ["--batch", "2", "--only", "spec-fixed", "--target-bits", "4", "--json", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    batch.main()
    report = json.loads(out.read_text())
    assert report["args"]["target_bits"] == 4 and report["multirow"] > 0
    assert report["results"][0]["spec-fixed"] > 0
    assert rows_seen and max(rows_seen) <= 8


def test_paired_splits_the_time_lost_by_kind_of_round(bench):
    """Each round's seconds run from the first token of the round before (a
    generation's first, from the prompt's token) to its own; a kind's loss
    is its seconds less plain decoding's for its tokens, as a share of the
    runs' time, so the shares add up to the runs' loss against plain."""
    paired = bench("paired")

    def r(drafts, accepted):
        return Round(0, 0, [1] * drafts, None, drafts, accepted, 2)

    rounds = [r(0, 0), r(0, 0), r(6, 3), r(6, 1), r(0, 0)]
    # 10 ms a plain token; rounds of 10, 12, 60, 25, 15 ms.
    stamps = [0.010, 0.022, 0.082, 0.107, 0.122]
    lost = paired.rounds_lost([(rounds, 0.0, stamps)], 0.010)
    assert lost.pop("slowest")[:2] == [
        {"generation": 0, "round": 2, "kind": "drafting after parked", "ms": 60.0},
        {"generation": 0, "round": 3, "kind": "drafting", "ms": 25.0},
    ]
    assert lost == {
        "parked": {"rounds": 2, "median_ms": 11.0, "lost_share": round(0.002 / 0.122, 4)},
        "drafting after parked": {"rounds": 1, "median_ms": 60.0, "lost_share": round(0.02 / 0.122, 4)},
        "drafting": {"rounds": 1, "median_ms": 25.0, "lost_share": round(0.005 / 0.122, 4)},
        "parked after drafting": {"rounds": 1, "median_ms": 15.0, "lost_share": round(0.005 / 0.122, 4)},
    }
    total = sum(kind["lost_share"] for kind in lost.values())
    assert total == pytest.approx((0.122 - 9 * 0.010) / 0.122, abs=1e-3)
    first = paired.rounds_lost([([r(6, 6)], 0.0, [0.02])], 0.010)
    assert list(first) == ["drafting after parked", "slowest"]


def test_paired_reads_each_pairs_bound_against_its_own_timings(bench):
    """Each pair's speedup is read against the bound from its own plain run,
    component timings and tau: the middle pair ran everything 1.5x slower (a
    change of speed mode), the last accepted less. Their quotients (0.90,
    1.00, 1.20) are neither pooled (0.96) nor read against the first pair's
    timings (the slow pair at 0.67)."""
    paired = bench("paired")
    fast = (100.0, 180.0, 0.020, 0.005, 5.0)  # bound 2.0, speedup 1.8
    slow = (100.0 / 1.5, 200.0 / 1.5, 0.030, 0.0075, 5.0)  # bound 2.0, speedup 2.0
    poor = (100.0, 192.0, 0.020, 0.005, 4.0)  # bound 1.6, speedup 1.92
    report = paired.bounds([fast, slow, poor])
    assert report["bound_speedup"] == pytest.approx(2.0)
    assert report["speedup_over_bound"] == pytest.approx(1.0)
    assert report["speedup_over_bound_range"] == pytest.approx([0.9, 1.2])
    assert (report["t_verify_ms"], report["t_draft_ms"]) == pytest.approx((20.0, 5.0))


def test_paired_bound_is_never_under_plain_decoding(bench):
    """A pair whose drafting every round would be slower than plain decoding
    (tau 3 at 40 ms a round against 10 ms a token: 0.75x) is read against
    plain decoding, which a parked round reaches, not against 0.75x."""
    paired = bench("paired")
    parked = (100.0, 98.0, 0.035, 0.005, 3.0)
    report = paired.bounds([parked])
    assert report["bound_speedup"] == pytest.approx(1.0)
    assert report["speedup_over_bound"] == pytest.approx(0.98)


def test_paired_bound_reads_the_tau_of_the_drafting_rounds(bench):
    """A pair that drafted in half its rounds or more is read at its drafting
    rounds' tau (its parked rounds' single tokens left out); one that drafted
    in fewer, at the replayed tau (two probes say little)."""
    paired = bench("paired")

    def r(drafts, accepted):
        return Round(0, 0, [1] * drafts, None, drafts, accepted, 2)

    half = [r(6, 3), r(0, 0), r(6, 1), r(0, 0)]
    assert paired.drafted_tau(half, 3.3) == pytest.approx(3.0)
    probes = [r(6, 6), r(6, 6)] + [r(0, 0)] * 5
    assert paired.drafted_tau(probes, 3.3) == pytest.approx(3.3)


def test_components_time_the_verify_at_the_row_count_the_engine_pads_to(
    bench, tiny_pair, monkeypatch
):
    """On a jagged cost curve (5-7 rows 50 ms, 8 or more 29 ms, as a 4-bit
    target's on MLX-CUDA) the bound's verify of 4 drafts is the 8 rows the
    engine pads them to, not the 5 rows of the round itself."""
    speculative = bench("speculative")
    model, _, drafter = tiny_pair
    timed = []

    def seconds(fn, repeats=10, warmup=2):
        first, _ = fn()
        if first.ndim == 3:  # a verify's logits: (1, rows, vocabulary)
            rows = first.shape[1]
            timed.append((rows, repeats))
            return 0.050 if rows < 8 else 0.029
        return 0.002

    monkeypatch.setattr(speculative, "seconds", seconds)
    prompt = mx.array([5, 6, 7, 8, 9, 10], mx.uint32)
    t_verify, t_draft = speculative.components(model, drafter, prompt, 4)
    assert (t_verify, t_draft) == (0.029, 0.002)
    assert timed[-1] == (8, 10)


def test_paired_times_the_components_before_each_pair(bench, monkeypatch, tmp_path):
    """Two pairs, two timings of the draft and the verify, each pair's own."""
    paired = bench("paired")
    timings = iter([(0.010, 0.002), (0.020, 0.004)])
    calls = []

    def components(*args):
        calls.append(args)
        return next(timings)

    monkeypatch.setattr(paired, "components", components)
    out = tmp_path / "paired.jsonl"
    argv = ["paired.py", "--scale", "16", "--context", "32", "--taus", "3.3", "--max-tokens", "4"]
    argv += ["--pairs", "2", "--drafters", "dspark", "--target-bits", "4", "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    paired.main()
    row = json.loads(out.read_text())
    assert len(calls) == 2
    assert (row["t_verify_ms"], row["t_draft_ms"]) == pytest.approx((15.0, 3.0))


def test_paired_probe_share_binds_the_policys_probes_not_its_cap(bench, monkeypatch):
    """``--probe-share 0.01``: a probe losing 19 ms a round against 10 ms plain
    rounds comes every 512 parked rounds where the policy's own 0.03 has it
    every 128 (never past the longest interval, which grows to 1024 so the
    share binds); 0.03 given leaves the policy as it is."""
    from mlx_dspark.batching import policy

    paired = bench("paired")
    for name in ("PROBE_SHARE", "REPROBE_AT_MOST"):
        monkeypatch.setattr(policy, name, getattr(policy, name))
    assert policy.reprobe_every(0.019, 0.010, 2) == 128
    paired.set_probe_share(0.03)
    assert (policy.PROBE_SHARE, policy.REPROBE_AT_MOST) == (0.03, 256)
    paired.set_probe_share(0.01)
    assert (policy.PROBE_SHARE, policy.REPROBE_AT_MOST) == (0.01, 1024)
    assert policy.reprobe_every(0.019, 0.010, 2) == 512
    paired.set_probe_share(0.03)  # from the policy's own, not the last share set
    assert (policy.PROBE_SHARE, policy.REPROBE_AT_MOST) == (0.03, 256)


def test_paired_refuses_two_target_precisions_in_one_process(bench, monkeypatch, capsys):
    """MLX reads its launch settings once a process and the commands' differ
    by target precision."""
    monkeypatch.setattr("sys.argv", ["paired.py", "--target-bits", "16", "4"])
    with pytest.raises(SystemExit):
        bench("paired").main()
    assert "one --target-bits a process" in capsys.readouterr().err


def test_the_table_reads_each_paired_row_against_the_issues_goal(bench):
    """A speedup below 1.0 is slower than plain unless plain decoding moved as
    much between its own pairs; a bf16 row under 0.95 of its bound and the
    4-bit assistant at chat acceptance under 1.2x miss the goal too."""
    table = bench("table")
    row = {
        "context": 2048, "target_bits": 16, "drafter": "dspark", "replayed_tau": 3.3,
        "scheduler": "cost", "plain_tok_s": 92.0, "spec_tok_s": 180.0, "speedup": 1.96,
        "speedup_range": [1.5, 2.1], "plain_vs_plain_range": [0.99, 1.01],
        "bound_speedup": 1.8, "speedup_over_bound": 1.09,
        "round_phase_ms": {"verify": 16.7, "draft": 3.8, "host": 1.0},
    }
    assert table.verdicts(row) == []
    assert table.markdown(row).endswith("| 16.7 + 3.8, 1.0 | met |")
    per_pair = dict(row, speedup_over_bound_range=[0.97, 1.12])
    assert "| 1.09 (0.97-1.12) | 16.7 + 3.8, 1.0 | met |" in table.markdown(per_pair)
    assert "| `cost`, probes 0.01 |" in table.markdown(dict(row, probe_share=0.01))
    assert "| `cost`, fresh |" in table.markdown(dict(row, fresh=True))
    assert "| `cost`, multirow kernel |" in table.markdown(dict(row, multirow=True))
    # Launch settings other than the commands' own for the target are named.
    assert "| `cost` |" in table.markdown(dict(row, launch_settings={"MLX_USE_CUDA_GRAPHS": "0"}))
    cache = {"MLX_CUDA_GRAPH_CACHE_SIZE": "4000"}
    assert "| `cost`, MLX_CUDA_GRAPH_CACHE_SIZE=4000 |" in table.markdown(dict(row, target_bits=4, launch_settings=cache))
    graphs_off_4bit = dict(row, target_bits=4, launch_settings={"MLX_USE_CUDA_GRAPHS": "0"})
    assert "| `cost`, MLX_USE_CUDA_GRAPHS=0 |" in table.markdown(graphs_off_4bit)
    assert table.verdicts(dict(row, speedup=0.97)) == ["slower than plain"]
    noisy = dict(row, speedup=0.97, plain_vs_plain_range=[0.95, 1.05])
    assert table.verdicts(noisy) == ["below 1.0, within plain's noise"]
    assert table.verdicts(dict(row, speedup_over_bound=0.94)) == ["under 0.95 of its bound"]
    assert table.verdicts(dict(row, target_bits=4, speedup_over_bound=0.5)) == []
    assistant = dict(row, target_bits=4, drafter="assistant", speedup=1.1)
    assert table.verdicts(assistant) == ["under 1.2x"]
    assert table.verdicts(dict(assistant, replayed_tau=6.0)) == []


def test_quantized_rows_reads_a_forward_against_one_row(bench, capsys):
    """A forward's matmuls are each shape's (per copy) times the depth, plus
    the head once; each row count is read against one row; copies of a
    shape reach four times the cache. The script runs end to end at a small
    scale."""
    quantized_rows = bench("quantized_rows")
    report = {"q_proj": {1: 1.0, 8: 3.0}, "down_proj": {1: 1.0, 8: 1.0}, "lm_head": {1: 1.0, 8: 3.0}}
    # Per layer 2 ms at one row, 4 ms at 8; ten layers.
    forward = quantized_rows.rows_against_one(report, depth=10)
    assert forward == {1: {"ms": 21.0, "vs_one_row": 1.0}, 8: {"ms": 43.0, "vs_one_row": round(43 / 21, 3)}}
    assert [quantized_rows.copies_beyond(50, n) for n in (30, 200, 201)] == [7, 1, 1]
    argv = ["--scale", "60", "--cache-mb", "0", "--rows", "1", "2", "--repeats", "1", "--bits", "4"]
    quantized_rows.main(argv)
    line = json.loads(capsys.readouterr().out)
    assert (line["bits"], sorted(line["forward"]), line["forward"]["1"]["vs_one_row"]) == (4, ["1", "2"], 1.0)


def test_quantized_rows_chains_each_matmul_on_the_one_before(bench):
    """Each matmul of a chain reads the outputs of the one before (on a GPU
    a chain whose links wait for nothing runs them side by side): a chain
    with a zero weight anywhere ends in zeros, and every link's rows reach
    the next at the chain's input width, wider or narrower."""
    quantized_rows = bench("quantized_rows")
    x = mx.ones((1, 2, 64))
    narrow, wide = mx.ones((32, 64)) / 8, mx.ones((128, 64)) / 8
    ones = quantized_rows.chained(x, [narrow, wide], bits=16)
    assert ones.shape == (1, 2, 64) and mx.all(ones > 0).item()
    zeros = quantized_rows.chained(x, [mx.zeros((32, 64)), wide], bits=16)
    assert zeros.shape == (1, 2, 64) and not mx.any(zeros).item()


def tiny_4bit_target(bench, group_size: int = 64):
    """The tiny Gemma-4 target, 4-bit, loaded afresh (a test changes it)."""
    from mlx_lm import load

    from conftest import DEEPSPEC_TINY

    model, _ = load(str(DEEPSPEC_TINY / "target_tiny_gemma4"))
    bench("shapes").quantize(model, 4, group_size=group_size)
    return model


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def prompt_and_verify_logits(model, prompt):
    """``model``'s logits over ``prompt`` and then a verify of 5 rows on
    its cache (float32, on the CPU)."""
    from mlx_lm.models.cache import make_prompt_cache

    with mx.stream(mx.cpu):
        cache = make_prompt_cache(model)
        first = model(prompt, cache=cache)
        out = mx.concatenate([first, model(mx.array([[8, 9, 10, 11, 12]]), cache=cache)], axis=1)
        mx.eval(out)
        return out


def test_split_k_computes_the_same_logits_in_the_same_memory(bench):
    """The tiny target, 4-bit in groups of 32, with every layer's quantized
    projections split along their inputs into two summed matmuls: each one
    split, the same logits within float32 rounding over a prompt and a
    verify of 5 rows, the same weight bytes, and no more memory held (the
    originals go); a projection of 3 groups stays as it was."""
    import mlx.nn as nn

    split_k = bench("split_k")
    model = tiny_4bit_target(bench, group_size=32)
    prompt = mx.random.randint(0, 500, (1, 300), key=mx.random.key(0))
    before, bytes_before = prompt_and_verify_logits(model, prompt), weight_bytes(model)
    projections = sum(
        isinstance(m, nn.QuantizedLinear)
        for layer in model.model.layers
        for block in (layer.self_attn, layer.mlp)
        for m in block.children().values()
    )
    three_groups = nn.QuantizedLinear(96, 16, bias=False, group_size=32, bits=4)
    model.model.layers[0].mlp.three_groups = three_groups
    mx.eval(model.parameters())
    held_before = mx.get_active_memory()
    assert split_k.split_projections(model.model, 2) == projections > 0
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, split_k.SplitK) and isinstance(layer.self_attn.q_proj, split_k.SplitK)
    assert layer.mlp.three_groups is three_groups
    mx.eval(model.parameters())
    assert mx.get_active_memory() <= held_before + 64 * 1024
    del layer.mlp.three_groups
    assert mx.allclose(prompt_and_verify_logits(model, prompt), before, rtol=1e-4, atol=1e-4)
    assert weight_bytes(model) == bytes_before


def test_pacing_sim_reads_drafting_every_round_and_the_engines_pacing(bench, tmp_path, monkeypatch):
    """The simulation's profile is read at its deepest bucket measured in
    full, its one-draft cost kept; drafting every round is the replayed
    tau's tokens over a round's unpadded verify (as ``fixed`` runs it), draft
    and extra time; the pacing itself (the engine's) parks where drafting
    never pays and drafts where it pays by half; ``--decay`` is the drafter's
    acceptance's (every generation's a newcomer of it), within (0, 1];
    ``--fresh`` counts the first generation, which otherwise warms up."""
    pacing_sim = bench("pacing_sim")
    # 8 rows 16 ms, 7 rows 17, 2-6 rows 18: every count's cost its own.
    curve = [0.010, 0.018, 0.018, 0.018, 0.018, 0.018, 0.017, 0.016] + [0.019] * 8
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "2048": {"draft": 0.004, "draft_one": 0.001, "verify": curve, "drafts": 7},
        "4096": {"draft": 0.004, "verify": curve[:2], "drafts": 7, "next_length": 3},  # under way
    }))
    costs = pacing_sim.load_costs(profile, None)
    assert (costs.verify, costs.draft_one, costs.drafts) == (curve, 0.001, 7)
    base = ["--profile", str(profile), "--plain-ms", "10", "--drafting-extra-ms", "2",
            "--spread", "0", "--generations", "3", "--seeds", "2"]
    pays = pacing_sim.main(base + ["--taus", "6"])
    # 6 tokens a round of 16 + 4 + 2 ms (8 rows) against 10 ms a token.
    assert pays["fixed_vs_plain"] == pytest.approx(6 * 10 / 22, rel=1e-3)
    assert pays["drafted_share"] > 0.9
    assert pays["paced_vs_plain"] > 0.9 * pays["fixed_vs_plain"]
    never = pacing_sim.main(base + ["--taus", "1.3"])
    assert never["fixed_vs_plain"] < 0.6
    assert never["drafted_share"] < 0.15 and never["paced_vs_plain"] > 0.85
    assert never["runs_under_plain"] == 2 and pays["runs_under_plain"] == 0
    # A warm-up generation first, uncounted, unless --fresh counts the first.
    paced = []
    monkeypatch.setattr(pacing_sim, "Pacing", lambda *a: paced.append(Pacing(*a)) or paced[-1])
    pacing_sim.main(base + ["--taus", "6"])
    first = pacing_sim.main(base + ["--taus", "6", "--fresh", "--generations", "1"])
    assert len(paced) == 2 * 4 + 2 * 1 and first["drafted_share"] > 0.8
    decays = []

    def recorded(positions, decay):
        decays.append(decay)
        return Acceptance(positions, decay=decay)

    monkeypatch.setattr(pacing_sim, "Acceptance", recorded)
    pacing_sim.main(base + ["--taus", "6", "--decay", "0.5"])
    assert decays == [0.5, 0.5]  # one drafter a seed
    for decay in ["0", "1.5"]:
        with pytest.raises(SystemExit):
            pacing_sim.main(base + ["--decay", decay])


def test_pacing_sim_charges_each_change_of_shape_once(bench, monkeypatch):
    """A drafting round right after plain ones costs ``after_parked`` more,
    a plain round right after drafting ones ``after_drafting`` more, and a
    generation's first round neither: with rounds that alternate, the paced
    time grows by exactly the changes of each kind (the acceptance drawn the
    same, so plain decoding's time is too)."""
    pacing_sim = bench("pacing_sim")
    generations = []

    class Alternating:
        def __init__(self, *args):
            generations.append([])

        def drafts(self, cap, depth):
            rounds = generations[-1]
            rounds.append(0 if rounds and rounds[-1] else cap)
            return rounds[-1]

        def verifies(self, *args):
            pass

        def update(self, *args):
            pass

    monkeypatch.setattr(pacing_sim, "Pacing", Alternating)
    costs = pacing_sim.RoundCosts(0.004, [0.010, 0.016, 0.016, 0.016], None, 3)

    def paced(after_parked=0.0, after_drafting=0.0):
        """Paced time over plain decoding's, and each kind of change."""
        generations.clear()
        plain_over_paced, *_ = pacing_sim.simulate(
            costs, 3, [6.0], 0.010, 0.0, after_parked, 0.0, 2, 20, 0,
            fresh=True, after_drafting=after_drafting,
        )
        pairs = [(a, b) for g in generations for a, b in zip(g, g[1:])]
        into_drafting = sum(1 for a, b in pairs if a == 0 and b > 0)
        into_plain = sum(1 for a, b in pairs if a > 0 and b == 0)
        return 1 / plain_over_paced, into_drafting, into_plain

    base, into_drafting, into_plain = paced()
    assert len(generations) == 2 and into_drafting > 0 and into_plain > 0
    with_parked, *_ = paced(after_parked=0.05)
    with_drafting, *_ = paced(after_drafting=0.07)
    # Both in units of plain decoding's time, the same in each run.
    assert (with_parked - base) / (with_drafting - base) == pytest.approx(
        into_drafting * 0.05 / (into_plain * 0.07)
    )


def test_fused_projections_compute_the_same_logits_in_the_same_memory(bench):
    """The tiny target, 4-bit, with each layer's q/k/v and gate/up fused:
    the same logits bit for bit (float32, on the CPU) over a prompt and a
    verify of 5 rows, the same weight bytes (the weights moved, not copied),
    and, once a forward's outputs are freed, no more memory held than before
    (a fused projection lets go of its last input and outputs)."""
    import mlx.nn as nn

    fused_projections = bench("fused_projections")
    model = tiny_4bit_target(bench)
    prompt = mx.random.randint(0, 500, (1, 512), key=mx.random.key(0))

    def held_after_a_forward():
        mx.eval(model(prompt))
        return mx.get_active_memory()

    before, bytes_before = prompt_and_verify_logits(model, prompt), weight_bytes(model)
    held_before = held_after_a_forward()
    fused_projections.fuse_projections(model.model)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_fused.linear, nn.QuantizedLinear)
    assert isinstance(layer.self_attn.q_proj, fused_projections.Part)
    assert mx.array_equal(prompt_and_verify_logits(model, prompt), before)
    assert weight_bytes(model) == bytes_before
    # (The fused weights' buffers may round up a few kB more than the
    # originals'; a 512-token forward's outputs held would be MBs.)
    assert held_after_a_forward() <= held_before + 64 * 1024
