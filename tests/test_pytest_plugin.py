"""The pytest plugin, run as a team would run it: in its own pytest session (pytester), with real models."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from accudiff.model.inputs import save_feeds
from accudiff.runners import unavailable_reason
from conftest import fixture

CLEAN, BROKEN = fixture("clean"), fixture("layernorm_overflow")


def _run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_model=source)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_fixture_form_passes(pytester):
    result = _run(pytester, f"""
def test_clean(accudiff):
    result = accudiff.compare(r"{CLEAN}", precision="fp16").assert_within(atol=1e-2, min_sqnr_db=30)
    assert result.passed
""")
    result.assert_outcomes(passed=1)


def test_fixture_form_fails_with_an_actionable_message(pytester):
    result = _run(pytester, f"""
def test_broken(accudiff):
    accudiff.compare(r"{BROKEN}", precision="fp16").assert_within()
""")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "layernorm_overflow.onnx [fp16] is out of bounds" in text
    assert "tensor 'y': 128 of 128 elements (100.00%) outside atol=0.001" in text
    assert "worst element [" in text and "reference" in text and "candidate" in text
    assert "cause: Pow 'ln_square' introduces the error (its output 'squared'; verified at the output)" in text and "repair (verified" in text
    assert "overflow: reference absmax" in text
    assert "full report: " in text
    assert "pytest_plugin.py" not in text and "checker.py" not in text and "api.py" not in text  # no internal traceback noise
    summary = text.split(" accudiff ")[-1]  # the plugin's terminal summary section
    assert f"FAILED {BROKEN} [fp16] (test_model.py::test_broken)" in summary
    # The verified cause first; the lowest-SQNR tensors after it, said to be where the error is largest,
    # not its cause (they listed absorbed GELU tensors above the cause, as if they were the fault).
    cause = summary.index("output 'y': cause: Pow 'ln_square' introduces the error")
    assert cause < summary.index("lowest SQNR (where the error is largest, not what causes it):") < summary.index("squared: SQNR -200.0 dB, max abs err inf")


def test_marker_form_pass_and_fail(pytester):
    result = _run(pytester, f"""
import numpy as np
import pytest

@pytest.mark.accudiff(model=r"{CLEAN}", precision="fp16", atol=1e-2)
def test_clean():
    pass

@pytest.mark.accudiff(model=r"{BROKEN}", precision="fp16", min_sqnr_db=40, tensors="all")
def test_broken():
    pass
""")
    result.assert_outcomes(passed=1, failed=1)
    assert "SQNR" in result.stdout.str() and "below the required 40 dB" in result.stdout.str()


def test_the_marker_takes_decision_targets_and_a_misspelt_option_is_one_sentence(pytester):
    """`@pytest.mark.accudiff(..., kl=0.05)` stopped with RunSettings' TypeError and the plugin's traceback (the
    fixture form takes decision targets, the marker did not), as any misspelt option still did in both forms."""
    result = _run(pytester, f"""
import pytest

@pytest.mark.accudiff(model=r"{CLEAN}", precision="fp16", top1=0.5, kl=0.05)
def test_by_its_decision():
    pass

@pytest.mark.accudiff(model=r"{CLEAN}", precision="fp16", iteration=2)
def test_misspelt_marker():
    pass

def test_misspelt_fixture(accudiff):
    accudiff.compare(r"{CLEAN}", precision="fp16", keep_fp23=["c1"]).assert_within()
""")
    result.assert_outcomes(passed=1, failed=2)
    text = result.stdout.str()
    assert "compare() takes no option 'iteration': did you mean iterations=?" in text and "compare() takes no option 'keep_fp23': did you mean keep_fp32=?" in text
    assert "TypeError" not in text and "pytest_plugin.py" not in text, text


def test_min_sqnr_on_named_tensors(pytester):
    result = _run(pytester, f"""
def test_named(accudiff):
    accudiff.compare(r"{CLEAN}", precision="int8").assert_within(min_sqnr_db=60, tensors=["c1"])
""")
    result.assert_outcomes(failed=1)
    assert "tensor 'c1': SQNR" in result.stdout.str()


def _matmul_model(path, scale: float) -> str:
    """y = x @ W with W scaled by `scale`: at 1e-6 its FP16 values and products are subnormal, and lose bits."""
    import onnx
    from onnx import helper, numpy_helper

    weight = numpy_helper.from_array((np.random.default_rng(0).normal(size=(16, 8)) * scale).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["logits"], name="mm")], "g", [helper.make_tensor_value_info("x", 1, [2, 16])],
                              [helper.make_tensor_value_info("logits", 1, [2, 8])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return str(path)


def test_a_missing_baseline_fails_once_then_catches_a_regression(pytester, monkeypatch):
    """A missing baseline is written and fails its test ('commit it'): a baseline a run writes and passes
    with never fires on a fresh checkout. Under CI it is not written. Then the same check passes, a worse
    model fails (SQNR fell), --accudiff-update-baseline accepts it, and a baseline recorded with another
    precision or other options is never compared with."""
    monkeypatch.delenv("CI", raising=False)
    model = _matmul_model(pytester.path / "m.onnx", 1.0)
    source = """
