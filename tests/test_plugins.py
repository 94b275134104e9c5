"""Drafter kinds and target adapters are plugins found through entry points."""

import json
import textwrap

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark import plugins

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
    confidence_threshold = 0.0

    def __init__(self, block_size):
        self.block_size = block_size

    def check_target(self, target):
        pass

    def make_cache(self):
        return [Length()]

    def commit(self, cache, hidden):
        cache[0].offset += hidden[0].shape[1]

    def propose(self, cache, anchor, num_drafts, draw=None):
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
    assert {"deepspec", "gemma4"} <= {name for name, _ in installed.list_name_plugin()}
    assert "deepspec-gemma4" in [k.name for k in plugins.drafter_kinds(installed)]
    assert "gemma4" in [a.name for a in plugins.target_adapters(installed)]


def test_no_installed_kind_explains_itself(tmp_path):
    bare = plugins.make_plugin_manager(load_entry_points=False)
    with pytest.raises(ValueError, match="no drafter kinds are installed"):
        plugins.find_drafter_kind(
            {"architectures": ["Gemma4DSparkModel"]}, tmp_path, bare
        )
