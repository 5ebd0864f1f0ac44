"""The README's two commands, run as a new user runs them: a clone of the repository (what is committed), a
new virtual environment with nothing else in it, the first command (it installs accudiff and compares a
bundled fixture: exit 1, as the README says), then the second (the test suite: exit 0, every test that needs
a package the README does not install skipping, saying which).

Minutes of installing and testing, so it runs where ACCUDIFF_FRESH_MACHINE=1 is set: `.ci/run` sets it in
a step of its own, besides running the README's test command with every extra installed. The suite it
starts runs without the variable, so it never starts itself again."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

FRESH = os.environ.get("ACCUDIFF_FRESH_MACHINE") == "1"


def readme_commands() -> list[str]:
    """The commands of the README's first code block: the install-and-compare line and the test line."""
    block = re.search(r"```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_the_readme_names_two_commands():
    install, tests = readme_commands()
    assert install.startswith("pip install") and "accudiff compare" in install and tests.startswith("python -m pytest")


@pytest.mark.skipif(not FRESH, reason="installs into a new virtual environment and runs the suite there: set ACCUDIFF_FRESH_MACHINE=1 (.ci/run does)")
def test_the_readmes_commands_work_on_a_fresh_machine(tmp_path):
    repository = tmp_path / "accudiff"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(repository)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    environment = {key: value for key, value in os.environ.items() if key not in ("ACCUDIFF_FRESH_MACHINE", "ACCUDIFF_CI", "PYTHONPATH", "VIRTUAL_ENV")}
    environment["PATH"] = f"{tmp_path / 'venv' / 'bin'}{os.pathsep}{environment.get('PATH', '')}"
    environment["VIRTUAL_ENV"] = str(tmp_path / "venv")
    said = {}
    for command, expected in zip(readme_commands(), (1, 0)):  # the fixture fails in FP16; the suite passes
        done = subprocess.run(["bash", "-c", command], cwd=repository, env=environment, capture_output=True, text=True)
        assert done.returncode == expected, f"`{command}` exited {done.returncode}, not {expected}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
        said[expected] = done.stdout
    assert "verdict: FAIL" in said[1], said[1][-2000:]
    passed, skipped = (int(re.search(rf"(\d+) {word}", said[0]).group(1)) for word in ("passed", "skipped"))
    assert passed > 2 * skipped, said[0][-2000:]  # most of the suite runs on accudiff's own dependencies
    reasons = re.split(r"; (?=\d+ x )", re.search(r"skipped by reason: (.*)", said[0]).group(1))  # a reason may hold "; " itself
    assert all("needs " in r or "install" in r or "TensorRT inference" in r for r in reasons), reasons  # a package the README does not install


def test_under_ci_only_the_listed_skips_are_allowed(pytester, monkeypatch):
    """This suite's own conftest, in a session of its own: under ACCUDIFF_CI=1 (.ci/run) a test skipping
    because a package or a model is missing fails; a skip for want of a GPU stays a skip; the run ends with
    the skips counted by reason. Without the variable (a newcomer's machine) both are skips."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_skips="""
import pytest

def test_needs_a_wheel():
    pytest.skip("needs magika (the 'magika' package is not installed)")

def test_needs_a_gpu():
    pytest.skip("TensorRT inference: no NVIDIA GPU is visible on this machine")
""")
    monkeypatch.setenv("ACCUDIFF_CI", "1")
    strict = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    strict.assert_outcomes(failed=1, skipped=1)
    assert "skipped under CI" in strict.stdout.str()
    assert "skipped by reason: 1 x TensorRT inference: no NVIDIA GPU is visible on this machine" in strict.stdout.str()
    monkeypatch.delenv("ACCUDIFF_CI")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(skipped=2)
