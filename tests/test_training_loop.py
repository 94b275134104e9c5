"""``mlx_dspark prepare`` / ``train`` / ``evaluate`` on the tiny Gemma-4
target: the prepared data, frozen copies, exact resume, data parallelism
(two processes through ``mlx.launch``) and a trained drafter that loads and
decodes losslessly."""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark.training import data
from mlx_dspark.training.evaluate import evaluate
from mlx_dspark.training.prepare import prepare
from mlx_dspark.training.train import config_from, parser
from mlx_dspark.training.trainer import Trainer

from conftest import DEEPSPEC_TINY

TARGET = DEEPSPEC_TINY / "target_tiny_gemma4"
TRAIN_FLAGS = (
    "--block-size 4 --layers 2 --num-anchors 8 --markov-rank 16 --batch-size 2 "
    "--holdout 0.25 --log-every 0 --lr 3e-3"
)


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text(
        "\n".join(" ".join(f"w{rng.randint(5, 511)}" for _ in range(rng.randint(4, 12))) for _ in range(count))
    )
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    prompts = write_prompts(folder / "prompts.txt", 8)
    prepare(str(TARGET), prompts, folder / "data", taps=[1, 2, 4], max_tokens=16,
            temperature=0.0, shard_size=3, chat_template=False)
    return folder


def trainer(folder, out, extra=""):
    args = parser().parse_args(
        f"--model {TARGET} --data {folder / 'data'} --out {out} {TRAIN_FLAGS} {extra}".split()
    )
    return Trainer(str(TARGET), folder / "data", out, config_from(args), log=lambda s: None)


def weights(folder):
    return mx.load(str(Path(folder) / "model.safetensors"))


def test_prepared_answers_mask_and_taps(prepared):
    model, tokenizer = load(str(TARGET))
    target = mlx_dspark.plugins.find_target_adapter(model).adapt(model)
    sequences = data.read_sequences(prepared / "data")
    assert len(sequences) == 8 and data.complete_shards(prepared / "data") == 3
    prompts = (prepared / "prompts.txt").read_text().splitlines()
    for prompt, seq in zip(prompts, sequences):
        ids = tokenizer.encode(prompt)
        mask = seq.loss_mask.tolist()
        assert mask == [0] * len(ids) + [1] * (len(mask) - len(ids))
        # At temperature 0 the answer is the target's own greedy output.
        greedy = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=16)]
        assert seq.input_ids.tolist() == ids + greedy[: len(mask) - len(ids)]
    out = target(sequences[0].input_ids[None], target.make_cache(1), [1, 2, 4, "final"])
    taps = mx.concatenate(out.hidden[:3], axis=-1)[0].astype(mx.bfloat16)
    assert mx.array_equal(taps, sequences[0].hidden)
    assert mx.array_equal(out.hidden[3][0].astype(mx.bfloat16), sequences[0].last_hidden)


def test_prepare_resumes_after_the_last_whole_shard(prepared, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(prepared / "data", copy)
    before = {p.name: p.read_bytes() for p in copy.glob("shard-*")}
    data.shard_path(copy, 2).unlink()
    prepare(str(TARGET), prepared / "prompts.txt", copy, taps=[1, 2, 4], max_tokens=16,
            temperature=0.0, shard_size=3, chat_template=False)
    assert {p.name: p.read_bytes() for p in copy.glob("shard-*")} == before
    with pytest.raises(ValueError, match="other settings"):
        prepare(str(TARGET), prepared / "prompts.txt", copy, taps=[1, 2], max_tokens=16,
                temperature=0.0, shard_size=3, chat_template=False)


def test_resume_gives_the_uninterrupted_parameters(prepared, tmp_path):
    out = tmp_path / "run"
    trainer(prepared, out, "--steps 4 --save-every 2").run()
    uninterrupted = weights(out)
    checkpoint = out / "checkpoints" / "step-00000002"
    assert (checkpoint / "optimizer.safetensors").exists()
    (out / "model.safetensors").unlink()
    resumed = trainer(prepared, out, "--steps 4 --save-every 2")
    resumed.run(resume=True)
    for name, value in weights(out).items():
        assert mx.array_equal(value, uninterrupted[name]), name
    # Without the optimizer state the continuation differs: the test sees it.
    (out / "model.safetensors").unlink()
    fresh = trainer(prepared, out, "--steps 4 --save-every 2")
    fresh.model.load_weights(str(checkpoint / "model.safetensors"))
    fresh.step = 2
    fresh.run()
    assert not mx.array_equal(weights(out)["fc.weight"], uninterrupted["fc.weight"])


def test_training_reduces_the_loss_and_keeps_target_copies(prepared, tmp_path):
    run = trainer(prepared, tmp_path / "run", "--steps 12")
    embed, head = mx.array(run.model.embed_tokens.weight), mx.array(run.model.lm_head.weight)
    target, _ = load(str(TARGET))
    assert mx.array_equal(embed, target.model.embed_tokens.weight)
    first = run.train_step(0)
    for step in range(1, 11):
        run.train_step(step)
    last = run.train_step(11)
    assert last["ce"].item() < first["ce"].item()
    assert mx.array_equal(run.model.embed_tokens.weight, embed)
    assert mx.array_equal(run.model.lm_head.weight, head)
    assert all(mx.array_equal(l.layer_scalar, mx.ones((1,))) for l in run.model.layers)


@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_trained_drafter_loads_and_decodes_losslessly(prepared, tmp_path, variant):
    out = trainer(prepared, tmp_path / variant, f"--steps 3 --variant {variant}").run()
    reference = DEEPSPEC_TINY / f"{variant}_tiny_gemma4_block4"
    assert set(weights(out)) == set(weights(reference))
    drafter = mlx_dspark.load_drafter(out)
    assert drafter.name == variant
    model, tokenizer = load(str(TARGET))
    prompts = [tokenizer.encode(p) for p in (prepared / "prompts.txt").read_text().splitlines()[:3]]
    report = evaluate(model, tokenizer, drafter, prompts, max_tokens=24)
    assert report["lossless"] == 3


def test_two_processes_give_the_parameters_of_one(prepared, tmp_path):
    launcher = Path(sys.executable).with_name("mlx.launch")
    flags = f"--model {TARGET} --data {prepared / 'data'} {TRAIN_FLAGS} --steps 3".split()
    one = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.cli", "train", *flags, "--out", str(tmp_path / "one")],
        capture_output=True, text=True,
    )
    assert one.returncode == 0, one.stderr
    port = str(random.Random(os.getpid()).randint(20000, 60000))
    two = subprocess.run(
        [str(launcher), "-n", "2", "--backend", "ring", "--starting-port", port, "--",
         sys.executable, "-m", "mlx_dspark.cli", "train", *flags, "--out", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=300,
    )
    assert two.returncode == 0, two.stdout + two.stderr
    assert "2 process(es)" in two.stdout + two.stderr
    ours, theirs = weights(tmp_path / "one"), weights(tmp_path / "two")
    # Each process pads its sequences to its own length, so float32 sums run
    # in another order, which Adam amplifies where a gradient is near eps:
    # no element differs by more than 5% of one step (lr 3e-3). Without the
    # all-reduce, elements differ by about four steps (1.2e-2).
    for name, value in ours.items():
        diff = np.abs(np.array(theirs[name]) - np.array(value))
        assert diff.max() < 1.5e-4, name
