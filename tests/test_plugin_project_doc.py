"""docs/plugin-project.md is a project that works as written: its files built from the page (each block
headed '# file: PATH'), accudiff's accumulating classifier as its model, its commands run in order."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np

from conftest import ROOT, fixture

PAGE = ROOT / "docs" / "plugin-project.md"


def _project(folder):
    text = PAGE.read_text()
    for block in re.findall(r"```\w*\n(.*?)```", text, re.S):
        first, _, body = block.partition("\n")
        if first.startswith("# file: "):
            target = folder / first.removeprefix("# file: ").strip()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
    (folder / "models").mkdir()
    shutil.copy(fixture("accumulating_classifier"), folder / "models" / "classifier.onnx")
    (folder / "data").mkdir()
    np.savez(folder / "data" / "batch0.npz", x=np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32))
    return folder


def _pytest(folder, ci: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    if ci:
        env["CI"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=folder, env=env,
                          capture_output=True, text=True)


def test_the_documented_project_runs_as_the_page_says(tmp_path):
    folder = _project(tmp_path / "classifier-project")
    assert {"pyproject.toml", "tests/test_accuracy.py"} <= {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}

    under_ci = _pytest(folder, ci=True)
    assert under_ci.returncode == 1 and "1 failed, 2 passed" in under_ci.stdout, under_ci.stdout
    assert not (folder / "tests" / "accudiff_baselines").exists()  # under CI a missing baseline is not written

    first = _pytest(folder)
    assert first.returncode == 1 and "1 failed, 2 passed" in first.stdout and "baseline created" in first.stdout, first.stdout
    assert list((folder / "tests" / "accudiff_baselines").glob("*.json"))

    second = _pytest(folder)  # the baseline committed: the suite passes
    assert second.returncode == 0 and "3 passed" in second.stdout, second.stdout
