"""DeepSpec's training objective, exact against the reference trainer on a
fixed batch (float32 oracle in fixtures/deepspec-train-tiny): the block
inputs and mask, each loss term, the gradients, the clipping and two AdamW
steps, for DSpark and DFlash."""

import functools
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

import mlx_dspark
from mlx_dspark.training import objective, optim
from mlx_dspark.training.blocks import make_blocks, sample_anchors

from conftest import DEEPSPEC_TINY, FIXTURES

ORACLE = FIXTURES / "deepspec-train-tiny"
MANIFEST = json.loads((ORACLE / "manifest.json").read_text())
VARIANTS = ["dspark", "dflash"]


def arrays(file):
    return {k: mx.array(v) for k, v in load_file(str(ORACLE / file)).items()}


BATCH = arrays("batch.safetensors")


def reference(variant):
    return arrays(f"{variant}.safetensors"), MANIFEST["variants"][variant]


def close(ours, ref, atol, rtol=0.0):
    np.testing.assert_allclose(np.array(ours), np.array(ref), atol=atol, rtol=rtol)


def drafter(variant):
    model = mlx_dspark.load_drafter(
        DEEPSPEC_TINY / f"{variant}_tiny_gemma4_block4"
    ).model
    optim.freeze_target_copies(model)
    return model


def oracle_blocks(variant):
    tensors, _ = reference(variant)
    return make_blocks(
        BATCH["input_ids"],
        BATCH["loss_mask"],
        tensors["anchor_positions"],
        tensors["block_keep_mask"],
        block_size=MANIFEST["batch"]["block_size"],
        mask_token_id=MANIFEST["batch"]["mask_token_id"],
    )


def loss_config(variant):
    return objective.LossConfig(**reference(variant)[1]["loss_config"])


def optim_config(variant):
    train = reference(variant)[1]["train_config"]
    return optim.OptimConfig(
        **{k: train[k] for k in ("lr", "warmup_ratio", "weight_decay", "max_grad_norm", "total_steps")}
    )


def loss_of(model, blocks, variant):
    return objective.loss(
        model,
        blocks,
        BATCH["target_hidden_states"],
        BATCH["target_last_hidden_states"],
        loss_config(variant),
    )


@functools.lru_cache(maxsize=None)
def two_steps(variant):
    """The reference's two steps: loss, gradients, clip, AdamW (same batch)."""
    model = drafter(variant)
    blocks = oracle_blocks(variant)
    config = optim_config(variant)
    optimizer = optim.make_optimizer(config)
    value_and_grad = nn.value_and_grad(model, lambda: loss_of(model, blocks, variant)[0])
    params = [dict(tree_flatten(model.parameters()))]
    steps = []
    for step in range(2):
        loss, grads = value_and_grad()
        clipped, norm, coef = optim.clip(grads, config.max_grad_norm)
        lr = optim.learning_rate(config, optimizer.step.item())
        optimizer.update(model, clipped)
        mx.eval(model.parameters())
        params.append(dict(tree_flatten(model.parameters())))
        steps.append(dict(loss=loss, grads=dict(tree_flatten(grads)), norm=norm, coef=coef, lr=lr))
    return steps, params


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_inputs_positions_and_mask(variant):
    tensors, _ = reference(variant)
    blocks = oracle_blocks(variant)
    for ours, ref in [
        (blocks.inputs, "noise_ids"),
        (blocks.position_ids, "position_ids"),
        (blocks.mask, "attention_mask_dense"),
        (blocks.labels, "target_ids"),
        (blocks.prev, "prev_token_ids"),
        (blocks.eval_mask, "eval_mask"),
    ]:
        assert np.array_equal(np.array(ours).astype(np.int64), np.array(tensors[ref])), ref


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_loss_terms(variant):
    tensors, manifest = reference(variant)
    model = drafter(variant)
    blocks = oracle_blocks(variant)
    total, (parts, terms, outputs) = loss_of(model, blocks, variant)
    b, n, B = blocks.labels.shape
    close(outputs.hidden.reshape(b, n * B, -1), tensors["block_hidden_after_final_norm"], 2e-5)
    close(outputs.logits, tensors["draft_logits"], 2e-5)
    close(terms["ce"], tensors["ce_per_token"], 1e-5)
    close(terms["l1"], tensors["l1_per_token"], 1e-5)
    close(terms["accept"], tensors["accept_rate_target"], 1e-5)
    weights = objective.slot_weights(blocks, loss_config(variant).loss_decay_gamma)
    close(weights, tensors["loss_weight_mask"], 1e-7)
    components = manifest["steps"][0]["components"]
    close(parts["ce"], components["ce_loss"], 0, 1e-6)
    if variant == "dspark":
        close(outputs.confidence, tensors["confidence_pred"], 1e-5)
        close(terms["bce"], tensors["bce_per_token"], 1e-5)
        close(parts["l1"], components["l1_loss"], 0, 1e-6)
        close(parts["confidence"], components["confidence_loss"], 0, 1e-6)
    else:
        # DFlash skips the L1 and confidence terms (alpha 0), no head.
        assert outputs.confidence is None and set(parts) == {"ce"}
    close(total, manifest["steps"][0]["loss"], 0, 1e-6)


