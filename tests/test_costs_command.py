"""``mlx_dspark costs``: what it measures ahead is what the server's batch
policy and a single stream's ``cost`` scheduler read, so their first
requests measure nothing."""

import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_dspark import SpeculativeStats, speculative_generate_step
from mlx_dspark.batching import measure
from mlx_dspark.checkpoints import load_drafter
from mlx_dspark.integration.batch import ServerBatchGenerator

from test_doctor import DSPARK, TARGET


def serve_two_requests(model, drafter) -> float:
    """Two requests served together as the server serves them (the default,
    ``cost`` policy); the seconds its rounds spent measuring costs."""
    generator = ServerBatchGenerator(model, drafter)
    generator.insert([list(range(5, 305)), list(range(9, 250))], max_tokens=[12, 20])
    finished = 0
    while finished < 2:
        _, responses = generator.next()
        finished += sum(r.finish_reason is not None for r in responses)
    return generator._measuring


def test_costs_measured_ahead_are_the_ones_the_servers_batch_policy_reads(
    monkeypatch, tmp_path, capsys
):
    model, _ = load(str(TARGET))
    drafter = load_drafter(str(DSPARK))
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "fresh"))
    assert serve_two_requests(model, drafter) > 0  # a fresh machine measures as it serves

    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "ahead"))
    # Prompts prefilled one at a time (as 16 would be, 8 at a time) all join
    # the batch before it is measured.
    monkeypatch.setattr(measure, "PREFILL_BATCH", 1)
    argv = ["--model", str(TARGET), "--draft-model", str(DSPARK), "--batch", "1", "2", "--context", "512"]
    assert measure.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "a single stream, depth bucket    512",
        "batch   1, depth bucket    512",
        "batch   2, depth bucket    512",
    ]
    assert all("measured in" in line for line in lines)
    assert serve_two_requests(model, drafter) == 0

    assert measure.main(argv) == 0  # measured once per machine
    assert all("(kept)" in line for line in capsys.readouterr().out.splitlines())


def stream_timings(model, drafter) -> int:
    """A greedy generation under the scheduler a drafter is loaded with by
    default (``cost``); how many times its profile timed costs."""
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    steps = speculative_generate_step(
        mx.array(list(range(5, 45))), model, drafter, max_tokens=24, stats=stats
    )
    assert len(list(steps)) == 24 and stats.scheduler == "cost"
    return sum(profile.timings for profile in drafter.scheduler.profiles.values())


def test_costs_measured_ahead_are_the_ones_a_single_streams_first_generation_reads(
    monkeypatch, tmp_path, capsys
):
    model, _ = load(str(TARGET))
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "fresh"))
    assert stream_timings(model, load_drafter(str(DSPARK))) > 0  # a fresh machine measures

    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "ahead"))
    argv = ["--model", str(TARGET), "--draft-model", str(DSPARK), "--batch", "1", "--context", "512"]
    assert measure.main(argv) == 0
    assert "a single stream, depth bucket    512 (measured in" in capsys.readouterr().out
    assert stream_timings(model, load_drafter(str(DSPARK))) == 0


def test_costs_run_again_prefill_no_bucket_after_the_first_that_is_kept(
    monkeypatch, tmp_path, capsys
):
    """A second run, to a deeper context, measures the new bucket only, and a
    third measures nothing; neither prefills a kept bucket's prompt but the
    first one's (the generation that finds the profile's key)."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    prompts = []
    generate = measure.speculative_generate_step
    monkeypatch.setattr(
        measure, "speculative_generate_step",
        lambda prompt, *a, **k: prompts.append(prompt.size) or generate(prompt, *a, **k),
    )
    argv = ["--model", str(TARGET), "--draft-model", str(DSPARK), "--batch", "1", "--context"]
    assert measure.main(argv + ["512"]) == 0
    assert measure.main(argv + ["1024"]) == 0
    assert prompts == [384, 384, 768]
    out = capsys.readouterr().out
    assert "a single stream, depth bucket   1024 (measured in" in out
    assert measure.main(argv + ["1024"]) == 0
    assert prompts == [384, 384, 768, 384]
    stream = [line for line in capsys.readouterr().out.splitlines() if "single stream" in line]
    assert len(stream) == 2 and all("(kept)" in line for line in stream)


def test_depth_buckets_up_to_the_context():
    assert measure.buckets(1) == [512]
    assert measure.buckets(512) == [512]
    assert measure.buckets(513) == [512, 1024]
    assert measure.buckets(4096) == [512, 1024, 2048, 4096]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch", "3", "8"], "--batch takes powers of two (the sizes the server measures), not 3"),
        (["--batch", "0"], "not 0"),
        (["--context", "0"], "--context must be positive"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    argv = ["--model", str(TARGET), "--draft-model", str(DSPARK), *flags]
    assert measure.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlx_dspark costs: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_drafter_is_a_one_line_error(tmp_path, capsys):
    argv = ["--model", str(TARGET), "--draft-model", str(tmp_path / "nothing")]
    assert measure.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlx_dspark costs: error: No checkpoint directory at ")
