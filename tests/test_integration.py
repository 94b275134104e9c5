"""End to end through mlx-lm's own commands: the real console scripts and a
real server process on loopback, with the bundled tiny models."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

from conftest import DEEPSPEC_TINY, FIXTURES

TARGET = DEEPSPEC_TINY / "target_tiny_gemma4"
DSPARK = DEEPSPEC_TINY / "dspark_tiny_gemma4_block4"
QWEN3 = FIXTURES / "deepspec-qwen3-tiny"
BIN = Path(sys.executable).parent
PROMPT = "w65 w211 w266 w241 w234"


def env(**extra):
    environment = dict(os.environ)
    environment.pop("MLX_DSPARK_DISABLE", None)
    environment.update(extra)
    return environment


def cli(*args, environment=None):
    return subprocess.run(
        [str(BIN / args[0]), *map(str, args[1:])],
        capture_output=True,
        text=True,
        env=environment or env(),
        timeout=300,
    )


def generated_text(result) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout.split("==========")[1].strip()


def generate(*extra, environment=None, max_tokens=60):
    return cli(
        "mlx_lm.generate",
        "--model",
        TARGET,
        "--prompt",
        PROMPT,
        "--max-tokens",
        max_tokens,
        "--ignore-chat-template",
        *extra,
        environment=environment,
    )


@pytest.fixture(scope="module")
def plain_text():
    return generated_text(generate())


@pytest.fixture(scope="module")
def noisy_draft(tmp_path_factory):
    """An ordinary draft language model: a perturbed copy of the target."""
    path = tmp_path_factory.mktemp("noisy_draft")
    for f in TARGET.iterdir():
        shutil.copy(f, path)
    weights = mx.load(str(TARGET / "model.safetensors"))
    mx.random.seed(0)
    noisy = {k: v + 0.05 * mx.random.normal(v.shape) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), noisy)
    return path


def test_generate_with_drafter_prints_exactly_the_plain_text(plain_text):
    """60 tokens cross the tiny target's sliding window (8) many times."""
    result = generate("--draft-model", DSPARK)
    assert generated_text(result) == plain_text
    line = next(x for x in result.stdout.splitlines() if x.startswith("Speculative:"))
    assert (
        "dspark (greedy):" in line
        and "tau" in line
        and "acceptance by position" in line
    )


def test_hub_ids_resolve_from_the_local_cache_offline(tmp_path, plain_text):
    for repo, source in (("org--tiny-gemma4", TARGET), ("org--tiny-dspark", DSPARK)):
        root = tmp_path / f"models--{repo}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text("abc123")
        shutil.copytree(source, root / "snapshots" / "abc123")
    result = cli(
        "mlx_lm.generate",
        "--model",
        "org/tiny-gemma4",
        "--draft-model",
        "org/tiny-dspark",
        "--prompt",
        PROMPT,
        "--max-tokens",
        60,
        "--ignore-chat-template",
        environment=env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path)),
    )
    assert generated_text(result) == plain_text


def test_flags_num_draft_tokens_and_threshold(plain_text):
    result = generate(
        "--draft-model",
        DSPARK,
        "--num-draft-tokens",
        2,
        "--draft-confidence-threshold",
        0.5,
    )
    assert generated_text(result) == plain_text
    positions = result.stdout.split("acceptance by position [")[1].split("]")[0].split()
    assert positions[2:] == ["-", "-"]  # never more than 2 drafts verified


def test_explicit_wrapper_works_without_auto_activation(plain_text):
    result = cli(
        "mlx_dspark",
        "generate",
        "--model",
        TARGET,
        "--draft-model",
        DSPARK,
        "--prompt",
        PROMPT,
        "--max-tokens",
        60,
        "--ignore-chat-template",
        environment=env(MLX_DSPARK_DISABLE="1"),
    )
    assert generated_text(result) == plain_text
    assert "Speculative:" in result.stdout