import pytest

@pytest.mark.accudiff(model=r"{model}", precision="{precision}", atol=1, rtol=1, baseline=True)
def test_model():
    pass
"""
    baseline = pytester.path / "accudiff_baselines" / "test_model.test_model.fp16.json"
    monkeypatch.setenv("CI", "true")
    in_ci = _run(pytester, source.format(model=model, precision="fp16"))
    in_ci.assert_outcomes(failed=1)
    assert "no baseline at" in in_ci.stdout.str() and not baseline.exists()
    monkeypatch.delenv("CI")

    first = _run(pytester, source.format(model=model, precision="fp16"))
    first.assert_outcomes(failed=1)
    assert "baseline created:" in first.stdout.str() and "commit it" in first.stdout.str() and "baseline written" in first.stdout.str()
    stored = json.loads(baseline.read_text())
    assert stored["schema"] == "accudiff.baseline" and set(stored["tensors"]) == {"logits"} and stored["precision"] == "fp16"

    _run(pytester, source.format(model=model, precision="fp16")).assert_outcomes(passed=1)

    _matmul_model(pytester.path / "m.onnx", 1e-6)  # the same check of a model whose FP16 values are subnormal
    worse = _run(pytester, source.format(model=model, precision="fp16"))
    worse.assert_outcomes(failed=1)
    assert "SQNR fell from" in worse.stdout.str() and "more than the allowed 3 dB" in worse.stdout.str()

    _run(pytester, source.format(model=model, precision="fp16"), "--accudiff-update-baseline").assert_outcomes(passed=1)
    _run(pytester, source.format(model=model, precision="fp16")).assert_outcomes(passed=1)

    other_precision = _run(pytester, source.format(model=model, precision="bf16"))  # a baseline of its own, missing
    other_precision.assert_outcomes(failed=1)
    assert "test_model.test_model.bf16.json: commit it" in other_precision.stdout.str()

    other_options = _run(pytester, source.replace("atol=1,", "atol=0.5,").format(model=model, precision="fp16"))
    other_options.assert_outcomes(failed=1)
    assert "was recorded with other settings (atol differ)" in other_options.stdout.str()


def test_two_candidate_models_of_one_test_keep_a_baseline_each(pytester, monkeypatch):
    """Baselines were named by the precision, which is "fp32" for every candidate model given as a file: the
    second candidate of a test found the first one's baseline and failed as "recorded with other settings".
    A candidate model's baseline is named by its path (from the rootdir): two GenAI folders both hold a model.onnx."""
    monkeypatch.delenv("CI", raising=False)
    pytester.makeini("[pytest]\n")
    model = _matmul_model(pytester.path / "m.onnx", 1.0)
    for name in ("a", "b"):
        (pytester.path / name).mkdir()
        (pytester.path / name / "model.onnx").write_bytes((pytester.path / "m.onnx").read_bytes())
    source = f"""
def test_candidates(accudiff):
    for name in ("a", "b"):
        accudiff.compare(r"{model}", candidate_model=f"{{name}}/model.onnx").assert_within(atol=1, rtol=1, baseline=True)
"""
    first = _run(pytester, source)
    first.assert_outcomes(failed=1)  # the first baseline is written: commit it (the test stops there)
    _run(pytester, source).assert_outcomes(failed=1)  # the second one's, now
    folder = pytester.path / "accudiff_baselines"
    assert sorted(p.name for p in folder.iterdir()) == ["test_model.test_candidates.candidate-a_model.onnx.json",
                                                       "test_model.test_candidates.candidate-b_model.onnx.json"]
    _run(pytester, source).assert_outcomes(passed=1)


