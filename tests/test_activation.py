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
    "mlx_dspark.spec",
    "mlx_dspark.spec.sampling",
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
    parsed = {o for a in cli._parser(True)._actions for o in a.option_strings}
    assert parsed | {"--draft-model"} == set(flags)
    for flag in flags:
        assert hooks.names_a_flag(["--prompt", "hi", f"{flag}=1"], flags)
        assert hooks.names_a_flag([flag[:-2], "1"], flags)  # argparse takes prefixes
    for argv in (["--help"], ["-h"]):
        assert hooks.names_a_flag(argv, ())
    stock = ["--model", "m", "--prompt", "hi", "--temp", "0.5", "--max-tokens", "3"]
    assert not hooks.names_a_flag(stock, flags)


def test_a_server_uses_its_own_prompt_cache_lookup_unless_a_draft_model_serves():
    import mlx_lm.server
    from mlx_lm.models.cache import LRUPromptCache

    from mlx_dspark.integration import hooks

    assert mlx_lm.server.LRUPromptCache is LRUPromptCache
    lookups = []

    def original(generator, request, stream):
        lookups.append(generator.prompt_cache.fetch_nearest_cache)

    generator = SimpleNamespace(
        model_provider=SimpleNamespace(draft_model=None), prompt_cache=LRUPromptCache()
    )
    serve = hooks.serve_single(original, mlx_lm.server.GenerationContext)
    serve(generator, "request", None)
    assert lookups[-1].__func__ is LRUPromptCache.fetch_nearest_cache

    generator.model_provider.draft_model = object()
    serve(generator, (queue.Queue(), None, SimpleNamespace(num_draft_tokens=3)), None)
    stock_lookup = LRUPromptCache.fetch_nearest_cache
    assert getattr(lookups[-1], "__func__", None) is not stock_lookup
    assert "fetch_nearest_cache" not in vars(generator.prompt_cache)
