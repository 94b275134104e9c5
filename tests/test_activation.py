"""Installing mlx-dspark changes nothing for a process that uses no drafter:
what the start-up hook and importing mlx-lm load, and mlx-lm's own code
running when no draft model is given."""

import json
import os
import queue
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import DEEPSPEC_TINY

# What importing mlx_lm.generate or mlx_lm.server loads of mlx-dspark: the
# import hook and the patches' pass-through replacements (and the sampler
# settings they attach).
ACTIVATION_MODULES = {
    "mlx_dspark",
    "mlx_dspark.activation",
    "mlx_dspark.integration",
    "mlx_dspark.integration.hooks",
    "mlx_dspark.speculative",
    "mlx_dspark.speculative.sampling",
}


def modules_after(code: str, **extra_env) -> set:
    environment = {k: v for k, v in os.environ.items() if k != "MLX_DSPARK_DISABLE"}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        env={**environment, **extra_env},
        check=True,
    )
    return set(json.loads(result.stdout.splitlines()[-1]))


def ours(modules: set) -> set:
    return {m for m in modules if m == "mlx_dspark" or m.startswith("mlx_dspark.")}


def test_disabled_start_up_imports_nothing_of_mlx_dspark():
    assert ours(modules_after("pass", MLX_DSPARK_DISABLE="1")) == set()
    assert ours(modules_after("pass")) == {"mlx_dspark", "mlx_dspark.activation"}


@pytest.mark.parametrize("module", ["mlx_lm.generate", "mlx_lm.server"])
def test_importing_mlx_lm_loads_only_what_activation_needs(module):
    active = modules_after(f"import {module}")
    stock = modules_after(f"import {module}", MLX_DSPARK_DISABLE="1")
    assert stock <= active
    assert active - stock == ACTIVATION_MODULES


def test_mlx_lm_generate_without_a_draft_model_runs_mlx_lms_own_code():
    argv = [
        "mlx_lm.generate",
        "--model",
        str(DEEPSPEC_TINY / "target_tiny_gemma4"),
        "--prompt",
        "w65 w211",
        "--max-tokens",
        "3",
        "--ignore-chat-template",
    ]
    code = (
        f"import sys, mlx_lm.generate; sys.argv = {argv!r};"
        "sys.modules['mlx_lm.generate'].main()"
    )
    assert ours(modules_after(code)) == ACTIVATION_MODULES


def test_every_flag_of_ours_sends_the_command_line_through_our_cli():
    from mlx_dspark.integration import cli, hooks

    flags = hooks.DRAFTER_FLAGS + hooks.PROCESSOR_FLAGS
    parsed = {
        o
        for generate in (True, False)  # mlx_lm.generate's flags, then the server's
        for a in cli._parser(generate)._actions
        for o in a.option_strings
    }
    assert parsed | {"--draft-model"} == set(flags)
    for flag in flags:
        assert hooks.names_a_flag(["--prompt", "hi", f"{flag}=1"], flags)
        assert hooks.names_a_flag([flag[:-2], "1"], flags)  # argparse takes prefixes
    for argv in (["--help"], ["-h"]):
        assert hooks.names_a_flag(argv, ())
    stock = ["--model", "m", "--prompt", "hi", "--temp", "0.5", "--max-tokens", "3"]
    assert not hooks.names_a_flag(stock, flags)



def test_a_server_uses_its_own_prompt_cache_lookup_unless_a_draft_model_serves(
    monkeypatch,
):
    """The LRU keeps mlx-lm's class and lookup; once a request with a draft
    model is taken, lookups go through the rollback-aware one while a draft
    model is loaded, and through mlx-lm's otherwise."""
    import mlx_lm.server
    from mlx_lm.models.cache import LRUPromptCache

    from mlx_dspark.integration import hooks, server

    assert mlx_lm.server.LRUPromptCache is LRUPromptCache
    requests = queue.Queue()
    generator = SimpleNamespace(
        model_provider=SimpleNamespace(
            draft_model=None, cli_args=SimpleNamespace(draft_model=None)
        ),
        prompt_cache=LRUPromptCache(),
        _is_distributed=False,
    )
    take = hooks.next_request(
        lambda self, timeout: requests.get_nowait(), mlx_lm.server.GenerationContext
    )

    def request(draft):
        args = SimpleNamespace(model=SimpleNamespace(draft=draft), num_draft_tokens=3)
        requests.put((queue.Queue(), None, args))
        return take(generator, None)

    plain = request("default_model")
    assert isinstance(plain[0], queue.Queue)
    assert "fetch_nearest_cache" not in vars(generator.prompt_cache)

    drafted = request("drafter")
    assert drafted[0].slot.num_draft_tokens == 3
    rollback_aware = []
    monkeypatch.setattr(
        server, "fetch_nearest_cache", lambda lru, key, tokens: rollback_aware.append(key)
    )
    lookup = generator.prompt_cache.fetch_nearest_cache
    assert lookup(("m", None, None), [1, 2]) == (None, [1, 2])  # mlx-lm's: a miss
    assert rollback_aware == []
    generator.model_provider.draft_model = object()
    lookup(("m", None, "drafter"), [1, 2])
    assert rollback_aware == [("m", None, "drafter")]


def test_a_server_with_a_drafter_and_no_model_is_a_one_line_error(monkeypatch, capsys):
    """``mlx_lm.server --draft-model DRAFTER`` without ``--model`` (mlx-lm's
    server would load a model per request): a one-line error that names
    the flag, not a stack trace; the server does not start."""
    from mlx_dspark.integration import cli

    drafter = str(DEEPSPEC_TINY / "dspark_tiny_gemma4_block4")
    monkeypatch.setattr(sys, "argv", ["mlx_lm.server", "--draft-model", drafter])
    started = []
    with pytest.raises(SystemExit) as exit:
        cli.main(lambda: started.append(1), "mlx_lm.server")
    assert exit.value.code == 1 and not started
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mlx_lm.server: error:") and "needs --model" in line
