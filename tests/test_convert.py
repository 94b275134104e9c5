"""``mlx_dspark convert``: quantized and re-typed drafters that load, stay
lossless, keep the confidence head and norms float, and refuse bad input."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark import SpeculativeStats, speculative_generate_step
from mlx_dspark.convert import convert
from mlx_dspark.drafters import gemma4_dspark
from mlx_dspark.drafters.deepspec_model import Model

from conftest import DEEPSPEC_TINY, FIXTURES
from tiny import randomize

TARGET = DEEPSPEC_TINY / "target_tiny_gemma4"
DSPARK = DEEPSPEC_TINY / "dspark_tiny_gemma4_block4"
ASSISTANT = FIXTURES / "assistant-tiny"
# name: (target, drafter)
PAIRS = {
    "dspark": (TARGET, DSPARK),
    "dflash": (TARGET, DEEPSPEC_TINY / "dflash_tiny_gemma4_block4"),
    "assistant-dense": (
        ASSISTANT / "dense" / "target",
        ASSISTANT / "dense" / "assistant",
    ),
    "assistant-e2b": (ASSISTANT / "e2b" / "target", ASSISTANT / "e2b" / "assistant"),
}
PROMPT = [2, 65, 211, 266, 241, 234]
BIN = Path(sys.executable).parent


@functools.cache
def target(path):
    return load(str(path))[0]


def quietly_convert(capsys, *args, **kwargs):
    out = convert(*args, **kwargs)
    return out, capsys.readouterr().out


def plain_greedy(model, max_tokens=40):
    return [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=max_tokens)]


def speculative(model, drafter, max_tokens=40):
    """Every round with all its drafts (``fixed``), so that the statistics
    say how well the converted drafter drafts."""
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    steps = speculative_generate_step(
        mx.array(PROMPT), model, drafter, max_tokens=max_tokens, stats=stats, scheduler="fixed"
    )
    return [t for t, _, _ in steps], stats


def layers(model):
    """Every Linear and Embedding of ``model``, quantized or not, by path."""
    kinds = (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)
    return {p: m for p, m in model.named_modules() if isinstance(m, kinds)}


def is_quantized(module):
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", PAIRS)
def test_quantized_drafter_loads_with_every_groupable_layer_quantized(
    tmp_path, capsys, name, bits
):
    out, report = quietly_convert(
        capsys, PAIRS[name][1], tmp_path / "q", q_bits=bits, q_group_size=32
    )
    source = layers(mlx_dspark.load_drafter(PAIRS[name][1], lazy=True).model)
    model = mlx_dspark.load_drafter(out).model
    converted = layers(model)
    assert converted.keys() == source.keys()
    kept = [
        path
        for path, module in source.items()
        if "confidence_head" in path or module.weight.shape[-1] % 32
    ]
    for path, module in converted.items():
        if path in kept:
            assert not is_quantized(module), path
        else:
            assert is_quantized(module), path
            assert (module.bits, module.group_size) == (bits, 32), path
    assert all(f"kept float: {path} (" in report for path in kept)
    embeddings = (
        model.model.embed_tokens if name.startswith("assistant") else model.embed_tokens
    )
    assert isinstance(embeddings, nn.QuantizedEmbedding)
    if name == "dspark":
        assert set(kept) == {
            "confidence_head.proj",
            "markov_head.markov_w1",
            "markov_head.markov_w2",
        }
        assert "the confidence head stays float" in report
        assert "last dimension (16) is not a multiple of the group size 32" in report
    norms = [v for k, v in tree_flatten(model.parameters()) if "norm" in k]
    assert norms and all(v.dtype == mx.float32 for v in norms)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", PAIRS)
def test_speculative_decoding_with_a_quantized_drafter_is_lossless(
    tmp_path, capsys, name, bits
):
    model = target(PAIRS[name][0])
    out, _ = quietly_convert(
        capsys, PAIRS[name][1], tmp_path / "q", q_bits=bits, q_group_size=32
    )
    tokens, stats = speculative(model, mlx_dspark.load_drafter(out))
    assert tokens == plain_greedy(model)
    assert stats.accepted > 0  # the quantized drafter still drafts well


def test_assistant_keeps_its_generation_config(tmp_path, capsys):
    """generation_config.json (4 drafts per round; the default is 6) is copied."""
    source = ASSISTANT / "e2b" / "assistant"
    out, _ = quietly_convert(capsys, source, tmp_path / "q", q_bits=8)
    assert (out / "generation_config.json").read_text() == (
        source / "generation_config.json"
    ).read_text()
    assert mlx_dspark.load_drafter(out).block_size == 4


def test_groupable_markov_head_is_quantized_and_confidence_head_is_not(
    tmp_path, capsys
):
    config = json.loads((DSPARK / "config.json").read_text())
    config.update(markov_rank=32, markov_head_type="rnn")
    source = tmp_path / "rank32"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    network = randomize(
        Model(gemma4_dspark.ModelArgs.from_dict(config)), seed=3
    )
    mx.save_safetensors(
        str(source / "model.safetensors"), dict(tree_flatten(network.parameters()))
    )
    out, _ = quietly_convert(capsys, source, tmp_path / "q", q_bits=4, q_group_size=32)
    drafter = mlx_dspark.load_drafter(out)
    head = drafter.model.markov_head
    assert isinstance(head.markov_w1, nn.QuantizedEmbedding)
    assert isinstance(head.markov_w2, nn.QuantizedLinear)
    assert isinstance(drafter.model.confidence_head.proj, nn.Linear)
    cache = drafter.make_cache()
    drafter.commit(cache, [mx.ones((1, 3, 192))])
    proposal = drafter.propose(cache, mx.array(62), 4)
    assert proposal.confidence.shape == (4,)
    assert mx.isfinite(proposal.confidence).all().item()
    model = target(TARGET)
    assert speculative(model, drafter)[0] == plain_greedy(model)


@pytest.mark.parametrize("name", ["dspark", "assistant-e2b"])
def test_dtype_only_conversion_recasts_without_quantizing(tmp_path, capsys, name):
    out, _ = quietly_convert(
        capsys, PAIRS[name][1], tmp_path / "bf16", dtype="bfloat16"
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert "quantization" not in json.loads((out / "config.json").read_text())
    drafter = mlx_dspark.load_drafter(out)
    params = dict(tree_flatten(drafter.model.parameters()))
    assert not any(is_quantized(m) for m in layers(drafter.model).values())
    assert all(
        v.dtype == mx.bfloat16
        for k, v in params.items()
        if k != "masked_embedding.token_ordering"
    )
    model = target(PAIRS[name][0])
    assert speculative(model, drafter)[0] == plain_greedy(model)


def test_quantize_and_recast_together_keeps_scales_in_the_new_dtype(tmp_path, capsys):
    out, _ = quietly_convert(
        capsys, DSPARK, tmp_path / "q", q_bits=8, q_group_size=64, dtype="bfloat16"
    )
    model = mlx_dspark.load_drafter(out).model
    assert model.fc.scales.dtype == mx.bfloat16 and model.fc.group_size == 64
    assert model.confidence_head.proj.weight.dtype == mx.bfloat16


def test_a_hub_id_converts_from_the_offline_cache(offline_hub, tmp_path, capsys):
    out, _ = quietly_convert(
        capsys, "deepseek-ai/dspark_tiny", tmp_path / "q", q_bits=8, q_group_size=32
    )
    assert isinstance(mlx_dspark.load_drafter(out).model.fc, nn.QuantizedLinear)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "dspark-q8"
    convert(DSPARK, out, q_bits=8, q_group_size=32)
    return out


def occupied(tmp_path):
    path = tmp_path / "occupied"
    path.mkdir()
    (path / "keep.txt").write_text("mine")
    return path


# case: (lambda tmp_path, an 8-bit drafter: (source, out, options), the error).
# Options are checked before the source is looked at, even a missing one.
BAD = {
    "bits": (
        lambda tmp, q8: (tmp / "nope", tmp / "o", {"q_bits": 7}),
        "q_bits must be one of 2, 3, 4, 5, 6, 8, got 7",
    ),
    "group size": (
        lambda tmp, q8: (tmp / "nope", tmp / "o", {"q_bits": 4, "q_group_size": 16}),
        "q_group_size must be one of 32, 64, 128, got 16",
    ),
    "dtype": (
        lambda tmp, q8: (tmp / "nope", tmp / "o", {"dtype": "float8"}),
        "dtype must be one of float32, bfloat16, float16, got 'float8'",
    ),
    "nothing to do": (
        lambda tmp, q8: (tmp / "nope", tmp / "o", {}),
        "Nothing to convert",
    ),
    "missing source": (
        lambda tmp, q8: (tmp / "nope", tmp / "o", {"q_bits": 4}),
        "No checkpoint directory at",
    ),
    "out not empty": (
        lambda tmp, q8: (DSPARK, occupied(tmp), {"q_bits": 4}),
        "exists and is not empty; pick another directory or remove it",
    ),
    "out is a file": (
        lambda tmp, q8: (DSPARK, occupied(tmp) / "keep.txt", {"q_bits": 4}),
        "is a file; pick a directory",
    ),
    "out is the source": (
        lambda tmp, q8: (q8, q8, {"dtype": "float16"}),
        "is the source checkpoint; pick another directory",
    ),
    "quantized twice": (
        lambda tmp, q8: (q8, tmp / "o", {"q_bits": 4}),
        "is already quantized .* quantize the float checkpoint",
    ),
}


def snapshot(*folders):
    """Every file and folder under ``folders``, with the files' contents."""
    return {
        path: path.read_bytes() if path.is_file() else None
        for folder in folders
        for path in folder.rglob("*")
    }


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_with_a_clear_error_and_writes_nothing(
    tmp_path, quantized, case
):
    make, message = BAD[case]
    source, out, options = make(tmp_path, quantized)
    before = snapshot(tmp_path, quantized)
    with pytest.raises(ValueError, match=message):
        convert(source, out, **options)
    assert snapshot(tmp_path, quantized) == before


