"""Shared test helpers: fixture models, and running the command line in-process."""

from __future__ import annotations

import os
import sys
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
