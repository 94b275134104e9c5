import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

FIXTURES = Path(__file__).parent / "fixtures"

# Calibrations and measured cost profiles go to a fresh folder, never the
# user's cache (tests that look at them set their own).
os.environ.setdefault("MLX_DSPARK_CACHE", tempfile.mkdtemp(prefix="mlx-dspark-tests-"))
DEEPSPEC_TINY = FIXTURES / "deepspec-tiny"

# mlx-lm's own tests run in subprocesses, with and without mlx-dspark
# (tests/test_mlx_lm_upstream.py).
collect_ignore = ["mlx_lm_upstream"]

# "ci" (the default) keeps the whole suite to a few minutes on two cores,
# with the same examples each run (a CI run fails for a change, not for a
# draw); HYPOTHESIS_PROFILE=thorough explores far more, new ones each run.
settings.register_profile(
    "ci",
    max_examples=12,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def checkpoint(tmp_path):
    """A writable copy of the tiny DSpark checkpoint."""
    path = tmp_path / "dspark"
    shutil.copytree(DEEPSPEC_TINY / "dspark_tiny_gemma4_block4", path)
    return path


@pytest.fixture(scope="session")
def tiny_pair():
    """The bundled trained tiny Gemma-4 target, its tokenizer, and the DSpark drafter."""
    from mlx_lm import load

    import mlx_dspark

    model, tokenizer = load(str(DEEPSPEC_TINY / "target_tiny_gemma4"))
    drafter = mlx_dspark.load_drafter(DEEPSPEC_TINY / "dspark_tiny_gemma4_block4")
    return model, tokenizer, drafter


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding deepseek-ai/dspark_tiny."""
    import huggingface_hub.constants as constants

    repo = tmp_path / "models--deepseek-ai--dspark_tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    shutil.copytree(
        DEEPSPEC_TINY / "dspark_tiny_gemma4_block4", repo / "snapshots" / "0123abcd"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


@pytest.fixture
def frequent_probes(monkeypatch):
    """A parked policy probes every ``REPROBE_EVERY`` rounds, whatever its
    probes lose (for tests of what a probe does, not of how often)."""
    from mlx_dspark.batching import policy

    monkeypatch.setattr(policy, "PROBE_SHARE", float("inf"))
