"""Bad input gets a precise ValueError that says what to do, and nothing is
lost: the Python API, checkpoints (with a fuzz of config.json), the commands
(one ``error:`` line) and the server (a 400 before the response starts, and
the next request is answered as before)."""

import json
import shutil
import urllib.error
import urllib.request

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache

import mlx_dspark
from mlx_dspark import speculative_generate_step

from conftest import DEEPSPEC_TINY, FIXTURES
from test_integration import PROMPT, Server, generate, text_of
from tiny import tiny_gemma4

DSPARK = DEEPSPEC_TINY / "dspark_tiny_gemma4_block4"
DFLASH = DEEPSPEC_TINY / "dflash_tiny_gemma4_block4"


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, drop=(), replace=None):
    weights = mx.load(str(path / "model.safetensors"))
    for name in drop:
        del weights[name]
    weights.update(replace or {})
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def refused(match, path, **options):
    with pytest.raises(ValueError, match=match):
        mlx_dspark.load_drafter(path, **options)


def test_missing_directory(tmp_path):
    refused("No checkpoint directory", tmp_path / "nope")


def test_a_file_instead_of_a_directory(checkpoint):
    refused("is a file; pass the checkpoint's directory", checkpoint / "config.json")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    refused("has no config.json", checkpoint)


def test_config_that_is_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    refused("is not valid JSON", checkpoint)


def test_unknown_architecture(checkpoint):
    edit_config(checkpoint, architectures=["LlamaForCausalLM"])
    refused(
        r"not a drafter checkpoint .*LlamaForCausalLM.*deepspec-gemma4 \(Gemma4DSparkModel\)",
        checkpoint,
    )


def test_missing_config_field(checkpoint):
    edit_config(checkpoint, target_layer_ids=None)
    refused("lacks required field.*target_layer_ids", checkpoint)


def test_tapping_the_last_target_layer(checkpoint):
    edit_config(checkpoint, target_layer_ids=[1, 5])
    refused(
        r"target_layer_ids \[1, 5\] must be strictly increasing, each in \[-1, 4\]",
        checkpoint,
    )


def test_unknown_markov_head(checkpoint):
    edit_config(checkpoint, markov_head_type="transformer")
    refused(
        "markov_head_type 'transformer' is not one of vanilla, gated, rnn", checkpoint
    )


def test_non_integer_block_size(checkpoint):
    edit_config(checkpoint, block_size="7")
    refused(r"block_size must be an integer in \[1, 64\], got '7'", checkpoint)


def test_mask_token_outside_the_vocabulary(checkpoint):
    edit_config(checkpoint, mask_token_id=512)
    refused(r"mask_token_id 512 is outside the vocabulary \[0, 512\)", checkpoint)


def test_rope_without_theta(checkpoint):
    edit_config(
        checkpoint, rope_parameters={"full_attention": {"rope_type": "proportional"}}
    )
    refused("no 'full_attention' entry with a rope_theta", checkpoint)


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    refused(r"has no model\*\.safetensors weights", checkpoint)


def test_corrupt_weights(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused("corrupt or truncated", checkpoint)


def test_missing_tensor(checkpoint):
    edit_weights(checkpoint, drop=["markov_head.markov_w2.weight"])
    refused(
        "do not match its config.json: Missing 1 parameters: markov_head.markov_w2.weight",
        checkpoint,
    )


def test_misshapen_tensor(checkpoint):
    edit_weights(checkpoint, replace={"fc.weight": mx.zeros((64, 128))})
    refused(
        r"Expected shape \(64, 192\) but received shape \(64, 128\) for parameter fc.weight",
        checkpoint,
    )


def test_bad_options():
    refused(
        r"confidence_threshold must be a number in \[0, 1\]", DSPARK, confidence_threshold=1.5
    )
    refused("no confidence head", DFLASH, confidence_threshold=0.5)
    refused(
        "take the options confidence_threshold, scheduler, calibration, dtype, lazy; got temperature",
        DSPARK,
        temperature=0.7,
    )
    refused("dtype must be one of", DSPARK, dtype="int8")


@pytest.mark.parametrize(
    "change,problem",
    [
        (dict(layers=5), "it expects 6 decoder layers, the target has 5"),
        (dict(hidden=32), "it expects 64 hidden size, the target has 32"),
        (dict(vocab=96), "it expects 512 vocabulary size, the target has 96"),
    ],
)
def test_drafter_paired_with_the_wrong_target(change, problem):
    shape = dict(layers=6, hidden=64, vocab=512)
    shape.update(change)
    model = tiny_gemma4(**shape)
    drafter = mlx_dspark.load_drafter(DSPARK)
    with pytest.raises(
        ValueError, match=f"was not trained for this target: .*{problem}"
    ):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter))