def test_disable_restores_stock_mlx_lm(plain_text):
    stock = env(MLX_DSPARK_DISABLE="1")
    assert generated_text(generate(environment=stock)) == plain_text
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, mlx_lm, mlx_lm.server;"
            "print(sys.modules['mlx_lm.generate'].speculative_generate_step.__module__,"
            " sys.modules['mlx_lm.server'].LRUPromptCache.__module__)",
        ],
        capture_output=True,
        text=True,
        env=stock,
    )
    assert probe.stdout.split() == ["mlx_lm.generate", "mlx_lm.models.cache"]
    # Stock mlx-lm cannot load a DeepSpec drafter.
    assert generate("--draft-model", DSPARK, environment=stock).returncode != 0


def test_plain_draft_model_is_lossless_past_the_window(plain_text, noisy_draft):
    """mlx-lm's own two-model loop, given caches that roll back, matches
    plain decoding; without mlx-dspark it does not."""
    args = ("--draft-model", noisy_draft, "--num-draft-tokens", 3)
    assert generated_text(generate(*args)) == plain_text
    stock = generated_text(generate(*args, environment=env(MLX_DSPARK_DISABLE="1")))
    assert stock != plain_text


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A model family no installed adapter can tap."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = tmp_path_factory.mktemp("llama")
    config = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TARGET / name, path)
    return path


@pytest.fixture
def corrupt_drafter(tmp_path):
    path = tmp_path / "corrupt"
    shutil.copytree(DSPARK, path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "wrong-target",
            "was not trained for this target: it drafts for qwen3 targets",
        ),
        ("missing", "No model at /no/such/drafter"),
        ("corrupt", "corrupt or truncated"),
        ("untappable", "not supported for hidden-state drafting"),
        (
            "too-many-drafts",
            "--num-draft-tokens must be an integer between 1 and 4 for this drafter (its trained block size is 4), got 5",
        ),
    ],
)
def test_errors_are_one_clear_line(case, message, corrupt_drafter, tiny_llama):
    draft = {
        "wrong-target": QWEN3 / "dspark_tiny_qwen3_block4",
        "missing": "/no/such/drafter",
        "corrupt": corrupt_drafter,
    }.get(case, DSPARK)
    args = ["--draft-model", draft]
    if case == "too-many-drafts":
        args += ["--num-draft-tokens", 5]
    model = tiny_llama if case == "untappable" else TARGET
    result = cli(
        "mlx_lm.generate",
        "--model",
        model,
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        *args,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(
        "mlx_lm.generate: error: "
    )
    assert message in result.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path, *args, model=TARGET):
        self.port = free_port()
        self.log = tmp_path / f"server-{self.port}.log"
        self.process = subprocess.Popen(
            [
                str(BIN / "mlx_lm.server"),
                "--model",
                str(model),
                "--port",
                str(self.port),
                *map(str, args),
            ],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env(HF_HUB_CACHE=str(tmp_path)),
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                self.post("/v1/completions", {"prompt": "w5", "max_tokens": 1})
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(self.log.read_text())

    def post(self, path, body):
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            data = response.read().decode()
        if body.get("stream"):
            return [
                json.loads(line[6:])
                for line in data.splitlines()
                if line.startswith("data: {")
            ]
        return json.loads(data)

    def get(self, path):
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.port}{path}", timeout=30
        ) as r:
            return json.loads(r.read())

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    speculative, plain = Server(tmp, "--draft-model", DSPARK), Server(tmp)
    yield speculative, plain
    speculative.stop()
    plain.stop()


