"""Options and figures the README and docs/ promise, each run as documented: --version, the internal-error
path and --debug, the default tolerances of every format (from the README's own table), --verify-budget,
--objective decision, the plugin's command-line flags."""

from __future__ import annotations

import json

import pytest

import accudiff
import oracle
from accudiff.cli import main
from accudiff.judging.tolerances import default_tolerance
from accudiff.version import __version__
from conftest import fixture


def test_version(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"accudiff {__version__}"


def test_an_internal_error_is_one_sentence_and_debug_shows_where(run_cli, monkeypatch):
    """A bug of ours (injected here: the run's grouping stage raises) is one sentence naming --debug; with
    --debug, after the command too, the traceback."""
    import accudiff.api

    def broken(*args, **kwargs):
        raise RuntimeError("a planted bug")

    monkeypatch.setattr(accudiff.api, "run_group", broken)
    code, _, err = run_cli("compare", fixture("clean"), "--fp16")
    assert code == 2 and err == "accudiff: internal error: RuntimeError: a planted bug (rerun with --debug for details)\n"
    code, _, err = run_cli("compare", fixture("clean"), "--fp16", "--debug")
    assert code == 2 and "Traceback (most recent call last)" in err and 'raise RuntimeError("a planted bug")' in err


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8"])
def test_each_run_uses_the_readmes_default_tolerance(precision, run_cli, tmp_path):
    flag = [] if precision == "fp32" else [f"--{precision}"]
    run_cli("compare", fixture("clean"), *flag, "--no-verify", "-o", "r")
    used = json.loads((tmp_path / "r" / "summary.json").read_text())["tolerances"]
    assert (used["atol"], used["rtol"], used["stol"]) == oracle.documented_tolerance(precision)


@pytest.mark.parametrize("precision", ["fp8", "int4", "fp4", "int4-weight", "int8-dynamic", "int8-weight"])
def test_formats_of_candidate_models_have_the_readmes_default_tolerance(precision):
    tolerance = default_tolerance(precision)
    assert (tolerance.atol, tolerance.rtol, tolerance.stol) == oracle.documented_tolerance(precision)


def test_a_candidate_holding_several_formats_gets_the_loosest_of_theirs():
    mixed = default_tolerance("int8-dynamic+int4-weight")
    rows = [oracle.documented_tolerance(p) for p in ("int8-dynamic", "int4-weight")]
    assert (mixed.atol, mixed.rtol, mixed.stol) == tuple(max(values) for values in zip(*rows))
    assert rows[0] != rows[1]  # else "the loosest" would be vacuous


def test_verify_budget_is_checked_and_carried_into_the_replay(run_cli, tmp_path):
    """--verify-budget bounds the runs that try suspects and grow the repair (the cause search has its own,
    --cause-budget): a budget under one run is refused, and the replay line carries the one given."""
    code, _, err = run_cli("compare", fixture("absorbed_then_overflow"), "--fp16", "--verify-budget", "0")
    assert code == 2 and err.count("\n") == 1 and "--verify-budget" in err, err
    result = accudiff.compare(fixture("absorbed_then_overflow"), "fp16", candidate="onnxrt", verify_budget=4, report_dir=tmp_path / "r")
    replay = result.replay
    assert replay[replay.index("--verify-budget") + 1] == "4" and result.output_failures[0].cause.verified


def test_objective_decision_judges_keeps_by_the_decision(tmp_path):
    """layernorm_overflow's output is a Softmax's probabilities: judged by top-1 agreement, the repair need
    only bring the top class back, and the verification says the figure it aimed at."""
    by_tolerance = accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="onnxrt").output_failures[0]
    by_decision = accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="onnxrt", objective="decision").output_failures[0]
    assert by_tolerance.repair.verified and by_decision.repair.verified
    assert by_decision.repair.steps[-1].figures.get("top1") == 1.0
    assert len(by_decision.repair.keep) <= len(by_tolerance.repair.keep)


def test_the_plugins_command_line_flags(pytester):
    """--accudiff-candidate and --accudiff-report-dir, as documented beside their ini forms."""
    pytester.makepyfile(test_model=f"""
def test_clean(accudiff):
    accudiff.compare(r"{fixture('clean')}", precision="fp16").assert_within(atol=1e-2)
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--accudiff-candidate", "onnxrt", "--accudiff-report-dir", "flagged")
    result.assert_outcomes(passed=1)
    assert [p.name for p in (pytester.path / "flagged").iterdir()] and not (pytester.path / "reports").exists()
    refused = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--accudiff-candidate", "nope")
    assert refused.ret != 0 and "nope" in refused.stdout.str() + refused.stderr.str()