def test_a_baseline_holds_the_decision_figures_to_their_intervals(pytester, monkeypatch):
    """A baseline kept only per-tensor figures: a language model whose KL divergence grew, or a classifier whose
    top-1 agreement fell, passed as long as SQNR and max abs error stayed within their margins. It now keeps
    each output's decision figures with their 95% intervals, and a figure outside the baseline's interval on
    the worse side fails the test (here the baseline claims a KL of 0, which FP16 does not reach)."""
    monkeypatch.delenv("CI", raising=False)
    model = _matmul_model(pytester.path / "m.onnx", 1.0)
    source = f"""
import pytest

@pytest.mark.accudiff(model=r"{model}", precision="fp16", atol=1, rtol=1, baseline=True)
def test_model():
    pass
"""
    _run(pytester, source).assert_outcomes(failed=1)  # the baseline is written: commit it
    baseline = pytester.path / "accudiff_baselines" / "test_model.test_model.fp16.json"
    stored = json.loads(baseline.read_text())
    kl = stored["decisions"]["logits"]["kl"]
    assert set(stored["decisions"]["logits"]) >= {"top1", "kl"} and kl["low"] <= kl["value"] <= kl["high"] and kl["value"] > 0
    _run(pytester, source).assert_outcomes(passed=1)
    stored["decisions"]["logits"]["kl"] = {"value": 0, "low": 0, "high": 0}
    baseline.write_text(json.dumps(stored))
    regressed = _run(pytester, source)
    regressed.assert_outcomes(failed=1)
    assert "output 'logits': KL divergence (mean) rose from 0 [0, 0] (baseline) to" in regressed.stdout.str()
    assert "outside the baseline's 95% interval" in regressed.stdout.str()


@pytest.mark.skipif(unavailable_reason("trt") is None, reason="TensorRT inference works on this machine")
def test_checks_that_need_tensorrt_skip_with_the_reason(pytester):
    result = _run(pytester, f"""
def test_trt(accudiff):
    accudiff.compare(r"{CLEAN}", precision="fp16", candidate="trt").assert_within()
""", "-rs")
    result.assert_outcomes(skipped=1)
    assert f"accudiff: {unavailable_reason('trt')}" in result.stdout.str()


def test_ini_tolerances_and_report_dir(pytester):
    pytester.makeini("""
[pytest]
accudiff_tolerances =
    fp16 atol=1 rtol=1 stol=1
accudiff_report_dir = my_reports
""")
    result = _run(pytester, f"""
def test_broken_but_tolerated(accudiff):
    accudiff.compare(r"{fixture('underflow')}", precision="fp16").assert_within()
""")
    result.assert_outcomes(passed=1)
    assert any((pytester.path / "my_reports").iterdir())


def test_paths_are_read_from_the_rootdir_and_a_refusal_is_one_sentence(pytester):
    """Relative paths in the marker and the fixture both name files from pytest's rootdir, whichever folder
    pytest runs in (the marker read them from the test file's folder, the fixture from the working folder); a check accudiff refuses fails
    with its one sentence, no 'During handling of the above exception' chain."""
    pytester.makeini("[pytest]\n")
    (pytester.path / "models").mkdir()
    (pytester.path / "models" / "clean.onnx").write_bytes(CLEAN.read_bytes())
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_paths.py").write_text("""
import pytest

@pytest.mark.accudiff(model="models/clean.onnx", precision="fp16", atol=1e-2)
def test_marker():
    pass

def test_fixture(accudiff):
    accudiff.compare("models/clean.onnx", precision="fp16").assert_within(atol=1e-2)

def test_missing(accudiff):
    accudiff.compare("models/gone.onnx", precision="fp16").assert_within()
""")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", "..", "test_paths.py"],
                          cwd=pytester.path / "tests", capture_output=True, text=True)  # run from elsewhere than the rootdir
    out = done.stdout
    assert "2 passed" in out and "1 failed" in out, out
    assert "accudiff: model file" in out and "models/gone.onnx' does not exist" in out
    assert "During handling" not in out and "Traceback" not in out


def test_works_under_xdist(pytester):
    result = _run(pytester, f"""
import numpy as np
import pytest

@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_clean(accudiff, precision):
    accudiff.compare(r"{CLEAN}", precision=precision).assert_within()

def test_broken(accudiff):
    accudiff.compare(r"{BROKEN}", precision="fp16").assert_within()
""", "-n", "2")
    result.assert_outcomes(passed=2, failed=1)
    assert "FAILED " in result.stdout.str() and "layernorm_overflow.onnx [fp16]" in result.stdout.str()


def test_a_dataset_split_over_workers_names_the_failing_samples(pytester, tmp_path):
    rng = np.random.default_rng(0)
    feeds = [{"x": (rng.uniform(0, 1, (1, 16)) * (8.0 if i in (1, 4) else 0.2)).astype(np.float32)} for i in range(6)]
    save_feeds(feeds, tmp_path / "samples.npz")
    pytester.makeini("""
[pytest]
accudiff_workers = 2
""")
    result = _run(pytester, f"""
def test_dataset(accudiff):
    accudiff.compare(r"{fixture('overflow_activation')}", precision="fp16", inputs=r"{tmp_path / 'samples.npz'}").assert_within()
""")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "samples: output 'y' fails on 2 of 6 (worst: sample " in text
    assert "worst_samples.npz" in text
