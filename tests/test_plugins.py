"""Drafter kinds and target adapters are plugins found through entry points."""

import json
import textwrap

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark import plugins

from conftest import DEEPSPEC_TINY, FIXTURES

TOY_PLUGIN = '''
from pathlib import Path

import mlx.core as mx

from mlx_dspark.drafters.base import Proposal
from mlx_dspark.plugins import DrafterKind, hookimpl


class Length:
    def __init__(self):
        self.offset = 0

    def trim(self, n):
        self.offset -= n
        return n

    @property
    def state(self):
        return []


class RepeatDrafter:
    """Drafts the anchor again and again."""

    name = "repeat"
    taps = (0,)

    def __init__(self, block_size):
        self.block_size = self.max_draft_tokens = block_size

    def check_target(self, target):
        pass

    def make_cache(self):
        return [Length()]

    def commit(self, cache, hidden, proposal=None):
        cache[0].offset += hidden[0].shape[1]

    def propose(
        self, cache, anchor, num_drafts, draw=None, target=None, target_cache=None
    ):
        return Proposal(tokens=mx.repeat(anchor.reshape(1), num_drafts).astype(mx.uint32))


@hookimpl
def mlx_dspark_drafter_kinds():
    return [
        DrafterKind(
            name="repeat",
            architectures=("RepeatDrafter",),
            detect=lambda config: config.get("architectures") == ["RepeatDrafter"],
            load=lambda path, config: RepeatDrafter(config["block_size"]),
        )
    ]
'''


@pytest.fixture
def installed_toy_plugin(tmp_path, monkeypatch):
    """A third-party distribution declaring an ``mlx_dspark`` entry point."""
    (tmp_path / "toy_drafter_plugin.py").write_text(TOY_PLUGIN)
    dist = tmp_path / "toy_drafter_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: toy-drafter-plugin\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [mlx_dspark]
            repeat = toy_drafter_plugin
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_manager", None)
    checkpoint = tmp_path / "repeat-drafter"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        json.dumps({"architectures": ["RepeatDrafter"], "block_size": 3})
    )
    return checkpoint


def test_external_drafter_kind_is_discovered_and_used(installed_toy_plugin, tiny_pair):
    model, tokenizer, _ = tiny_pair
    assert "repeat" in [k.name for k in plugins.drafter_kinds()]
    drafter = mlx_dspark.load_drafter(installed_toy_plugin)
    assert drafter.name == "repeat"

    prompt = [65, 211, 266, 241]
    responses = list(
        mlx_dspark.stream_generate(
            model, tokenizer, prompt, draft=drafter, max_tokens=20
        )
    )
    plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    assert [r.token for r in responses] == plain[: len(responses)]
    assert responses[-1].stats.drafter == "repeat"
    assert responses[-1].stats.rounds > 0


def test_builtin_kinds_come_from_entry_points_only():
    bare = plugins.make_plugin_manager(load_entry_points=False)
    assert plugins.drafter_kinds(bare) == [] and plugins.target_adapters(bare) == []
    installed = plugins.make_plugin_manager()
    assert {"gemma4", "deepspec-gemma4", "qwen3", "deepspec-qwen3"} <= {
        name for name, _ in installed.list_name_plugin()
    }
    assert "deepspec-gemma4" in [k.name for k in plugins.drafter_kinds(installed)]
    assert "gemma4" in [a.name for a in plugins.target_adapters(installed)]


def test_no_installed_kind_explains_itself(tmp_path):
    bare = plugins.make_plugin_manager(load_entry_points=False)
    with pytest.raises(ValueError, match="no drafter kinds are installed"):
        plugins.find_drafter_kind(
            {"architectures": ["Gemma4DSparkModel"]}, tmp_path, bare
        )


def test_qwen3_support_is_only_its_plugins(monkeypatch):
    """With only the Gemma-4 plugins registered, the engine refuses Qwen3
    drafters and targets with a clear message, and Gemma-4 still works."""
    from mlx_lm import load

    from mlx_dspark.drafters import gemma4_dspark
    from mlx_dspark.targets import gemma4

    gemma_only = plugins.make_plugin_manager(load_entry_points=False)
    gemma_only.register(gemma4, name="gemma4")
    gemma_only.register(gemma4_dspark, name="deepspec-gemma4")
    monkeypatch.setattr(plugins, "_manager", gemma_only)

    qwen3_dir = FIXTURES / "deepspec-qwen3-tiny"
    with pytest.raises(
        ValueError,
        match=r"not a drafter checkpoint .*Qwen3DSparkModel.*"
        r"installed kinds: deepspec-gemma4 \(Gemma4DSparkModel\)",
    ):
        mlx_dspark.load_drafter(qwen3_dir / "dspark_tiny_qwen3_block4")

    qwen3_target, _ = load(str(qwen3_dir / "target_tiny_qwen3"))
    drafter = mlx_dspark.load_drafter(DEEPSPEC_TINY / "dspark_tiny_gemma4_block4")
    with pytest.raises(ValueError, match="installed target adapters: gemma4"):
        next(
            mlx_dspark.speculative_generate_step(
                mx.array([5, 6]), qwen3_target, drafter
            )
        )