def test_drafter_of_another_family():
    from mlx_lm import load

    model, _ = load(str(DEEPSPEC_TINY / "target_tiny_gemma4"))
    drafter = mlx_dspark.load_drafter(
        FIXTURES / "deepspec-qwen3-tiny" / "dspark_tiny_qwen3_block4"
    )
    with pytest.raises(ValueError, match="it drafts for qwen3 targets, not gemma4"):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter))


@pytest.mark.parametrize(
    "options,problem",
    [
        (
            dict(num_draft_tokens=0),
            r"num_draft_tokens must be an integer between 1 and 4 for this drafter \(its trained block size is 4\), got 0",
        ),
        (
            dict(num_draft_tokens=5),
            r"num_draft_tokens must be an integer between 1 and 4 for this drafter \(its trained block size is 4\), got 5",
        ),
        (dict(kv_bits=4), "quantized KV cache"),
    ],
)
def test_bad_generation_options(tiny_pair, options, problem):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match=problem):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter, **options))


def test_mlx_lm_prompt_cache_is_refused(tiny_pair):
    model, _, drafter = tiny_pair
    cache = mlx_lm_make_prompt_cache(model) + drafter.make_cache()
    with pytest.raises(ValueError, match="mlx_dspark.make_prompt_cache"):
        next(
            speculative_generate_step(
                mx.array([1, 2]), model, drafter, prompt_cache=cache
            )
        )


def test_prompt_cache_made_for_a_smaller_block(tiny_pair):
    """A cache that cannot roll back a whole verify is refused before any
    token is produced."""
    model, _, drafter = tiny_pair
    from mlx_dspark.speculative.engine import adapt_target

    cache = adapt_target(model, drafter).make_cache(2) + drafter.make_cache()
    steps = speculative_generate_step(
        mx.array([1, 2]), model, drafter, prompt_cache=cache, num_draft_tokens=4
    )
    with pytest.raises(ValueError, match="can roll back 2 tokens, but verifying 4"):
        next(steps)


def test_prompt_ids_outside_the_vocabulary(tiny_pair):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match=r"outside the target's vocabulary \[0, 512\)"):
        next(speculative_generate_step(mx.array([1, 600]), model, drafter))


def test_negative_max_tokens(tiny_pair):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0 or -1"):
        next(speculative_generate_step(mx.array([1, 2]), model, drafter, max_tokens=-3))


def test_empty_prompt(tiny_pair):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match="must be a non-empty 1-D array"):
        next(speculative_generate_step(mx.array([], mx.uint32), model, drafter))


def test_uncached_hub_id_offline(offline_hub):
    refused(
        r"deepseek-ai/missing is not a local directory .*hf download deepseek-ai/missing",
        "deepseek-ai/missing",
    )


# --- The Python API: every public argument, checked for type and range. ---


def first_step(tiny_pair, **options):
    model, _, drafter = tiny_pair
    prompt = options.pop("prompt", mx.array([1, 2]))
    next(speculative_generate_step(prompt, model, drafter, **options))


def first_response(tiny_pair, **options):
    model, tokenizer, drafter = tiny_pair
    options.setdefault("draft", drafter)
    next(mlx_dspark.stream_generate(model, tokenizer, options.pop("prompt", "w5 w6"), **options))