def text_of(response):
    choice = response["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def streamed_text(chunks):
    parts = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            parts.append(
                choice.get("delta", {}).get("content") or choice.get("text") or ""
            )
    return "".join(parts)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_server_responses_equal_plain_ones(servers, endpoint, stream):
    speculative, plain = servers
    body = {"max_tokens": 50, "stream": stream}
    if endpoint == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    if stream:
        body["stream_options"] = {"include_usage": True}
        ours, theirs = speculative.post(endpoint, body), plain.post(endpoint, body)
        assert streamed_text(ours) == streamed_text(theirs)
        usage = ours[-1]["usage"]
    else:
        ours, theirs = speculative.post(endpoint, body), plain.post(endpoint, body)
        assert text_of(ours) == text_of(theirs)
        usage = ours["usage"]
    stats = usage["speculative"]
    assert stats["drafter"] == "dspark" and stats["rounds"] > 0
    assert 0 <= stats["accepted"] <= stats["drafted"] and stats["tau"] >= 1


def test_server_per_request_num_draft_tokens(servers):
    speculative, plain = servers
    body = {"prompt": "w7 w8 w9", "max_tokens": 30}
    ours = speculative.post("/v1/completions", dict(body, num_draft_tokens=1))
    assert text_of(ours) == text_of(plain.post("/v1/completions", body))
    assert ours["usage"]["speculative"]["acceptance_by_position"][1:] == [None] * 3


def test_server_multi_turn_reuses_the_cache_exactly(servers):
    speculative, plain = servers
    messages = [{"role": "user", "content": "w10 w20 w30 w40"}]
    for turn in range(3):
        ours = speculative.post(
            "/v1/chat/completions", {"messages": messages, "max_tokens": 25}
        )
        theirs = plain.post(
            "/v1/chat/completions", {"messages": messages, "max_tokens": 25}
        )
        assert text_of(ours) == text_of(theirs)
        if turn:
            assert ours["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        messages += [
            {"role": "assistant", "content": text_of(ours)},
            {"role": "user", "content": f"w{100 + turn} w{200 + turn}"},
        ]


def test_server_concurrent_clients_get_their_own_output(servers):
    speculative, plain = servers
    prompts = [f"w{5 + 37 * i} w{11 + 53 * i} w{17 + 29 * i}" for i in range(8)]
    expected = [
        text_of(plain.post("/v1/completions", {"prompt": p, "max_tokens": 40}))
        for p in prompts
    ]
    with ThreadPoolExecutor(8) as pool:
        got = list(
            pool.map(
                lambda p: text_of(
                    speculative.post("/v1/completions", {"prompt": p, "max_tokens": 40})
                ),
                prompts,
            )
        )
    assert got == expected


def test_server_lists_models_not_drafters_and_logs_statistics(servers):
    speculative, _ = servers
    ids = [m["id"] for m in speculative.get("/v1/models")["data"]]
    assert ids == [str(TARGET.resolve())]
    # Its own request: under pytest-xdist this worker's server may have
    # served no other test's yet.
    speculative.post("/v1/completions", {"prompt": "w5 w6 w7", "max_tokens": 8})
    assert "Speculative decoding: dspark (greedy):" in speculative.log.read_text()


def test_server_refuses_a_bad_pairing_at_startup(tmp_path):
    result = subprocess.run(
        [
            str(BIN / "mlx_lm.server"),
            "--model",
            str(TARGET),
            "--draft-model",
            str(QWEN3 / "dspark_tiny_qwen3_block4"),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("mlx_lm.server: error: The drafter")


def test_server_reuses_only_what_the_cache_can_roll_back(servers):
    """Repeating a long request would need trimming the cached context by
    more than the sliding-window cache keeps; the server then uses no cache
    rather than failing, and the output is unchanged."""
    speculative, plain = servers
    body = {"prompt": "w3 w33 w333 w303", "max_tokens": 60}
    expected = text_of(plain.post("/v1/completions", body))
    first = speculative.post("/v1/completions", body)
    again = speculative.post("/v1/completions", body)
    assert text_of(first) == text_of(again) == expected
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_server_trims_a_longer_cached_context_to_the_shared_prefix():
    """In process and deterministic: a cached context that goes on past the
    request is handed back holding only the shared prefix (and exactly what
    a fresh forward over it holds); an exact hit keeps the last prompt token
    to process; an entry that cannot roll back that far is not used."""
    from mlx_lm.models.cache import LRUPromptCache

    from mlx_dspark.integration.dispatch import rollback_caches
    from mlx_dspark.integration.server import fetch_nearest_cache

    from tiny import tiny_gemma4

    model = tiny_gemma4(seed=0, window=4)
    cached = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    lru = LRUPromptCache()
    for key, rollback in (("deep", 32), ("shallow", 1)):
        cache = rollback_caches(model, rollback)
        model(mx.array(cached)[None], cache=cache)
        lru.insert_cache(key, cached, cache)

    request = cached[:6] + [77, 78]
    cache, rest = fetch_nearest_cache(lru, "deep", request)
    assert rest == [77, 78] and [c.offset for c in cache] == [6] * len(cache)
    fresh = rollback_caches(model, 32)
    model(mx.array(cached[:6])[None], cache=fresh)
    expected = model(mx.array(rest)[None], cache=fresh)
    assert mx.allclose(model(mx.array(rest)[None], cache=cache), expected).item()

    cache, rest = fetch_nearest_cache(lru, "deep", cached)
    assert rest == cached[-1:] and cache[0].offset == len(cached) - 1
    assert fetch_nearest_cache(lru, "shallow", request) == (None, request)


def test_an_ordinary_draft_model_leaves_the_prompt_cache_settled():
    """mlx-lm's two-model loop with a prompt cache: afterwards target and
    draft caches hold the prompt and every yielded token, and a second turn
    continues exactly like a fresh run over the conversation."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    from mlx_dspark.integration.dispatch import rollback_caches

    from tiny import tiny_gemma4

    model, draft = tiny_gemma4(seed=0, window=4), tiny_gemma4(seed=1, window=4)
    cache = rollback_caches(model, 4) + rollback_caches(draft, 4)
    prompt, follow_up, turns = [3, 14, 15, 92], [65, 35], []
    for tokens in (prompt, follow_up):
        steps = speculative_generate_step(
            mx.array(tokens), model, draft, prompt_cache=cache, max_tokens=9
        )
        turns.append([t for t, _, _ in steps])
        held = len(prompt) + len(turns[0]) + (len(turns) - 1) * (len(follow_up) + 9)
        assert [c.offset for c in cache] == [held] * len(cache)
    fresh = generate_step(mx.array(prompt + turns[0] + follow_up), model, max_tokens=9)
    assert turns[1] == [t for t, _ in fresh]


def test_activation_is_lazy_and_installed_for_every_interpreter():
    """The installed .pth/.start files add only an import hook at start-up;
    MLX, mlx-lm and the plugins load when mlx_lm.generate is imported."""
    import site

    assert any((Path(p) / "mlx_dspark.pth").is_file() for p in site.getsitepackages())
    assert any((Path(p) / "mlx_dspark.start").is_file() for p in site.getsitepackages())
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys;"
            "print(any(type(f).__name__ == 'PostImportHook' for f in sys.meta_path),"
            " any(m.split('.')[0] in ('mlx', 'mlx_lm') for m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        env=env(),
    )
    assert probe.stdout.split() == ["True", "False"]


def test_any_module_can_be_imported_first_and_mlx_lm_still_ends_up_patched():
    """Importing one of mlx-dspark's modules first imports mlx_lm.generate from
    inside it; the patches (which import mlx-dspark) must wait until that
    module has finished executing instead of failing on a circular import."""
    import pkgutil

    import mlx_dspark

    modules = [
        info.name for info in pkgutil.walk_packages(mlx_dspark.__path__, "mlx_dspark.")
    ]
    probe = (
        "import sys, importlib; importlib.import_module(sys.argv[1]);"
        "import mlx_lm.generate, mlx_lm.server;"
        "print(all(sys.modules[m]._mlx_dspark_originals is not None"
        " for m in ('mlx_lm.generate', 'mlx_lm.server')))"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", probe, module],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for module in modules
    ]
    results = {module: run.communicate() for module, run in zip(modules, runs)}
    failed = {
        m: err[-300:] for m, (out, err) in results.items() if out.strip() != "True"
    }
    assert len(modules) > 20 and not failed


def test_patches_are_idempotent_reversible_and_version_gated(monkeypatch, capsys):
    import mlx_lm
    import mlx_lm.server  # noqa: F401

    from mlx_dspark.integration import patch_module, unpatch_module

    module = sys.modules["mlx_lm.server"]
    patched_main = module.main
    assert patch_module(module) and module.main is patched_main
    unpatch_module(module)
    try:
        assert module.main.__module__ == "mlx_lm.server"
        assert module.LRUPromptCache.__module__ == "mlx_lm.models.cache"
        assert module.ResponseGenerator._serve_single.__module__ == "mlx_lm.server"
        monkeypatch.setattr(mlx_lm, "__version__", "0.33.0")
        assert not patch_module(module)
        assert "mlx-lm 0.33.0 is untested" in capsys.readouterr().err
        assert module.main.__module__ == "mlx_lm.server"
    finally:
        monkeypatch.undo()
        assert patch_module(module)


def test_generate_samples_with_rejection_reproducibly():
    args = ("--draft-model", DSPARK, "--temp", 0.8, "--top-p", 0.95, "--seed", 4)
    first, second = generate(*args), generate(*args)
    assert generated_text(first) == generated_text(second)
    assert "dspark (rejection):" in first.stdout


def test_generate_paces_sampling_without_a_seed_and_keeps_a_seeds_text():
    """Without ``--seed`` mlx-lm's sampling differs from run to run anyway
    (MLX seeds from the clock): a sampled generation is paced by the default
    ``cost`` scheduler, which decodes plainly where drafting does not pay.
    With ``--seed`` it drafts every round (``fixed``), so that one seed gives
    one text; a scheduler or threshold asked for is kept either way."""
    sampled = ("--draft-model", DSPARK, "--temp", 0.8, "--top-p", 0.95)
    assert "dspark (rejection):" in (unseeded := generate(*sampled)).stdout
    assert "cost scheduler" in unseeded.stdout
    seeded = [generate(*sampled, "--seed", 0) for _ in range(2)]
    assert "fixed scheduler" in seeded[0].stdout
    assert generated_text(seeded[0]) == generated_text(seeded[1])
    assert "fixed scheduler" in generate(*sampled, "--draft-scheduler", "fixed").stdout
    threshold = generate(*sampled, "--draft-confidence-threshold", 0.5)
    assert "threshold scheduler" in threshold.stdout


def test_server_samples_with_rejection(servers):
    speculative, _ = servers
    body = {
        "prompt": PROMPT,
        "max_tokens": 30,
        "temperature": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.2,
        "seed": 3,
    }
    first = speculative.post("/v1/completions", body)
    again = speculative.post("/v1/completions", body)
    assert text_of(first) == text_of(again)
    assert first["usage"]["speculative"]["acceptance_rule"] == "rejection"


def test_generate_logits_processor_flags_apply_with_and_without_drafter(plain_text):
    flags = ("--repetition-penalty", 1.3, "--logit-bias", '{"376": -10}')
    plain = generated_text(generate(*flags))
    assert plain != plain_text and "w376" not in plain.split()
    assert generated_text(generate(*flags, "--draft-model", DSPARK)) == plain
    bad = generate("--logit-bias", "[1, 2]")
    assert bad.returncode == 1 and "--logit-bias must be a JSON object" in bad.stderr


ASSISTANT = FIXTURES / "assistant-tiny" / "dense"


@pytest.mark.parametrize("view", ["transformers", "clean"])
def test_generate_with_the_gemma4_assistant(view):
    args = (
        "--model",
        ASSISTANT / "target",
        "--prompt",
        "w5 w6 w7",
        "--max-tokens",
        40,
        "--ignore-chat-template",
    )
    plain = generated_text(cli("mlx_lm.generate", *args))
    ours = cli(
        "mlx_lm.generate",
        *args,
        "--draft-model",
        ASSISTANT / "assistant",
        "--draft-kv-view",
        view,
    )
    assert generated_text(ours) == plain
    assert "Speculative: assistant (greedy):" in ours.stdout


def test_server_with_the_gemma4_assistant(tmp_path):
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load

    model, tokenizer = load(str(ASSISTANT / "target"))
    expected = mlx_lm_generate(model, tokenizer, "w5 w6 w7", max_tokens=40)
    server = Server(
        tmp_path, "--draft-model", ASSISTANT / "assistant", model=ASSISTANT / "target"
    )
    try:
        response = server.post(
            "/v1/completions", {"prompt": "w5 w6 w7", "max_tokens": 40}
        )
        assert text_of(response) == expected
        assert response["usage"]["speculative"]["drafter"] == "assistant"
    finally:
        server.stop()
