"""Every example runs as is on the bundled tiny models."""

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TARGET = ROOT / "tests" / "fixtures" / "deepspec-tiny" / "target_tiny_gemma4"


def run(*args, check=True, **environment):
    env = {k: v for k, v in os.environ.items() if k != "MLX_DSPARK_DISABLE"}
    result = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        env={**env, **environment},
        cwd=ROOT,
        timeout=300,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_quickstart():
    out = run(EXAMPLES / "quickstart.py", "--max-tokens", 24).stdout
    assert "identical to plain greedy decoding: True" in out


def test_sampling_shows_each_acceptance_rule():
    out = run(EXAMPLES / "sampling.py", "--max-tokens", 16).stdout
    rules = re.findall(r"acceptance rule: (\w+), tau (\d+\.\d+)", out)
    assert [rule for rule, _ in rules] == ["greedy", "rejection", "match"]
    assert all(float(tau) >= 1 for _, tau in rules)


def test_multi_turn_stays_lossless_past_the_sliding_window():
    out = run(EXAMPLES / "multi_turn.py", "--max-tokens", 12).stdout
    turns = re.findall(r"context (\d+) tokens \(sliding window (\d+)\), identical "
                       r"to plain decoding: (\w+)", out)  # fmt: skip
    assert len(turns) == 3 and all(same == "True" for *_, same in turns)
    context, window, _ = turns[-1]
    assert int(context) > int(window)


def test_calibrate_and_schedule(tmp_path):
    prompts = tmp_path / "prompts.txt"
    lines = (EXAMPLES / "calibration" / "tiny_prompts.txt").read_text().splitlines()
    prompts.write_text("\n".join(lines[:4]))
    out = run(
        EXAMPLES / "calibrate_and_schedule.py", "--prompts", prompts,
        "--max-tokens", 12, "--out", tmp_path / "calibration.json",
        MLX_DSPARK_CACHE=str(tmp_path),
    ).stdout  # fmt: skip
    assert (tmp_path / "calibration.json").is_file()
    for scheduler in ("fixed", "threshold 0.5", "cost"):
        assert re.search(rf"^{scheduler} +\d", out, re.M), out
    assert "Every scheduler gave the same output." in out


def test_quantize_drafter(tmp_path):
    out = run(
        EXAMPLES / "quantize_drafter.py", "--prompts", 2, "--max-tokens", 12,
        "--out", tmp_path,
    ).stdout  # fmt: skip
    assert (tmp_path / "8bit" / "config.json").is_file()
    assert re.search(r"^8-bit .*\n4-bit ", out, re.M)
    assert "Every drafter gave the same output." in out


def test_server_client_streams_and_prints_the_speculative_usage():
    out = run(EXAMPLES / "server_client.py", "--max-tokens", 12).stdout
    assert re.search(r"usage.speculative: \{'drafter': 'dspark'.*'rounds': [1-9]", out)


def test_server_client_says_how_to_install_openai(tmp_path):
    # A module named openai that fails to import stands for a missing one.
    (tmp_path / "openai.py").write_text("raise ImportError('not installed')\n")
    result = run(EXAMPLES / "server_client.py", check=False, PYTHONPATH=tmp_path)
    assert result.returncode != 0 and "pip install openai" in result.stderr


def mlx_lm_generate(*args, **environment):
    out = run("-m", "mlx_lm", "generate", "--model", TARGET, "--prompt",
              "w65 w211 w266 w241", "--max-tokens", 16, *args, **environment)  # fmt: skip
    return out.stdout.split("==========")[1], out.stdout


def test_custom_drafter_plugin_installs_and_generates(tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(site),
         str(EXAMPLES / "custom_drafter_plugin")],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    # It depends on this distribution, not on the index's other mlx-dspark.
    [plugin] = metadata.distributions(path=[str(site)])
    ours = re.search(r'^name = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert plugin.requires == [ours[1]]
    with_plugin = {"PYTHONPATH": str(site)}
    run("-m", "mlx_dspark_bigram.build", "--model", TARGET, "--out",
        tmp_path / "bigram", **with_plugin)  # fmt: skip

    text, out = mlx_lm_generate("--draft-model", tmp_path / "bigram", **with_plugin)
    assert "Speculative: bigram (greedy)" in out
    assert text == mlx_lm_generate()[0]
    _, out = mlx_lm_generate("--draft-model", tmp_path / "bigram", "--temp", "0.8",
                             **with_plugin)  # fmt: skip
    assert "Speculative: bigram (rejection)" in out

    # Without the plugin on the path, the checkpoint is nobody's.
    result = run("-m", "mlx_lm", "generate", "--model", TARGET, "--draft-model",
                 tmp_path / "bigram", "--prompt", "w5", check=False)  # fmt: skip
    assert result.returncode != 0


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_every_example_has_a_test(script):
    assert f'"{script.name}"' in Path(__file__).read_text()