API_CASES = [
    (first_step, dict(num_draft_tokens=2.0), r"num_draft_tokens must be an integer between 1 and 4 .*got 2\.0"),
    (first_step, dict(num_draft_tokens="2"), r"num_draft_tokens must be an integer .*got '2'"),
    (first_step, dict(num_draft_tokens=True), r"num_draft_tokens must be an integer .*got True"),
    (first_step, dict(prefill_step_size=0), r"prefill_step_size must be an integer >= 1, got 0"),
    (first_step, dict(prefill_step_size=8.0), r"prefill_step_size must be an integer >= 1, got 8\.0"),
    (first_step, dict(max_tokens="5"), r"max_tokens must be an integer >= 0 or -1 \(no limit\), got '5'"),
    (first_step, dict(max_tokens=2.5), r"max_tokens must be an integer >= 0 or -1"),
    (first_step, dict(prompt=mx.array([5.5, 6.2])), "prompt must hold integer token ids, got dtype mlx.core.float32"),
    (first_step, dict(prompt=[1, 2]), "prompt must be an mx.array of token ids, got list"),
    (first_step, dict(prompt=mx.array([[1, 2]])), r"non-empty 1-D array of token ids, got shape \(1, 2\)"),
    (first_step, dict(sampler="greedy"), "sampler must be callable or None, got 'greedy'"),
    (first_step, dict(logits_processors=lambda t, l: l), "logits_processors must be a list of callables"),
    (first_step, dict(prompt_progress_callback=3), "prompt_progress_callback must be callable or None"),
    (first_response, dict(prompt=[5.5, 6.2]), "prompt must be a string, a list of token ids"),
    (first_response, dict(prompt=mx.array([5.5, 6.2])), "prompt must hold integer token ids"),
    (first_response, dict(prompt=[]), "prompt must be a non-empty 1-D array"),
    (first_response, dict(max_tokens=0), r"max_tokens must be non-zero \(use -1 for no limit\)"),
    (first_response, dict(max_tokens=None), "max_tokens must be an integer >= 0 or -1"),
    (first_response, dict(draft="drafter"), "draft must be a hidden-state drafter from mlx_dspark.load_drafter, got str"),
]


@pytest.mark.parametrize("call,options,message", API_CASES)
def test_api_arguments(tiny_pair, call, options, message):
    with pytest.raises(ValueError, match=message):
        call(tiny_pair, **options)


@pytest.mark.parametrize(
    "args,options,message",
    [
        ((5,), {}, "path_or_hub_id must be a directory or a Hugging Face Hub id .*got int"),
        ((DSPARK,), dict(revision=3), "revision must be a string, got 3"),
        ((DSPARK,), dict(confidence_threshold="0.5"), r"confidence_threshold must be a number in \[0, 1\], got '0.5'"),
        ((DSPARK,), dict(lazy="yes"), "lazy must be true or false, got 'yes'"),
        ((DSPARK,), dict(dtype=["float32"]), r"dtype must be one of float32, bfloat16, float16, got \['float32'\]"),
        ((FIXTURES / "assistant-tiny" / "dense" / "assistant",), dict(kv_view=1), "kv_view must be one of transformers, clean, got 1"),
    ],
)
def test_load_drafter_arguments(args, options, message):
    with pytest.raises(ValueError, match=message):
        mlx_dspark.load_drafter(*args, **options)


def test_make_prompt_cache_arguments(tiny_pair):
    model, _, drafter = tiny_pair
    with pytest.raises(ValueError, match="drafter must be a hidden-state drafter .*got str"):
        mlx_dspark.make_prompt_cache(model, "drafter")
    with pytest.raises(ValueError, match="The target model .* is not supported"):
        mlx_dspark.make_prompt_cache(object(), drafter)


# --- Checkpoints: files and config fields, checked before anything is built. ---


def set_field(path, key, value, file="config.json"):
    config = json.loads((path / file).read_text())
    if value is DROP:
        config.pop(key, None)
    else:
        config[key] = value
    (path / file).write_text(json.dumps(config))


DROP = object()
WEIGHTS = "model.safetensors"


def truncate(path, size):
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[:size])


def replace_with_directory(path, name):
    (path / name).unlink()
    (path / name).mkdir()


