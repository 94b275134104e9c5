"""``mlx_dspark doctor``: structure and consistency of its report, never its
timings; verdicts from injected cost tables."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_dspark import doctor
from mlx_dspark.confidence.calibration import Rounds
from mlx_dspark.distribution import DISTRIBUTION, providers
from mlx_dspark.doctor import estimate, main, typical_survival, verdict

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "deepspec-tiny"
TARGET = TINY / "target_tiny_gemma4"
DSPARK = TINY / "dspark_tiny_gemma4_block4"
DFLASH = TINY / "dflash_tiny_gemma4_block4"
CALIBRATION = ROOT / "examples" / "calibration" / "dspark_tiny_gemma4_block4.json"
QWEN3_TARGET = ROOT / "tests" / "fixtures" / "deepspec-qwen3-tiny" / "target_tiny_qwen3"
DSPARK_DRAFTER = {"block_size": 4, "max_draft_tokens": 4, "confidence": True}


def doctor_command(*args):
    env = {k: v for k, v in os.environ.items() if k != "MLX_DSPARK_DISABLE"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "mlx_dspark"), "doctor", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_doctor_reports_install_pair_costs_and_consistent_estimates():
    result = doctor_command(
        "--model", TARGET, "--draft-model", DSPARK,
        "--draft-calibration", CALIBRATION, "--json", "--depth", 64,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)

    install = report["install"]
    assert install["mlx_lm_supported"] and install["activation"] and install["patched"]
    assert install["distributions"] == [DISTRIBUTION] and not install["problems"]
    assert "deepspec-gemma4" in install["drafter_kinds"]

    drafter = report["pair"]["drafter"]
    assert report["pair"]["ok"] and report["pair"]["target"]["vocab_size"] == 512
    assert drafter == {
        "kind": "dspark",
        "block_size": 4,
        "max_draft_tokens": 4,
        "precision": "float32",
        "confidence": True,
        "calibration": True,
    }

    costs = report["costs"]
    assert costs["depth"] == 64 and len(costs["verify"]) == doctor.MAX_VERIFY
    assert all(c > 0 for c in [costs["draft"], *costs["verify"]])
    assert costs["decode"] == costs["verify"][0]

    # The measured acceptance is the calibration run's.
    fitted = json.loads(CALIBRATION.read_text())["report"]["fit"]["before"]
    survival = report["acceptance"]["survival"]
    assert report["acceptance"]["source"] == "calibration"
    assert survival == [p["accept_rate"] for p in fitted]

    rows = report["schedulers"]
    assert rows[0]["scheduler"] == "fixed" and rows[0]["drafts"] == 4
    assert rows[-1]["scheduler"] == "cost"
    # A proposal of k drafts costs between one's and the block's, linearly.
    assert costs["drafts"] == 4 and costs["draft_one"] > 0
    for row in rows:
        k = row["drafts"]
        tau = 1 + sum(survival[:k])
        drafting = costs["draft_one"] + (costs["draft"] - costs["draft_one"]) * (k - 1) / 3
        seconds = drafting + costs["verify"][k]
        assert row["tau"] == pytest.approx(tau, abs=1e-3)
        assert row["speedup"] == pytest.approx(
            tau * costs["decode"] / seconds, abs=1e-3
        )
    best = max(row["speedup"] for row in rows)
    assert report["verdict"]["best"]["speedup"] == best
    assert report["verdict"]["speculate"] == (best >= doctor.WORTH_IT)


def test_doctor_without_calibration_assumes_typical_acceptance(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"draft": 1.0, "verify": [10.0] * 5}))
    args = ["--model", str(TARGET), "--draft-model", str(DFLASH), "--json"]
    assert main([*args, "--costs", str(costs)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["acceptance"]["source"] == "typical"
    assert report["acceptance"]["survival"] == typical_survival(4)
    # DFlash has no confidences, so no cost scheduler.
    assert [r["scheduler"] for r in report["schedulers"]] == ["fixed"]

    assert main([*args, "--costs", str(costs), "--tau", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["acceptance"]["source"] == "--tau"
    assert report["acceptance"]["survival"] == typical_survival(4, 2.0)


def test_typical_survival_has_the_typical_mean_accepted_length():
    survival = typical_survival(doctor.TYPICAL_DRAFTS)
    assert 1 + sum(survival) == pytest.approx(doctor.TYPICAL_TAU, abs=1e-6)
    assert survival == sorted(survival, reverse=True)


def test_cheap_verifies_make_speculation_pay():
    survival = [0.9, 0.8, 0.7, 0.6]
    rows = estimate(survival, {"draft": 0.1, "verify": [1.0] * 5}, DSPARK_DRAFTER)
    result = verdict(rows)
    assert result["speculate"] and result["best"]["drafts"] == 4
    assert result["best"]["speedup"] == pytest.approx(4.0 / 1.1, abs=1e-3)
    assert "default settings" in result["line"]


def test_costly_verifies_make_plain_decoding_the_verdict():
    survival = [0.5, 0.25, 0.1, 0.05]
    costs = {"draft": 0.5, "verify": [1.0, 2.0, 3.0, 4.0, 5.0]}
    result = verdict(estimate(survival, costs, DSPARK_DRAFTER))
    assert not result["speculate"] and result["line"].startswith("Do not speculate")


def test_the_best_number_of_drafts_is_recommended():
    survival = [0.9, 0.2, 0.1, 0.05]
    costs = {"draft": 0.1, "verify": [1.0, 1.0, 3.0, 3.0, 3.0]}
    rows = estimate(survival, costs, DSPARK_DRAFTER)
    assert [r["drafts"] for r in rows] == [4, 1, 1]
    result = verdict(rows)
    assert result["best"]["drafts"] == 1 and "--num-draft-tokens 1" in result["line"]


def test_the_cost_scheduler_is_estimated_at_the_most_drafts_about_as_fast_as_the_best():
    """On the H200's bf16 verify curve 6 drafts are the fastest on paper and
    7 within 3% of them: ``fixed`` is recommended at 6, and ``cost``
    estimated at the 7 its rule drafts."""
    survival = np.cumprod([0.7, 0.55, 0.45, 0.35, 0.3, 0.25, 0.2]).tolist()
    costs = {"draft": 0.005, "verify": [c / 1000 for c in (12.8, 15.7, 15.8, 15.9, 16.1, 16.4, 16.0, 16.1)]}
    drafter = {"block_size": 7, "max_draft_tokens": 7, "confidence": True}
    rows = estimate(survival, costs, drafter)
    assert [(r["scheduler"], r["drafts"]) for r in rows] == [("fixed", 7), ("fixed", 6), ("cost", 7)]
    assert rows[2]["speedup"] < rows[1]["speedup"]


def test_a_drafter_that_drafts_one_at_a_time_is_estimated_at_the_drafts_it_draws():
    """The Gemma-4 assistant drafts a step a draft: on a flat verify curve
    at falling acceptance, one draft (a step, 5 ms) beats its block of six
    (30 ms), and each row is estimated at its own drafts' cost, also
    past the block (the assistant may draft up to 32)."""
    survival = np.cumprod([0.7, 0.55, 0.45, 0.35, 0.3, 0.25, 0.2, 0.2]).tolist()
    verify = [0.0128] + [0.016] * 8
    costs = {"draft": 0.030, "draft_one": 0.005, "drafts": 6, "verify": verify}
    drafter = {"block_size": 6, "max_draft_tokens": 32, "confidence": False}
    rows = estimate(survival, costs, drafter)
    assert [(r["scheduler"], r["drafts"]) for r in rows] == [("fixed", 6), ("fixed", 1)]
    for row in rows:
        k = row["drafts"]
        seconds = 0.005 * k + verify[k]
        assert row["speedup"] == pytest.approx((1 + sum(survival[:k])) * verify[0] / seconds, abs=1e-3)
    assert doctor.speedup(survival, 8, costs)["speedup"] == pytest.approx(
        (1 + sum(survival)) * verify[0] / (0.040 + verify[8]), abs=1e-3
    )


def test_doctor_reports_a_pair_that_does_not_fit(capsys):
    assert main(["--model", str(QWEN3_TARGET), "--draft-model", str(DSPARK)]) == 1
    out = capsys.readouterr().out
    assert "pair: The drafter" in out and "qwen3" in out


def test_bad_cost_files_and_options_are_one_line_errors(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"draft": 1.0, "verify": [0.0, 1.0]}))
    args = ["--model", str(TARGET), "--draft-model", str(DSPARK)]
    assert main([*args, "--costs", str(costs)]) == 2
    assert "needs positive seconds" in capsys.readouterr().err
    assert main([*args, "--tau", "0.5"]) == 2
    assert "--tau must be in" in capsys.readouterr().err


def test_a_second_distribution_providing_the_package_is_found(tmp_path, monkeypatch):
    info = tmp_path / "other_dspark-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-dspark\n")
    (info / "RECORD").write_text("mlx_dspark/__init__.py,,\n")
    assert providers() == [DISTRIBUTION]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert providers() == [DISTRIBUTION, "other-dspark"]


def test_the_threshold_scheduler_is_replayed_round_by_round():
    """Each round verifies its drafts up to the first with σ(z) < t and
    keeps the accepted ones among them; drafting is paid in every round."""
    rounds = Rounds(
        logits=np.array([[2.0, 1.0, -1.0], [-3.0, 2.0, 2.0], [4.0, 4.0, 4.0]]),
        verified=np.array([3, 3, 2]),  # the last round ran out of budget
        accepted=np.array([2, 1, 2]),
    )
    costs = {"draft": 1.0, "verify": [10.0, 12.0, 13.0, 15.0]}
    (row,) = doctor.threshold_estimates(rounds, costs, thresholds=[0.5])
    # Verified 2, 0 and 2 drafts; kept 2, 0 and 2.
    assert row["drafts"] == pytest.approx(4 / 3, abs=0.01)
    assert row["tau"] == pytest.approx(7 / 3, abs=1e-3)
    assert row["speedup"] == pytest.approx(7 * 10.0 / (3 * 1.0 + 13 + 10 + 13), abs=1e-3)
    # A threshold every draft passes is the fixed schedule on these rounds.
    (everything,) = doctor.threshold_estimates(rounds, costs, thresholds=[0.0])
    assert everything["tau"] == pytest.approx(1 + 5 / 3, abs=1e-3)


def test_doctor_measures_acceptance_on_prompts_and_estimates_the_threshold_scheduler(
    tmp_path,
):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"draft": 1.0, "verify": [10.0] * 6}))
    result = doctor_command(
        "--model", TARGET, "--draft-model", DSPARK, "--json", "--costs", costs,
        "--prompts", ROOT / "examples" / "calibration" / "tiny_prompts.txt",
        "--max-tokens", 16,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["acceptance"]["source"].startswith("measured on")
    survival = report["acceptance"]["survival"]
    assert len(survival) == 4 and 1 >= survival[0] >= survival[-1] >= 0
    thresholds = [r for r in report["schedulers"] if r["scheduler"] == "threshold"]
    assert [r["threshold"] for r in thresholds] == list(doctor.THRESHOLDS)
    # Higher thresholds verify fewer drafts.
    drafts = [r["drafts"] for r in thresholds]
    assert drafts == sorted(drafts, reverse=True) and drafts[0] <= 4
    fixed = report["schedulers"][0]
    assert fixed["tau"] == pytest.approx(1 + sum(survival), abs=1e-3)


def test_doctor_compares_the_drafter_quantized_to_8_and_4_bits():
    """``--precisions`` times the drafter quantized in memory and estimates
    each precision from its own draft cost and the same acceptance."""
    result = doctor_command(
        "--model", TARGET, "--draft-model", DSPARK, "--json", "--depth", 32,
        "--precisions",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["precisions"]
    assert [r["precision"] for r in rows] == ["8-bit", "4-bit"]
    survival, costs = report["acceptance"]["survival"], report["costs"]
    for row in rows:
        k = row["drafts"]
        assert row["draft"] > 0 and 1 <= k <= 4
        tau = 1 + sum(survival[:k])
        # A proposal of k drafts costs on the line through one draft's and
        # the block's (a block drafter's two differ only by timing noise).
        one, block = row["draft_one"], row["draft"]
        share = (k - 1) / (costs["drafts"] - 1)
        drafting = max(one + (block - one) * share, min(one, block))
        assert row["speedup"] == pytest.approx(
            tau * costs["decode"] / (drafting + costs["verify"][k]), abs=1e-3
        )


def test_a_quantized_copy_is_quantized_but_keeps_the_confidence_head_float():
    drafter = doctor.quantized_copy(str(DSPARK), 4)
    layers = dict(drafter.model.named_modules())
    assert any(type(m).__name__ == "QuantizedLinear" for m in layers.values())
    assert all(
        type(m).__name__ != "QuantizedLinear"
        for path, m in layers.items()
        if "confidence_head" in path
    )
