"""Loading drafter checkpoints: layouts, dtypes and the Hub cache."""

import mlx.core as mx

import mlx_dspark

from conftest import DEEPSPEC_TINY

DSPARK = DEEPSPEC_TINY / "dspark_tiny_gemma4_block4"


def same_drafts(a, b):
    anchor = mx.array(62)
    features = [mx.ones((1, 3, 192))]
    ca, cb = a.make_cache(), b.make_cache()
    a.commit(ca, features)
    b.commit(cb, features)
    return (
        a.propose(ca, anchor, 4).tokens.tolist()
        == b.propose(cb, anchor, 4).tokens.tolist()
    )


def test_sharded_checkpoint_loads(checkpoint):
    weights = mx.load(str(checkpoint / "model.safetensors"))
    names = sorted(weights)
    (checkpoint / "model.safetensors").unlink()
    for i, part in enumerate((names[::2], names[1::2])):
        mx.save_safetensors(
            str(checkpoint / f"model-0000{i + 1}-of-00002.safetensors"),
            {n: weights[n] for n in part},
        )
    assert same_drafts(
        mlx_dspark.load_drafter(checkpoint), mlx_dspark.load_drafter(DSPARK)
    )


def test_bfloat16_checkpoint_loads_and_casts(checkpoint):
    weights = mx.load(str(checkpoint / "model.safetensors"))
    mx.save_safetensors(
        str(checkpoint / "model.safetensors"),
        {k: v.astype(mx.bfloat16) for k, v in weights.items()},
    )
    drafter = mlx_dspark.load_drafter(checkpoint)
    assert drafter.model.fc.weight.dtype == mx.bfloat16
    assert drafter.model.layers[0].layer_scalar.dtype == mx.bfloat16
    cache = drafter.make_cache()
    drafter.commit(cache, [mx.ones((1, 3, 192), mx.bfloat16)])
    assert drafter.propose(cache, mx.array(62), 4).tokens.shape == (4,)
    as_float = mlx_dspark.load_drafter(checkpoint, dtype="float32")
    assert as_float.model.fc.weight.dtype == mx.float32


def test_hub_id_resolves_from_the_cache_offline(offline_hub):
    drafter = mlx_dspark.load_drafter("deepseek-ai/dspark_tiny")
    assert drafter.name == "dspark" and drafter.block_size == 4