# (what, how to break the checkpoint, the message), shared by the load_drafter
# and the command-line tables.
CHECKPOINT_CASES = [
    ("huge block", lambda p: set_field(p, "block_size", 10**9), r"block_size must be an integer in [1, 64], got 1000000000"),
    ("block past positions", lambda p: set_field(p, "max_position_embeddings", 2), "block_size 4 exceeds max_position_embeddings 2"),
    ("string size", lambda p: set_field(p, "hidden_size", "64"), "hidden_size must be an integer in [1, 512] (no tensor in the weights is larger), got '64'"),
    ("size off the weights", lambda p: set_field(p, "hidden_size", 32), "hidden_size is 32 but norm.weight has 64 rows"),
    ("layers off the weights", lambda p: set_field(p, "num_hidden_layers", 3), "num_hidden_layers is 3 but the weights hold 2 layers"),
    ("vocabulary off the weights", lambda p: set_field(p, "vocab_size", 100), "vocab_size is 100 but embed_tokens.weight has 512 rows"),
    ("string layer ids", lambda p: set_field(p, "target_layer_ids", "1,2"), "target_layer_ids must be a list, got '1,2'"),
    ("flag that is a string", lambda p: set_field(p, "attention_k_eq_v", "yes"), "attention_k_eq_v must be true or false, got 'yes'"),
    ("zero softcap", lambda p: set_field(p, "final_logit_softcapping", 0), "final_logit_softcapping must be a number > 0, got 0"),
    ("negative rope theta", lambda p: set_field(p, "rope_parameters", {"full_attention": {"rope_theta": -1}}), "rope_theta must be a number > 0, got -1"),
    ("empty weights", lambda p: truncate(p, 0), "model.safetensors cannot be read (Error while deserializing header: header too small); the file is corrupt or truncated"),
    ("4-byte weights", lambda p: truncate(p, 4), "model.safetensors cannot be read (Error while deserializing header: header too small)"),
    ("truncated weights", lambda p: truncate(p, 5000), "incomplete metadata, file not fully covered); the file is corrupt or truncated"),
    ("weights directory", lambda p: replace_with_directory(p, WEIGHTS), "model.safetensors is not a file; re-download the checkpoint"),
    ("no weights", lambda p: (p / WEIGHTS).unlink(), r"has no model*.safetensors weights"),
    ("config directory", lambda p: replace_with_directory(p, "config.json"), "config.json is a directory, not a JSON file"),
    ("config not an object", lambda p: (p / "config.json").write_text("[1]"), "config.json does not hold a JSON object"),
    ("architectures missing", lambda p: set_field(p, "architectures", DROP), "is not a drafter checkpoint mlx-dspark can load: its config.json has architectures=None"),
    ("unknown architecture", lambda p: set_field(p, "architectures", ["MyDrafter"]), "is not a drafter checkpoint mlx-dspark can load: its config.json has architectures=['MyDrafter']"),
]


@pytest.mark.parametrize("what,damage,message", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_damaged_checkpoints(checkpoint, what, damage, message):
    damage(checkpoint)
    with pytest.raises(ValueError) as error:
        mlx_dspark.load_drafter(checkpoint)
    assert message in str(error.value)


def test_unreadable_config(checkpoint, monkeypatch):
    """Running as root, permissions cannot make a file unreadable."""
    from pathlib import Path

    def unreadable(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", unreadable)
    refused(r"config.json cannot be read \(\[Errno 13\] Permission denied", checkpoint)


@pytest.fixture
def assistant(tmp_path):
    path = tmp_path / "assistant"
    shutil.copytree(FIXTURES / "assistant-tiny" / "dense" / "assistant", path)
    return path


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: set_field(p, "text_config", "gemma"), "text_config must be an object, got 'gemma'"),
        (lambda p: set_field(p, "backbone_hidden_size", -64), r"backbone_hidden_size must be an integer in \[1, 512\] .*got -64"),
        (lambda p: replace_with_directory(p, "generation_config.json"), "generation_config.json is a directory, not a JSON file"),
        (lambda p: set_field(p, "num_assistant_tokens", 1000, "generation_config.json"), r"num_assistant_tokens must be an integer in \[1, 32\], got 1000"),
        (lambda p: set_field(p, "centroid_intermediate_top_k", 99) or set_field(p, "use_ordered_embeddings", True), "centroid_intermediate_top_k 99 exceeds num_centroids 16"),
    ],
)
def test_damaged_assistant_checkpoints(assistant, damage, message):
    damage(assistant)
    refused(message, assistant)


def plain_tokens(model, tokenizer, n):
    return [
        r.token
        for r in mlx_lm_stream_generate(model, tokenizer, "w5 w6 w7", max_tokens=n)
    ]


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.lists(st.integers(-2, 8), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
FIELDS = sorted(json.loads((DSPARK / "config.json").read_text()))


@given(
    changes=st.lists(
        st.tuples(st.sampled_from(FIELDS), st.one_of(st.just(DROP), JSON_VALUES)),
        min_size=1,
        max_size=3,
    )
)
def test_fuzzed_config_is_refused_or_lossless(tiny_pair, tmp_path_factory, changes):
    """Any change of config.json fields (types, ranges, missing keys) ends in
    one ValueError or a drafter whose output is the target's own."""
    path = tmp_path_factory.mktemp("fuzz") / "dspark"
    shutil.copytree(DSPARK, path)
    for key, value in changes:
        set_field(path, key, value)
    model, tokenizer, _ = tiny_pair
    try:
        drafter = mlx_dspark.load_drafter(path)
        tokens = [
            r.token
            for r in mlx_dspark.stream_generate(
                model, tokenizer, "w5 w6 w7", draft=drafter, max_tokens=12
            )
        ]
    except ValueError as e:
        assert "\n" not in str(e)
        return
    assert tokens == plain_tokens(model, tokenizer, 12)


# --- The commands: one error line and a non-zero exit, never a traceback. ---


def one_error_line(result, prog="mlx_lm.generate"):
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"{prog}: error: ")
    return result.stderr


