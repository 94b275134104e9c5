"""``mlx_dspark prepare`` / ``train`` / ``evaluate`` on the tiny Gemma-4
target: the prepared data, frozen copies, exact resume, data parallelism
(two processes through ``mlx.launch``), gradient accumulation against
DeepSpec's formula, bf16 training against float32, and a trained drafter that
loads and decodes losslessly."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark.training import data, objective, optim
from mlx_dspark.training.evaluate import evaluate
from mlx_dspark.training.prepare import prepare
from mlx_dspark.training.train import config_from, main, parser
from mlx_dspark.training.trainer import Trainer, TrainConfig, batch_blocks, global_batch

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


def differs(a: dict, b: dict) -> bool:
    return any(not mx.array_equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("extra", ["", "--batch-size 4 --grad-accum 2", "--dtype bfloat16"])
def test_resume_gives_the_uninterrupted_parameters(prepared, tmp_path, extra):
    out, flags = tmp_path / "run", f"--steps 4 --save-every 2 {extra}"
    trainer(prepared, out, flags).run()
    uninterrupted = weights(out)
    checkpoint = out / "checkpoints" / "step-00000002"
    assert (checkpoint / "optimizer.safetensors").exists()
    (out / "model.safetensors").unlink()
    resumed = trainer(prepared, out, flags)
    resumed.run(resume=True)
    for name, value in weights(out).items():
        assert mx.array_equal(value, uninterrupted[name]), name
    # Without the optimizer state the continuation differs: the test sees it.
    fresh = trainer(prepared, out, flags)
    fresh.model.load_weights(str(checkpoint / "model.safetensors"))
    fresh.master = optim.master_copy(fresh.model)
    fresh.step = 2
    fresh.run()
    assert differs(weights(out), uninterrupted)
    if "bfloat16" in extra:
        # So does a continuation from the bf16 weights instead of the float32 masters.
        fresh = trainer(prepared, out, flags)
        fresh.restore(checkpoint)
        fresh.master = optim.master_copy(fresh.model)
        fresh.run()
        assert differs(weights(out), uninterrupted)


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


@pytest.mark.parametrize("variant,dtype", [("dspark", "float32"), ("dflash", "float32"), ("dspark", "bfloat16")])
def test_trained_drafter_loads_and_decodes_losslessly(prepared, tmp_path, variant, dtype):
    out = trainer(prepared, tmp_path / variant, f"--steps 3 --variant {variant} --dtype {dtype}").run()
    reference = DEEPSPEC_TINY / f"{variant}_tiny_gemma4_block4"
    assert set(weights(out)) == set(weights(reference))
    # DeepSpec saves its drafters in the training dtype ("dtype" in config.json).
    assert {v.dtype for v in weights(out).values()} == {getattr(mx, dtype)}
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    drafter = mlx_dspark.load_drafter(out)
    assert drafter.name == variant
    model, tokenizer = load(str(TARGET))
    prompts = [tokenizer.encode(p) for p in (prepared / "prompts.txt").read_text().splitlines()[:3]]
    report = evaluate(model, tokenizer, drafter, prompts, max_tokens=24)
    assert report["lossless"] == 3


@pytest.mark.parametrize("extra", ["", "--batch-size 4 --grad-accum 2"])
def test_two_processes_give_the_parameters_of_one(prepared, tmp_path, extra):
    launcher = Path(sys.executable).with_name("mlx.launch")
    flags = f"--model {TARGET} --data {prepared / 'data'} {TRAIN_FLAGS} --steps 3 {extra}".split()
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


def micro_batch_gradients(run, indices, step):
    """The gradients of one micro-batch's loss, normalised by its own Σ w."""
    batch, blocks = batch_blocks(run.sequences, indices, run.config, run.args, (3, step))
    loss = lambda: objective.loss(run.model, blocks, batch["hidden"], batch["last_hidden"], run.config.loss)[0]
    return nn.value_and_grad(run.model, loss)()[1]


def deepspec_step(run, step):
    """DeepSpec's accumulated step computed directly: the mean of the
    micro-batches' gradients, clipped, then AdamW at optimizer step ``step``."""
    indices = global_batch(run.train_ids, run.config, step)
    size = run.config.batch_size // run.config.grad_accum
    parts = [micro_batch_gradients(run, indices[i : i + size], step) for i in range(0, len(indices), size)]
    grads = tree_map(lambda *g: sum(g) / len(g), *parts)
    clipped, _, _ = optim.clip(grads, run.config.optim.max_grad_norm)
    run.optimizer.update(run.model, clipped)
    mx.eval(run.model.parameters())
    return grads


def relative_error(ours, theirs):
    ours, theirs = dict(tree_flatten(ours)), dict(tree_flatten(theirs))
    assert sorted(ours) == sorted(theirs)
    diff = sum(float(mx.square(ours[k] - theirs[k]).sum()) for k in ours)
    return (diff / sum(float(mx.square(v).sum()) for v in theirs.values())) ** 0.5


