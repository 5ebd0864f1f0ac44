"""The command line and the report folder, as a user meets them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pandas as pd
import pytest

import accudiff
from accudiff.runners import unavailable_reason
from conftest import ROOT, fixture, run_printed, user_shell_environment


def test_passing_model_exits_0_and_writes_a_complete_report(run_cli, tmp_path):
    code, out, err = run_cli("compare", fixture("clean"), "--fp16", "--report-dir", tmp_path / "report")
    assert code == 0, err
    assert "verdict: PASS" in out
    report = tmp_path / "report"
    assert sorted(p.name for p in report.iterdir()) == ["candidate-fp16.onnx", "inputs.npz", "report.html", "samples.csv", "summary.json", "summary.md", "tensors.csv"]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["schema"] == "accudiff.compare.summary" and summary["schema_version"] == 6
    assert summary["verdict"] == "pass" and summary["precision"] == "fp16"
    assert {"load", "transform", "run", "diagnose"} <= set(summary["timings_s"])
    table = pd.read_csv(report / "tensors.csv")
    assert list(table["tensor"]) == ["c1", "r1", "c2", "r2", "pooled", "flat", "logits"]  # topological order


def test_failing_model_exits_1_and_names_the_cause(run_cli, tmp_path):
    code, out, _ = run_cli("compare", fixture("layernorm_overflow"), "--fp16", "--report-dir", tmp_path / "r")
    assert code == 1
    assert "output 'y' FAILS" in out and "cause: Pow 'ln_square' introduces the error (its output 'squared'; verified at the output)" in out
    assert "overflow: reference absmax" in out and "exceeds the FP16 maximum 65504" in out
    assert "verdict: FAIL" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["first_failure"]["tensor"] == "squared"
    [output] = summary["outputs"]
    cause = output["cause"]
    assert (cause["kind"], cause["node"], cause["tensor"], cause["op_type"]) == ("local", "ln_square", "squared", "Pow")
    assert cause["findings"][0]["kind"] == "overflow" and cause["contributors"] and cause["verified"]
    assert output["repair"]["verified"] and output["repair"]["keep"][0] == "ln_square" and output["repair"]["steps"][-1]["tol_ratio"] <= 1
    assert output["first_failing_upstream"] == "squared"


def test_bf16_from_the_command_line_names_the_cause_and_its_repair_holds(run_cli, tmp_path):
    """--bf16 end to end: the cancelling variance is named in BF16's terms, its printed keep-list passes when
    pasted, and bisect subgraph says what kind of cause it starts from."""
    path = fixture("bf16_cancelling_variance")
    code, out, _ = run_cli("compare", path, "--bf16", "--report-dir", tmp_path / "r")
    assert code == 1 and "[bf16]" in out
    assert "cause: Sub 'ln_variance' introduces the error" in out and "so BF16's rounding of what it reads (2^-8 of its size)" in out
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["precision"] == "bf16"
    lines = out.splitlines()
    applied = lines[next(k for k, line in enumerate(lines) if line.strip() == "apply it:") + 1].strip()
    assert applied.startswith("accudiff compare ") and "--keep-fp32 ln_variance" in applied
    done = run_printed(applied, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    code, out, _ = run_cli("bisect", "subgraph", path, "--bf16", "--atol", "1e-2", "--rtol", "1e-2", "--stol", "0", "-o", tmp_path / "s")
    assert code == 1 and "failing output: 'y' (one node carries most of the error, the rest accumulates)" in out
    # ln_variance alone, fed BF16's rounding of what it reads, fails at less than half the whole model's 10.8x:
    # with what computes its operands it shows the failure as it is.
    assert "smallest failing subgraph (3 node(s), checked at 'ln_var'): ln_mean_of_squares, ln_mean_squared, ln_variance" in out
    assert "reproducer confirmed to fail ('ln_var' at 10.8x its tolerance, 10.8x in the whole model)" in out


def test_timings_say_where_the_time_went(run_cli, tmp_path):
    code, out, _ = run_cli("compare", fixture("layernorm_overflow"), "--fp16", "--report-dir", tmp_path / "r", "--timings")
    assert code == 1
    assert "time: " in out and "stages: import" in out and "report" in out and "comparison workers" in out and "verification workers" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())  # written during the report stage, so without it
    assert {"import", "load", "plan", "transform", "run", "diagnose", "verify"} <= summary["timings_s"].keys()
    comparison = summary["worker_timings_s"]["comparison"]
    assert {"sessions", "statistics", "runs: reference", "runs: candidate", "runs: isolated"} <= comparison.keys()
    verification = summary["worker_timings_s"]["verification"]
    assert "runs: variant0" in verification
    assert "runs: reference" not in verification  # the comparison recorded the reference's outputs: replayed


def test_first_failure_is_a_fact_never_called_the_cause(run_cli, tmp_path):
    code, out, _ = run_cli("compare", fixture("kept_feeds_fp16"), "--fp16", "--keep-fp32", "bn", "--report-dir", tmp_path / "r")
    assert code == 1
    assert "first tensor out of tolerance (topological order): 'centred'" in out
    assert "cause: Mul 'attenuate' is one of several causes" in out  # verified: it and 'lift' repair the output together
    assert "on its own" not in out.split("cause:")[0]  # nothing before the cause claims an isolated result


def test_default_report_folder_is_under_reports(run_cli, tmp_path):
    code, out, _ = run_cli("compare", fixture("clean"))
    assert code == 0
    [folder] = (tmp_path / "reports").iterdir()
    assert folder.name.startswith("clean-fp32-")
    reason = unavailable_reason("trt")
    if reason is not None:  # the one-line notice of the automatic fallback
        assert f"notice: {reason}; using the ONNX Runtime candidate" in out


def test_existing_report_is_never_overwritten(run_cli, tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    code, out, err = run_cli("compare", fixture("clean"), "--report-dir", target)
    assert code == 2 and "already exists" in err
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_failed_run_leaves_nothing_behind(run_cli, tmp_path):
    code, _, err = run_cli("compare", fixture("clean"), "--load-inputs", tmp_path / "missing.npz", "--report-dir", tmp_path / "r")
    assert code == 2 and "does not exist" in err
    assert not (tmp_path / "r").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "missing.onnx"], "model file 'missing.onnx' does not exist"),
        (["compare", fixture("dynamic_batch")], "give its shape with --input-shapes x:<batch>x3x8x8"),
        (["compare", fixture("dynamic_batch"), "--input-shapes", "y:1x3x8x8"], "names an input 'y' that the model does not have"),
        (["compare", fixture("clean"), "--atol", "abc"], "--atol 'abc' is not a number"),
        (["compare", fixture("clean"), "--fp16", "--int8"], "not allowed with argument"),
        (["compare", fixture("clean"), "--workers", "0"], "--workers must be at least 1"),
        (["compare"], "the following arguments are required: model (see accudiff compare --help)"),
        (["bisect", "subgraph", fixture("clean"), "--nope"], "unrecognized arguments: --nope (see accudiff bisect subgraph --help)"),
        # A prefix is not taken as the option it starts: `--output DIR` was read as --output-kind.
        (["compare", fixture("clean"), "--output", "out"], "unrecognized arguments: --output out (see accudiff compare --help)"),
        (["compare", fixture("clean"), "--new-token", "4"], "unrecognized arguments: --new-token 4: did you mean --new-tokens? (see"),
        ([], "the following arguments are required: command (see accudiff --help)"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(run_cli, args, message):
    code, out, err = run_cli(*args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(unavailable_reason("trt") is None, reason="TensorRT inference works on this machine")
def test_trt_candidate_without_a_usable_tensorrt_is_one_sentence(run_cli):
    code, _, err = run_cli("compare", fixture("clean"), "--candidate", "trt")
    assert code == 2
    assert err.strip() == f"accudiff: error: {unavailable_reason('trt')}"


def test_per_tensor_tolerance_override_changes_the_verdict(run_cli, tmp_path):
    code, _, _ = run_cli("compare", fixture("underflow"), "--fp16", "--report-dir", tmp_path / "a")
    assert code == 1
    loose = ["--atol", "restored:0.1", "y:0.1", "--report-dir", tmp_path / "b"]
    code, out, _ = run_cli("compare", fixture("underflow"), "--fp16", *loose)
    assert code == 0, out


def test_report_inputs_replay_the_same_result(tmp_path):
    first = accudiff.compare(fixture("underflow"), "fp16", candidate="onnxrt", seed=7, iterations=2, report_dir=tmp_path / "first")
    replay = accudiff.compare(fixture("underflow"), "fp16", candidate="onnxrt", inputs=tmp_path / "first" / "inputs.npz")
    assert replay.iterations == 2
    pd.testing.assert_frame_equal(first.table, replay.table)


@pytest.mark.parametrize("workers", [1, 3], ids=["one worker reduces all", "merged across workers"])
def test_iterations_aggregate_worst_case(tmp_path, workers):
    """Three samples' row is the worst of the three compared one by one (which differ), over all their
    elements, reduced by one worker or merged from three; the samples are ordered mildest first, so a merge
    that kept the first sample's figure would show."""
    accudiff.compare(fixture("underflow"), "fp16", candidate="onnxrt", seed=1, iterations=3, verify=False, report_dir=tmp_path / "r")
    with np.load(tmp_path / "r" / "inputs.npz") as saved:
        feeds = [{key.split("/", 1)[1]: saved[key] for key in saved.files if key.startswith(f"{i}/")} for i in range(3)]
    singles = [accudiff.compare(fixture("underflow"), "fp16", candidate="onnxrt", inputs=[feed]).table.set_index("tensor").loc["restored"] for feed in feeds]
    order = sorted(range(3), key=lambda k: singles[k]["max_abs_err"])
    three = accudiff.compare(fixture("underflow"), "fp16", candidate="onnxrt", inputs=[feeds[k] for k in order], workers=workers)
    row_three = three.table.set_index("tensor").loc["restored"]
    assert row_three["elements"] == sum(row["elements"] for row in singles)
    assert len({row["max_abs_err"] for row in singles}) == 3 and row_three["max_abs_err"] == singles[order[-1]]["max_abs_err"]