def test_dummy_blocks_are_finite_and_weightless():
    """Row 1 has two dummy blocks, whose attention sees no key: MLX would
    give NaN there; the forward gives finite values and zero weight."""
    blocks = oracle_blocks("dspark")
    assert not np.array(blocks.keep).all()
    _, (_, _, outputs) = loss_of(drafter("dspark"), blocks, "dspark")
    assert np.isfinite(np.array(outputs.logits)).all()
    assert not np.array(blocks.eval_mask)[~np.array(blocks.keep)].any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_of_every_trainable_tensor(variant):
    tensors, manifest = reference(variant)
    steps, _ = two_steps(variant)
    grads = steps[0]["grads"]
    assert sorted(grads) == sorted(p["name"] for p in manifest["trainable_params"])
    for name, grad in grads.items():
        ref = tensors[f"grad.{name}"]
        scale = float(mx.abs(ref).max())
        close(grad, ref, atol=1e-5 * scale)
        assert float(mx.abs(grad).max()) > 0, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_clip_and_learning_rate(variant):
    _, manifest = reference(variant)
    steps, _ = two_steps(variant)
    for ours, ref in zip(steps, manifest["steps"]):
        close(ours["loss"], ref["loss"], 0, 2e-6)
        close(ours["norm"], ref["grad_norm_before_clip"], 0, 2e-6)
        close(ours["coef"], ref["clip_coef"], 0, 2e-6)
        close(ours["lr"], ref["lr_used"], 0, 1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameters_after_two_steps(variant):
    tensors, manifest = reference(variant)
    steps, params = two_steps(variant)
    initial, step1, step2 = params
    for frozen in ("embed_tokens.weight", "lm_head.weight"):
        assert mx.array_equal(step2[frozen], initial[frozen])
    for name, grad in steps[0]["grads"].items():
        ref = tensors[f"step1.{name}"]
        # Adam moves every element by about lr; where the gradient is as
        # small as eps the direction is float32 noise in both trainers.
        significant = np.abs(np.array(tensors[f"grad.{name}"])) > 1e-6
        diff = np.abs(np.array(step1[name]) - np.array(ref))
        assert diff[significant].max(initial=0) < 1e-6, name
        assert diff.max() < 0.1 * manifest["steps"][0]["lr_used"], name
        stats = manifest["steps"][1]["param_stats_after_step"][name]
        p2 = np.array(step2[name], np.float64)
        close(p2.sum(), stats["sum"], 1e-3, 1e-4)
        close(np.sqrt((p2**2).sum()), stats["l2"], 0, 1e-5)
        update = manifest["steps"][1]["update_stats_vs_step1"][name]
        delta = p2 - np.array(step1[name], np.float64)
        close(np.abs(delta).sum(), update["abs_sum"], 0, 1e-3)


def test_anchors_are_valid_sorted_and_dummies_last():
    mask = np.array(BATCH["loss_mask"])
    anchors, keep = sample_anchors(mask, 8, np.random.default_rng(0))
    for row, a, k in zip(mask, anchors, keep):
        chosen = a[k]
        assert (np.diff(chosen) > 0).all() and row[chosen].all() and row[chosen + 1].all()
        assert (a[~k] == 0).all() and not k[k.argmin():].any() or k.all()
    # Row 1 has 6 candidates (positions 41..46): all of them, then 2 dummies.
    assert anchors[1].tolist() == [41, 42, 43, 44, 45, 46, 0, 0]