def test_accumulation_follows_the_mean_of_micro_batch_losses(prepared, tmp_path):
    flags = "--batch-size 4 --grad-accum 2 --epochs 2"
    run, reference = trainer(prepared, tmp_path / "a", flags), trainer(prepared, tmp_path / "b", flags)
    # 6 training sequences: one step of 4 per epoch, whatever the micro-batches.
    assert run.total_steps == 2
    grads, _ = run.gradients(0)
    expected = deepspec_step(reference, 0)
    assert relative_error(grads, expected) < 1e-6
    # One loss over the 4 sequences (normalised by their joint Σ w) is not
    # what DeepSpec optimises with accumulation: this test tells them apart.
    joint = micro_batch_gradients(trainer(prepared, tmp_path / "c", flags), global_batch(run.train_ids, run.config, 0), 0)
    assert relative_error(joint, expected) > 1e-2
    run.run()
    deepspec_step(reference, 1)
    # The schedule counts optimizer steps: 2 of them, cosine from lr to lr/2.
    assert run.optimizer.step.item() == reference.optimizer.step.item() == 2
    for name, value in tree_flatten(reference.model.parameters()):
        assert mx.allclose(weights(tmp_path / "a")[name], value, rtol=0, atol=1e-6), name


def test_bfloat16_trains_float32_masters_and_keeps_target_copies(prepared, tmp_path):
    run = trainer(prepared, tmp_path / "run", "--steps 12 --dtype bfloat16")
    target, _ = load(str(TARGET))
    embed = target.model.embed_tokens.weight.astype(mx.bfloat16)
    # DeepSpec copies the masters from the model once it is in bf16.
    model = dict(tree_flatten(run.model.trainable_parameters()))
    for name, master in tree_flatten(run.master):
        assert mx.array_equal(master, model[name].astype(mx.float32)), name
    first = run.train_step(0)
    for step in range(1, 11):
        run.train_step(step)
    last = run.train_step(11)
    assert last["ce"].item() < first["ce"].item()
    assert {v.dtype for _, v in tree_flatten(run.model.parameters())} == {mx.bfloat16}
    assert mx.array_equal(run.model.embed_tokens.weight, embed)
    assert mx.array_equal(run.model.lm_head.weight, embed)
    # AdamW and its state run on float32 masters; the model holds them in bf16.
    assert {v.dtype for _, v in tree_flatten(run.master)} == {mx.float32}
    assert {v.dtype for k, v in tree_flatten(run.optimizer.state) if k != "step"} == {mx.float32}
    model = dict(tree_flatten(run.model.trainable_parameters()))
    for name, master in tree_flatten(run.master):
        assert mx.array_equal(model[name], master.astype(mx.bfloat16)), name


def test_a_bfloat16_step_agrees_with_float32(prepared, tmp_path):
    ours, theirs = (trainer(prepared, tmp_path / d, f"--dtype {d}") for d in ("bfloat16", "float32"))
    grads, metrics = ours.gradients(0)
    expected, reference = theirs.gradients(0)
    for term in ("ce", "l1", "confidence"):
        assert abs(metrics[term].item() / reference[term].item() - 1) < 2e-3, term
    assert relative_error(tree_map(lambda g: g.astype(mx.float32), grads), expected) < 0.1
    before = [dict(tree_flatten(r.master)) for r in (ours, theirs)]
    lr = ours.train_step(0)["lr"].item()
    theirs.train_step(0)
    after = [dict(tree_flatten(r.master)) for r in (ours, theirs)]
    # Adam's first update is about lr·sign(g): where the gradient is not
    # small the float32 masters move as in float32 training. (bf16 weights
    # updated in place would lose it: a step is below a norm weight's ulp.)
    for name, g in tree_flatten(expected):
        significant = np.abs(np.array(g)) > 0.1 * np.abs(np.array(g)).max()
        moved = [np.array(a[name] - b[name]) for a, b in zip(after, before)]
        assert np.abs(moved[0] - moved[1])[significant].max() < 0.01 * lr, name


@pytest.mark.parametrize("flags,problem", [
    ("--grad-accum 0", r"grad_accum must be an integer >= 1, got 0\."),
    ("--batch-size 0", r"batch_size must be an integer >= 1, got 0\."),
    ("--batch-size 3 --grad-accum 2", r"batch_size \(3\) must be a multiple of grad_accum \(2\)"),
    ("--batch-size 8", r"6 training sequences do not make one batch of 8"),
])
def test_bad_training_settings(prepared, tmp_path, capsys, flags, problem):
    argv = f"--model {TARGET} --data {prepared / 'data'} --out {tmp_path} {TRAIN_FLAGS} {flags}"
    assert main(argv.split()) == 1
    assert re.search(f"mlx_dspark train: error: {problem}", capsys.readouterr().err)


def test_unknown_training_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float16'"):
        Trainer(str(TARGET), tmp_path / "data", tmp_path, TrainConfig(dtype="float16"))