@pytest.mark.parametrize("command", [["-m", "accudiff.cli"], ["console script"]], ids=["python -m", "console script"])
def test_console_script_is_installed_and_runs(command, tmp_path):
    """The process ends without Python's teardown (cli.run_and_exit): its exit code, and every line it
    printed into a pipe, must survive that."""
    launcher = [str(Path(sys.executable).with_name("accudiff"))] if command == ["console script"] else [sys.executable, *command]
    done = subprocess.run(
        [*launcher, "compare", str(fixture("nan_midgraph")), "--fp16", "--report-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1
    # Both operands of the Div underflow to 0 in FP16: the verified repair keeps them (and the Div reading them) in FP32.
    assert "cause: Mul 'denominator' is one of several causes" in done.stdout and "repair (verified" in done.stdout
    assert done.stdout.rstrip().endswith(f"report: {tmp_path / 'r'}")
    passing = subprocess.run([*launcher, "compare", str(fixture("clean")), "--fp16", "--report-dir", str(tmp_path / "p")], capture_output=True, text=True, cwd=ROOT)
    assert passing.returncode == 0 and "verdict: PASS" in passing.stdout


def test_result_table_is_a_dataframe_with_documented_columns():
    result = accudiff.compare(fixture("clean"), "fp16", candidate="onnxrt")
    expected = {
        "tensor", "node", "op_type", "dtype", "cand_dtype", "shape", "is_output", "ref_min", "ref_max", "ref_absmax",
        "max_abs_err", "mean_abs_err", "median_abs_err", "p99_abs_err", "max_rel_err", "mean_rel_err", "cosine",
        "sqnr_db", "outside_share", "outside_count", "ref_nan", "ref_inf", "cand_nan", "cand_inf", "status",
        "atol", "rtol", "stol",
    }
    assert expected <= set(result.table.columns)
    assert np.issubdtype(result.table["sqnr_db"].dtype, np.floating)


def test_no_onnxruntime_log_line_reaches_the_console(tmp_path):
    """Old exports list weights as graph inputs: ONNX Runtime warns about each, in every session it makes,
    the INT8 quantizer's calibration sessions included. Only accudiff's own lines may be printed."""
    import onnx

    model = onnx.load(str(fixture("clean")))
    for init in model.graph.initializer:
        model.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    onnx.save(model, str(tmp_path / "weights_as_inputs.onnx"))
    for precision in ("--int8", "--fp16"):
        done = subprocess.run(
            [sys.executable, "-m", "accudiff.cli", "compare", "weights_as_inputs.onnx", precision, "--report-dir", f"r{precision}"],
            capture_output=True, text=True, cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr  # the clean fixture passes in both
        assert "onnxruntime" not in done.stdout + done.stderr and "\x1b[" not in done.stderr


def test_an_onnxruntime_error_is_one_sentence_without_its_log_line(tmp_path):
    """Calibration data that the model cannot run (a Squeeze of a dimension that is 2, not 1): ONNX Runtime
    logs an error line of its own before raising; only accudiff's sentence may reach the console."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Squeeze", ["h", "axes"], ["y"], name="squeeze")],
        "squeezing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"), onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "squeeze.onnx"))
    np.savez(tmp_path / "calib.npz", x=np.ones((2, 4), np.float32))
    done = subprocess.run(
        [sys.executable, "-m", "accudiff.cli", "compare", "squeeze.onnx", "--int8", "--input-shapes", "x:1x4", "--calib-data", "calib.npz"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "could not quantize the model" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "[E:onnxruntime" not in done.stderr and "\x1b[" not in done.stderr


def test_report_of_a_scalar_input_model_replays(tmp_path):
    """A 0-d input (an If's condition) is saved as 0-d, so the report's inputs load back."""
    first = accudiff.compare(fixture("if_model"), "fp16", candidate="onnxrt", report_dir=tmp_path / "r")
    replay = accudiff.compare(fixture("if_model"), "fp16", candidate="onnxrt", inputs=tmp_path / "r" / "inputs.npz")
    pd.testing.assert_frame_equal(first.table, replay.table)


def test_worst_tensor_lines_stay_aligned_with_long_op_names(run_cli):
    """'BatchNormalization' is longer than the op column was: the error figures stay in one column."""
    code, out, _ = run_cli("compare", fixture("drift_then_constant_overflow"), "--fp16", "--no-autokeep", "--candidate", "onnxrt", "-o", "r")
    block = out.split("worst tensors (failing first, then lowest SQNR):\n")[1].split("  report:")[0].splitlines()
    assert code == 1 and any("BatchNormalization" in line for line in block)
    assert len({line.index("max abs err") for line in block}) == 1, block


def test_settings_written_as_a_command_line_read_back_the_same():
    """The replay command and a bisect reproducer come from `RunSettings.arguments`: parsed by the CLI,
    they must give the settings they were written from, every option that differs from its default included."""
    from pathlib import Path

    from accudiff.cli import build_parser
    from accudiff.options import run_settings
    from accudiff.runners import TrtOptions
    from accudiff.settings import RunSettings

    written = RunSettings(
        "m.onnx", "int8", candidate="onnxrt", inputs="in.npz", seed=7, calib_data="cal.json", keep_fp32=["Softmax", "node_3"],
        autokeep=False, atol=["1e-3", "out:0.5"], rtol=["0.02"], stol=["0.01"], isolate=False, verify_budget=3, also="trt",
        max_memory="2G", workers=2, trt=TrtOptions(mark="outputs", workspace_mb=512),
        load_reference=Path("ref.json"), candidate_runner="trt-runner-N0",
    )
    args, extras = build_parser().parse_known_args(["compare", *written.arguments()])
    assert not extras
    read = run_settings(args)
    assert read == written


def test_no_worker_outlives_compare(tmp_path):
    """The comparison worker is kept warm for verification's trials: whether or not they run, no worker is
    left once compare returns (the pytest plugin runs many comparisons in one process)."""
    from accudiff.execution import pool

    failing = accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="onnxrt", report_dir=tmp_path / "failing")
    assert failing.output_failures[0].cause.verified and not pool.idle_workers()
    passing = accudiff.compare(fixture("clean"), "fp16", candidate="onnxrt", report_dir=tmp_path / "passing")
    assert passing.passed and not pool.idle_workers() and not _worker_processes()


def _worker_processes() -> list[str]:
    """This process's children that are comparison workers (Linux: from /proc)."""
    children = [pid for task in Path("/proc/self/task").glob("*") for pid in (task / "children").read_text().split()]
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children if Path(f"/proc/{pid}/cmdline").exists()]
    return [c.decode(errors="replace") for c in commands if b"accudiff.execution.worker" in c]


def test_a_single_overflow_is_said_as_measured(run_cli, tmp_path):
    """One element of 4,000 overflows FP16: the console and the report say '<0.1%' of the elements, where
    rounding said '0.0%' (a message never claims less, or more, than was measured), and the Inf it makes
    is said in words where the tolerance ratio read 'infx'."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"], name="double")], "one_overflow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4000])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4000])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    model = tmp_path / "one_overflow.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    x = np.full((1, 4000), 0.5, np.float32)
    x[0, 7] = 40000.0  # doubled, past the FP16 maximum 65504
    np.savez(tmp_path / "x.npz", x=x)
    code, out, _ = run_cli("compare", model, "--fp16", "--candidate", "onnxrt", "--load-inputs", tmp_path / "x.npz", "-o", tmp_path / "r")
    assert code == 1
    assert "output 'y' FAILS: 1 of 4000 elements (<0.1%) outside tolerance" in out, out
    assert "brings the output from NaN/Inf (beyond any tolerance) to 0x its tolerance" in out and "infx" not in out, out  # it read 'from infx'
    assert "1 of 4000 elements (&lt;0.1%) outside" in (tmp_path / "r" / "report.html").read_text()  # escaped, as every text


def _eight_overflows(folder: Path) -> tuple[Path, Path]:
    """Eight branches y = sum_k (x * big_k) * 1e-5, each big_k beyond FP16's range; x in [0.5, 1.5]."""
    from onnx import TensorProto, helper

    nodes, constants = [], []
    for k in range(8):
        constants += [helper.make_tensor(f"big{k}", TensorProto.FLOAT, [], [1e5 * (k + 1)]), helper.make_tensor(f"small{k}", TensorProto.FLOAT, [], [1e-5])]
        nodes += [helper.make_node("Mul", ["x", f"big{k}"], [f"up{k}"], name=f"up{k}"), helper.make_node("Mul", [f"up{k}", f"small{k}"], [f"down{k}"], name=f"down{k}")]
    nodes.append(helper.make_node("Sum", [f"down{k}" for k in range(8)], ["y"], name="sum"))
    graph = helper.make_graph(nodes, "eight_overflows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], constants)
    model = folder / "eight_overflows.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    np.savez(folder / "x.npz", x=np.linspace(0.5, 1.5, 16, dtype=np.float32)[None])
    return model, folder / "x.npz"


def test_nan_inf_held_by_more_faults_than_verification_tries(run_cli, tmp_path):
    """Without autokeep, eight branches each overflow FP16 into the same Sum: keeping any five leaves Inf at the
    output. No cause is found, and it is not called small errors accumulating; none of the five is 'ruled
    out' (the others hold the Inf); the tolerance met is none, where Inf read as the largest float gave
    'atol 1.8e+308'."""
    model, inputs = _eight_overflows(tmp_path)
    code, out, _ = run_cli("compare", model, "--fp16", "--no-autokeep", "--candidate", "onnxrt", "--load-inputs", inputs, "-o", tmp_path / "r")
    assert code == 1
    assert "cause: not found: NaN/Inf reach this output and no keep tried removes them" in out, out
    assert "accumulated error" not in out and "ruled out" not in out and "tolerance met: no atol" in out, out
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["outputs"][0]["cause"]["kind"] == "not_found"  # as every report says it


def test_autokeep_also_keeps_the_readers_of_what_it_kept_when_they_would_overflow(run_cli, tmp_path):
    """Autokeep keeps each 'up' Mul in FP32 (its constant is beyond 65504), and so its output, x * 1e5 and
    more, is beyond FP16 too: the 'down' Mul reading it in FP16 read Inf, and the output was Inf. Each
    'down' is kept as well, with the values measured on the sample; the candidate passes."""
    model, inputs = _eight_overflows(tmp_path)
    code, out, _ = run_cli("compare", model, "--fp16", "--candidate", "onnxrt", "--load-inputs", inputs, "-o", tmp_path / "r")
    assert code == 0, out
    kept = {k["node"]: k["reason"] for k in json.loads((tmp_path / "r" / "summary.json").read_text())["kept_fp32"]}
    assert sorted(kept) == sorted([f"up{k}" for k in range(8)] + [f"down{k}" for k in range(8)])
    assert kept["up0"] == "its constant 'big0' holds 1e+05, beyond FP16's largest finite value 65504: in FP16 it would be +Inf; 0 × Inf is NaN, so the Mul would give NaN wherever it multiplies that by 0"
    assert kept["down7"] == ("it reads 'up7', which Mul 'up7' (kept in FP32) outputs with values up to 1.2e+06 on the first sample, beyond FP16's largest "
                             "finite value 65504: in FP16 they would be Inf")


def test_autokeep_measures_in_a_worker_not_in_the_caller(run_cli, tmp_path, monkeypatch):
    """Autokeep's measurements (how large a kept node's values grow) are runs of the model: a worker's, as every
    backend call is. ONNX Runtime inference in this process fails the test."""
    import onnxruntime

    def refused(*args, **kwargs):
        raise AssertionError("ONNX Runtime ran a model in the caller's process")

    monkeypatch.setattr(onnxruntime.InferenceSession, "run", refused)
    model, inputs = _eight_overflows(tmp_path)
    code, out, _ = run_cli("compare", model, "--fp16", "--candidate", "onnxrt", "--load-inputs", inputs, "--no-verify", "-o", tmp_path / "r")
    assert code == 0, out
    kept = {k["node"]: k["reason"] for k in json.loads((tmp_path / "r" / "summary.json").read_text())["kept_fp32"]}
    assert "down7" in kept and "values up to 1.2e+06" in kept["down7"]


@pytest.mark.parametrize(
    "share, decimals, shown",
    [(0, 1, "0.0%"), (1, 1, "100.0%"), (1 / 265000, 1, "<0.1%"), (439 / 440, 0, ">99%"), (0.9995, 1, ">99.9%"), (0.5, 2, "50.00%")],
)
def test_percentages_round_neither_to_nothing_nor_to_everything(share, decimals, shown):
    from accudiff.text import percent

    assert percent(share, decimals) == shown


@pytest.mark.parametrize(
    "ratio, shown",
    [(3.214, "3.21x"), (1.0, "1x"), (1.004, "1.004x"), (0.9996, "0.9996x"), (1 + 1e-12, ">1x"), (1 - 1e-12, "<1x"), (0.25, "0.25x")],
)
def test_a_ratio_near_one_reads_on_the_side_of_one_it_lies_on(ratio, shown):
    """A repair step at KL 0.00804 against --require kl=0.008 read 'output at 1x its requirement', as if met."""
    from accudiff.text import times_tolerance

    assert times_tolerance(ratio, "") == shown


def test_a_figure_beside_its_requirement_never_reads_as_its_target_when_it_is_not():
    """On the trained Llama at --require kl=0.008, a repair step printed 'output at 1.0003x its requirement
    (... KL divergence 0.008)': the ratio said missed, the figure read as the target."""
    from accudiff.judging.intervals import Interval
    from accudiff.judging.objective import describe, figure_text
    from accudiff.report.decision_text import said_figure

    assert describe(1.0, {"top1": 0.9333, "kl": 0.0080024}, {"kl": 0.008}).endswith("(top-1 agreement 93.33%, KL divergence 0.008002)")
    assert describe(1.0, {"top1": 0.98999, "kl": 0.0080024}, {"top1": 0.99}) == "1.001x its requirement (top-1 agreement 98.999%, KL divergence 0.008)"
    assert describe(1.0, {"top1": 0.9333, "kl": 0.008}, {"kl": 0.008}).endswith("KL divergence 0.008)")  # on the target: as it is
    assert figure_text("kl", 0.0080024) == "0.008" and figure_text("kl", 0.0080024, 0.008) == "0.008002"
    assert said_figure("kl", 0.0080024, Interval(0.0061, 0.0099, 6, 64, True, kind="mean"), 0.008) == "0.008002 [0.0061, 0.0099]"


def test_an_accumulated_error_not_verified_is_said_to_be_the_rules_hypothesis():
    """With --no-verify, the trained Llama's INT4 build read "cause: accumulated error: no single node breaks this
    output": a claim about every node, made with no keep tried. Only a search says so; the rules' reading says what it is."""
    from accudiff.findings import Cause
    from accudiff.report.content import accumulated_headline

    assert accumulated_headline(Cause("accumulated", verified=True), "the tolerance") == (
        "cause: accumulated error: no single node breaks this output; small errors grow past the tolerance on the way")
    for failing_alone in (0, 3):
        said = accumulated_headline(Cause("accumulated", failing_alone=failing_alone), "its requirement")
        assert said.startswith("cause: accumulated error (not verified: the rules' hypothesis); ") and "no single node" not in said, said


def test_summary_md_nests_a_causes_lines_as_the_console_does(run_cli, tmp_path):
    """summary.md put a repair's steps and a cause's contributors at the level of the line that introduces them."""
    code, out, _ = run_cli("compare", fixture("layernorm_overflow"), "--fp16", "--report-dir", tmp_path / "r")
    markdown = (tmp_path / "r" / "summary.md").read_text()
    assert code == 1 and "\n        step 1: keep 4 node(s)" in out
    assert "\n  - repair (verified on sample 0): keep 4 node(s)" in markdown and "\n    - step 1: keep 4 node(s) -&gt; output at 0.158x" in markdown, markdown


def test_the_tolerance_an_output_meets_says_the_rest_of_the_tolerance_it_is_met_at():
    """bisect's "output 'logits' as it is meets atol 0, or rtol 0" read as if the INT4 logits were exact: their
    stol alone covered them. Compare and bisect now say both in the same words, each with what it is met at."""
    from accudiff.judging.tolerances import Tolerance
    from accudiff.report.content import met_words

    assert met_words({"atol": 0.0, "rtol": 0.0}, Tolerance(0.05, 0.25, 0.1)) == "atol 0 (at rtol 0.25, stol 0.1), or rtol 0 (at atol 0.05, stol 0.1)"


def test_output_into_a_pipe_whose_reader_has_gone_is_no_error(tmp_path):
    """`accudiff compare ... | head -30` on the recognizer said 'internal error: BrokenPipeError' after the 30
    lines: a reader that stops reading ends the answer, not the command, which exits with its own code."""
    for reader in ("head -1", "true"):
        done = subprocess.run(["bash", "-c", f"set -o pipefail; accudiff compare {fixture('layernorm_overflow')} --fp16 --timings -o r-{reader[0]} 2>err.txt | {reader}"],
                              cwd=tmp_path, capture_output=True, text=True, env=user_shell_environment())
        err = (tmp_path / "err.txt").read_text()
        assert done.returncode == 1 and "error" not in err and "Traceback" not in err, (reader, err)


def test_every_run_option_is_declared_once_and_its_default_is_the_settings_own():
    """One declaration per option (run_options.RUN_OPTIONS) gives the parser entry, the settings keyword and the
    replayed argument: compare's parser holds exactly those flags (and what is no setting), and the default
    the table writes nothing for is the one RunSettings (or its TrtOptions) takes."""
    import argparse
    import dataclasses

    from accudiff.cli import build_parser
    from accudiff.run_options import RUN_OPTIONS
    from accudiff.runners import TrtOptions
    from accudiff.settings import RunSettings

    compare = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["compare"]
    flags = {flag for action in compare._actions for flag in action.option_strings if flag.startswith("--")}
    assert flags - {"--fp16", "--bf16", "--int8", "--timings", "--report-dir", "--debug", "--help"} == {option.flag for option in RUN_OPTIONS}
    assert len({option.flag for option in RUN_OPTIONS}) == len({option.keyword for option in RUN_OPTIONS}) == len(RUN_OPTIONS)
    defaults = {f.name: f.default for f in dataclasses.fields(RunSettings)} | {f"trt.{f.name}": f.default for f in dataclasses.fields(TrtOptions)}
    for option in RUN_OPTIONS:
        if option.action == "store_false":
            assert defaults[option.keyword] is True, option.flag
        else:
            assert defaults[option.keyword] == ((() if option.listed and option.action == "append" else option.default)), option.flag


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero (a device read without end)")
@pytest.mark.parametrize("where", [["compare", "/dev/zero"], ["compare", "MODEL", "--candidate-model", "/dev/zero"],
                                   ["compare", "MODEL", "--load-inputs", "/dev/zero"]], ids=["model", "candidate", "inputs"])
def test_a_device_given_as_a_file_is_refused_without_reading_it(where, run_cli, tmp_path):
    """The fuzzer's `compare /dev/zero --candidate trt --int8`: the model's formats were read from it before its
    checks, to choose the backend, and the read never ended (24 GB, then the kernel killed it). Now it ends
    with one sentence; given where a file is read, the sentence says the device is not a file."""
    arguments = [fixture("clean") if a == "MODEL" else a for a in where]
    code, _, err = run_cli(*arguments, "--int8", "--candidate", "trt", "-o", tmp_path / "r")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(*arguments, "--int8", "--candidate", "onnxrt", "-o", tmp_path / "r")
    assert code == 2 and err.strip().endswith("'/dev/zero' is not a file"), err


@pytest.mark.parametrize("where", ["caller", "worker"])
def test_a_disk_that_fills_up_is_one_sentence_and_leaves_nothing(where, tmp_path):
    """A write that fails for want of room (here a limit on a file's size, `ulimit -f`, which fails writes as a
    full disk does, without needing one) said 'internal error: OSError: [Errno 27] File too large' from the
    caller writing the candidate, and '... WorkerBug: the comparison worker failed: OSError: 4194304 requested
    and 1048544 written' (numpy's words, no errno) from the worker recording the reference's outputs. Both
    are one sentence saying where accudiff writes, exit 2, and no report folder."""
    import resource
    import shutil

    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    if where == "caller":  # an 8 MB weight: its FP16 candidate (4 MB) is written past the limit
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
        weights = [numpy_helper.from_array(rng.standard_normal((1024, 2560)).astype(np.float32), "w")]
        shapes = [1, 1024], [1, 2560]
    else:  # small weights, a 16 MB output: the worker records it
        nodes = [helper.make_node("Tile", ["x", "reps"], ["tiled"], name="tile"), helper.make_node("Mul", ["tiled", "big"], ["y"], name="scale")]
        weights = [numpy_helper.from_array(np.array([1, 64, 1], np.int64), "reps"), numpy_helper.from_array(np.array(1e5, np.float32), "big")]
        shapes = [1, 64, 1024], [1, 4096, 1024]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shapes[0])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shapes[1])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "model.onnx"))
    limit = 2 << 20
    result = subprocess.run([shutil.which("accudiff", path=user_shell_environment()["PATH"]), "compare", "model.onnx", "--fp16", "-o", "report"],
                            cwd=tmp_path, capture_output=True, text=True, env={**user_shell_environment(), "TMPDIR": str(tmp_path)},
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    said = "a file grew past the size its file system or a limit allows (ulimit -f)" if where == "caller" else "a write stopped short (a full disk, or a limit on a file's size)"
    assert result.returncode == 2 and result.stderr.startswith(f"accudiff: error: {said} while accudiff wrote to it: its scratch files go to {tmp_path} ")
    assert len(result.stderr.strip().splitlines()) == 1 and "(nothing was kept)" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


_HOLDER = """
import sys
from pathlib import Path
from accudiff.atomic import ReportFolder
from accudiff.leftovers import run_folder

with run_folder() as scratch:
    (scratch / "weights.bin").write_bytes(bytes(1 << 20))
    report = ReportFolder(Path(sys.argv[1]))
    report.write_text("summary.md", "half-written")
    print(scratch, report.path, flush=True)
    sys.stdin.read()  # until it is killed, or told to end
    report.discard()
"""


def test_what_a_killed_command_left_the_next_command_removes(tmp_path):
    """A command killed where it cannot clean up (SIGKILL, the out-of-memory killer) left its scratch folder in
    TMPDIR (a large model's converted weights: gigabytes, on a /tmp held in memory) and its report's staging
    folder beside the report it was writing, for good: nothing removed them. The next command now removes
    both, and leaves those of a command still running beside it; and a command that ends leaves nothing."""
    temporary, reports = tmp_path / "tmp", tmp_path / "reports"
    temporary.mkdir()
    env = {**user_shell_environment(), "TMPDIR": str(temporary)}

    def holder(name: str) -> tuple[subprocess.Popen, list[Path]]:
        process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(reports / name)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        return process, [Path(p) for p in process.stdout.readline().split()]

    alive, alive_holds = holder("alive")
    killed, killed_left = holder("killed")
    killed.kill()
    killed.wait()
    assert all(p.is_dir() for p in [*killed_left, *alive_holds])
    result = subprocess.run([shutil.which("accudiff", path=env["PATH"]), "compare", str(fixture("clean")), "--fp16", "-o", str(reports / "next")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert not any(p.exists() for p in killed_left)
    assert all(p.is_dir() for p in alive_holds)
    assert sorted(p.name for p in reports.iterdir()) == sorted(["next", alive_holds[1].name])
    assert not (reports / "next" / ".accudiff-owner").exists()
    alive.communicate("")
    assert alive.returncode == 0 and sorted(p.name for p in reports.iterdir()) == ["next"]
    assert list(temporary.iterdir()) == []
