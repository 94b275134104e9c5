"""mlx-lm's own tests (tests/mlx_lm_upstream) pass with mlx-dspark active,
with the same outcome per test as without it."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

UPSTREAM = Path(__file__).parent / "mlx_lm_upstream"


def outcomes(tmp_path, **env) -> dict:
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--confcutdir={UPSTREAM}",
            f"--junitxml={report}",
            str(UPSTREAM),
        ],
        env={**os.environ, **env},
        cwd=UPSTREAM,
        capture_output=True,
        check=False,
    )
    result = {}
    for case in ET.parse(report).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag + ":" + child.get("type", "")
        result[f"{case.get('classname')}.{case.get('name')}"] = outcome
    return result


def test_mlx_lm_tests_pass_with_the_plugin_as_without(tmp_path):
    active = outcomes(tmp_path, MLX_DSPARK_DISABLE="0")
    stock = outcomes(tmp_path, MLX_DSPARK_DISABLE="1")
    assert len(active) > 100
    assert {k: v for k, v in active.items() if v != "passed" and "xfail" not in v} == {}
    assert active == stock