def test_a_drafter_without_a_network_is_refused(tmp_path, monkeypatch):
    class Networkless:
        name = "opaque"

    monkeypatch.setattr(
        "mlx_dspark.convert.load_drafter", lambda *a, **k: Networkless()
    )
    with pytest.raises(ValueError, match="opaque drafter .* has no network"):
        convert(DSPARK, tmp_path / "o", q_bits=4)
    assert not (tmp_path / "o").exists()


def cli(*args):
    environment = dict(os.environ, HF_HUB_OFFLINE="1")
    environment.pop("MLX_DSPARK_DISABLE", None)
    return subprocess.run(
        [str(BIN / args[0]), *map(str, args[1:])],
        capture_output=True,
        check=False,
        text=True,
        env=environment,
        timeout=300,
    )


def test_cli_converts_and_mlx_lm_generate_drafts_losslessly_with_it(tmp_path):
    out = tmp_path / "dspark-q4"
    converted = cli(
        "mlx_dspark",
        "convert",
        DSPARK,
        "--out",
        out,
        "--q-bits",
        4,
        "--q-group-size",
        32,
    )
    assert converted.returncode == 0, converted.stderr
    assert "kept float: confidence_head.proj" in converted.stdout
    generate = (
        "mlx_lm.generate",
        "--model",
        TARGET,
        "--prompt",
        "w65 w211 w266 w241 w234",
        "--max-tokens",
        40,
        "--ignore-chat-template",
    )
    plain = cli(*generate)
    ours = cli(*generate, "--draft-model", out)
    assert ours.returncode == 0, ours.stderr
    assert "Speculative: dspark" in ours.stdout
    assert ours.stdout.split("==========")[1] == plain.stdout.split("==========")[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--q-bits", 7), "argument --q-bits: invalid choice: 7"),
        (("--q-bits", 4, "--out", DSPARK), "is the source checkpoint"),
        (("--q-bits", 4, "--revision", "main"), "not a local directory"),
    ],
)
def test_cli_errors_are_one_line_without_a_traceback(tmp_path, flags, message):
    source = DSPARK if "--revision" not in flags else "nobody/no-such-drafter"
    result = cli("mlx_dspark", "convert", source, "--out", tmp_path / "o", *flags)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mlx_dspark convert: error: ") and message in last
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()