@pytest.mark.parametrize(
    "what,damage,message", CHECKPOINT_CASES[::2], ids=[c[0] for c in CHECKPOINT_CASES[::2]]
)
def test_generate_with_damaged_drafters(checkpoint, what, damage, message):
    damage(checkpoint)
    assert message in one_error_line(generate("--draft-model", checkpoint))


@pytest.mark.parametrize(
    "args,message",
    [
        (("--logit-bias", '{"99999": 5}'), "--logit-bias has token ids outside the model's vocabulary [0, 512): 99999."),
        (("--logit-bias", '{"-1": 5}', "--draft-model", DSPARK), "--logit-bias has token ids outside the model's vocabulary [0, 512): -1."),
        (("--logit-bias", "{bad"), "--logit-bias must be a JSON object of token ids to biases"),
        (("--draft-model", DSPARK, "--num-draft-tokens", "2.0"), "argument --num-draft-tokens: invalid int value: '2.0'"),
        (("--draft-model", DSPARK, "--draft-confidence-threshold", "2"), "confidence_threshold must be a number in [0, 1], got 2.0"),
    ],
)
def test_generate_flags(args, message):
    assert message in one_error_line(generate(*args))


@given(
    changes=st.lists(
        st.tuples(st.sampled_from(FIELDS), st.one_of(st.just(DROP), JSON_VALUES)),
        min_size=1,
        max_size=2,
    )
)
@settings(max_examples=3)
def test_fuzzed_config_through_the_command(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("fuzz") / "dspark"
    shutil.copytree(DSPARK, path)
    for key, value in changes:
        set_field(path, key, value)
    result = generate("--draft-model", path, max_tokens=12)
    if result.returncode == 0:
        assert result.stdout.split("==========")[1] == generate(max_tokens=12).stdout.split("==========")[1]
    else:
        one_error_line(result)


# --- The server: a 400 with mlx-lm's JSON error before the response starts. ---


def request(server, body, path="/v1/completions"):
    """``(status, body)``; a dropped connection fails the test."""
    data = urllib.request.Request(
        f"http://127.0.0.1:{server.port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(data, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def bad_input_servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input_servers")
    speculative, plain = Server(tmp, "--draft-model", DSPARK), Server(tmp)
    good = {"prompt": PROMPT, "max_tokens": 20}
    expected = text_of(plain.post("/v1/completions", good))
    yield speculative, plain, good, expected
    speculative.stop()
    plain.stop()


QWEN3 = FIXTURES / "deepspec-qwen3-tiny"
SERVER_CASES = [
    ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer between 1 and 4 for this drafter (its trained block size is 4), got 0."),
    ({"num_draft_tokens": 5}, "num_draft_tokens must be an integer between 1 and 4 for this drafter (its trained block size is 4), got 5."),
    ({"num_draft_tokens": 1000}, "got 1000."),
    ({"num_draft_tokens": True}, "got True."),
    ({"prompt": ""}, "prompt is empty (it encodes to no tokens)"),
    ({"logit_bias": {"99999": 5}}, "logit_bias has token ids outside the model's vocabulary [0, 512): 99999."),
    ({"model": str(QWEN3 / "target_tiny_qwen3")}, "was not trained for this target: it drafts for gemma4 targets, not qwen3"),
    ({"draft_model": str(QWEN3 / "dspark_tiny_qwen3_block4")}, "was not trained for this target: it drafts for qwen3 targets, not gemma4"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("change,message", SERVER_CASES)
def test_server_answers_bad_requests_with_400(bad_input_servers, change, message, stream):
    speculative, _, good, expected = bad_input_servers
    status, body = request(speculative, {**good, **change, "stream": stream})
    assert status == 400 and message in json.loads(body)["error"]
    assert text_of(speculative.post("/v1/completions", good)) == expected


def test_plain_server_refuses_logit_bias_outside_the_vocabulary(bad_input_servers):
    _, plain, good, expected = bad_input_servers
    for stream in (False, True):
        status, body = request(plain, {**good, "logit_bias": {"512": 1}, "stream": stream})
        assert status == 400
        assert json.loads(body) == {
            "error": "logit_bias has token ids outside the model's vocabulary [0, 512): 512."
        }
        assert text_of(plain.post("/v1/completions", good)) == expected
