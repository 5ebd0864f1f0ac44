"""A newcomer's first hour, as they would live it: every command accudiff prints runs as printed, accumulated
error ends in a decision, mistakes are answered in the user's terms and leave nothing behind, Python callers
get Python's words, and the console leads with the verdict. Real runs of ONNX Runtime on fixtures and
seeded inputs; each printed command is pasted into a shell."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

import accudiff
from accudiff import AccudiffError
from accudiff.report.console import format_summary
from conftest import fixture, printed_commands, run_printed, user_shell_environment

TIGHT = ["--atol", "1e-4", "--rtol", "1e-4", "--stol", "0"]  # the classifier's logits fail by ~55x here; its top-1 holds


def _dynamic_outlier(folder: Path) -> Path:
    """int8_outlier_channel with a dynamic batch, and its inputs and calibration samples (batch 2)."""
    model = onnx.load(str(fixture("int8_outlier_channel")))
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    del model.graph.value_info[:]
    onnx.save(model, str(folder / "outlier.onnx"))
    rng = np.random.default_rng(0)
    np.savez(folder / "inputs.npz", x=rng.random((2, 8, 6, 6), dtype=np.float32))
    np.savez(folder / "calib.npz", **{f"{k}/x": rng.random((2, 8, 6, 6), dtype=np.float32) for k in range(4)})
    return folder / "outlier.onnx"


def _classifier_inputs(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    np.savez(folder / "rows.npz", **{f"{k}/x": rng.standard_normal((64, 64)).astype(np.float32) for k in range(8)})
    return folder / "rows.npz"


def test_every_printed_command_runs_as_printed(run_cli, tmp_path):
    """compare on a model with a dynamic batch, INT8 calibrated on given data, fed given inputs: the repair's
    command passes, the replay fails again alike, and the bisect suggestion runs (it dropped --calib-data and
    --load-inputs, and failed on the dynamic dimension)."""
    _dynamic_outlier(tmp_path)
    given = ["outlier.onnx", "--int8", "--calib-data", "calib.npz", "--load-inputs", "inputs.npz"]
    code, out, err = run_cli("compare", *given, "-o", "verified")
    assert code == 1, err
    [applied] = set(printed_commands(out))  # the next step and the repair's 'apply it' say the same
    assert applied == "accudiff compare outlier.onnx --int8 --load-inputs inputs.npz --calib-data calib.npz --keep-fp32 conv"
    assert run_printed(applied, tmp_path).returncode == 0
    replay = json.loads((tmp_path / "verified" / "summary.json").read_text())["replay"]
    again = run_printed(replay, tmp_path)
    assert again.returncode == 1 and "cause: Conv 'conv' introduces the error" in again.stdout
    code, out, err = run_cli("compare", *given, "--no-verify", "-o", "unverified")
    [bisect] = set(printed_commands(out))
    assert bisect == "accudiff bisect precision outlier.onnx --int8 --load-inputs inputs.npz --calib-data calib.npz"
    done = run_printed(bisect, tmp_path)
    assert done.returncode == 1 and "keeping 1 of the 1 converted node(s) in higher precision makes the outputs meet tolerance: conv" in done.stdout, done.stderr
    assert "most of the model" not in done.stdout  # one node is a small repair, whatever the model's size


def test_the_plugins_message_speaks_python_and_its_command_runs(pytester, tmp_path):
    """The plugin's failure names the repair as the keyword argument the test passes, and the bisect line
    of an unverified cause runs as printed."""
    model = _dynamic_outlier(tmp_path)
    pytester.makepyfile(test_model=f"""
def test_int8(accudiff):
    accudiff.compare(r"{model}", precision="int8", inputs=r"{tmp_path / 'inputs.npz'}", calib_data=r"{tmp_path / 'calib.npz'}").assert_within()

def test_int8_unverified(accudiff):
    accudiff.compare(r"{model}", precision="int8", inputs=r"{tmp_path / 'inputs.npz'}", calib_data=r"{tmp_path / 'calib.npz'}",
                     verify=False).assert_within()
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    assert "apply it:" in text and "keep_fp32=['conv']" in text and "--keep-fp32" not in text
    [bisect] = set(printed_commands(text))
    assert bisect.startswith("accudiff bisect precision ") and "--calib-data" in bisect and "--load-inputs" in bisect
    assert run_printed(bisect, pytester.path).returncode == 1


def test_accumulated_error_ends_in_a_decision(run_cli, tmp_path):
    """The classifier fails its tolerance by ~55x with no node to blame; its top-1 choice holds. The console
    says so first, with the requirement it meets as a command that passes; bisect's keep-list is the whole
    model, and it says that the tolerance is the question."""
    rows = _classifier_inputs(tmp_path)
    code, out, _ = run_cli("compare", fixture("accumulating_classifier"), "--fp16", "--load-inputs", rows, *TIGHT, "-o", "r")
    lines = out.splitlines()
    assert code == 1 and lines[1] == "  verdict: FAIL (1 of 1 graph output(s) out of tolerance)"
    assert lines[2].startswith("  next: out of tolerance, but what it decides meets top1=0.98; if the decision is what you judge the model by:")
    require, bisect = printed_commands(out)[:2]
    assert require.endswith("--require top1=0.98") and bisect.startswith("accudiff bisect precision")
    block = out[out.index("output 'logits' FAILS"):]
    assert block.index("top-1 agreement 99.80% [") < block.index("judged by its decision, it passes: --require top1=0.98 is met") < block.index("cause: accumulated")
    assert run_printed(require, tmp_path).returncode == 0
    done = run_printed(bisect, tmp_path)
    assert "keeping 17 of the 17 converted node(s)" in done.stdout and "that is most of the model: the search found no small repair" in done.stdout
    assert done.stdout.strip().splitlines()[-2].strip().endswith("--require top1=0.98")  # the command it suggests instead


def test_delta_p_is_said_with_its_sign_defined():
    """'drops by -0.00332' read as a contradiction: Δp is defined where it is printed, negative included."""
    result = accudiff.compare(fixture("accumulating_classifier"), "fp16", candidate="onnxrt", inputs=_feeds(), atol=1e-4, rtol=1e-4, stol=0, verify=False)
    text = format_summary(result)
    assert "drops by" not in text and "Δp, what the candidate takes from the probability of the reference's top entry (negative: it gives more): mean " in text


def _feeds() -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((64, 64)).astype(np.float32)} for _ in range(8)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "models"], "'models' is a folder, not a model file: give the model file in it (clean.onnx)"),
        (["compare", fixture("dynamic_batch"), "--fp16", "--load-inputs", "x.npz", "--input-shapes", "x:2x3x8x8"],
         "--input-shapes shape random inputs, and the inputs --load-inputs gives have their own shapes and values: it would be ignored"),
        (["compare", fixture("dynamic_batch"), "--fp16", "--load-inputs", "x.npz", "--iterations", "4", "--val-range", "0,2"],
         "--val-range and --iterations shape random inputs"),
        (["bisect", "precision", fixture("clean")], "bisect looks for what fails in a reduced-precision candidate, and no option chose one: give --fp16, --bf16 or --int8"),
    ],
)
def test_mistakes_are_answered_in_the_users_terms_and_leave_nothing(args, message, run_cli, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "clean.onnx").write_bytes(fixture("clean").read_bytes())
    np.savez(tmp_path / "x.npz", x=np.ones((1, 3, 8, 8), np.float32))
    code, out, err = run_cli(*args)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "reports").exists()


def test_inputs_that_do_not_fit_are_named_by_input_not_by_a_segment(run_cli, tmp_path):
    """A model whose free dimensions its layers constrain (a Concat of two paths that round a size apart),
    fed a size they disagree on: named by the input, its shape and the declared one, whatever the run's
    segments (was "ONNX Runtime failed while running 'segment0.onnx'")."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("MaxPool", ["x"], ["half"], kernel_shape=[2], strides=[2], name="pool"),
             helper.make_node("Resize", ["half", "", "scales"], ["back"], mode="nearest", name="up"),
             helper.make_node("Concat", ["x", "back"], ["y"], axis=1, name="join")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, "length"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, "length"])],
                              [onnx.numpy_helper.from_array(np.array([1, 1, 2], np.float32), "scales")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "pyramid.onnx"))
    np.savez(tmp_path / "odd.npz", x=np.ones((1, 2, 9), np.float32))
    for memory in ([], ["--max-memory", "16M"]):
        code, _, err = run_cli("compare", "pyramid.onnx", "--fp16", "--load-inputs", "odd.npz", *memory)
        assert code == 2 and "'pyramid.onnx' does not run on sample 0 (input 'x' 1x2x9, declared 1 x 2 x length): Concat 'join':" in err, err
        assert "segment" not in err and not (tmp_path / "reports").exists()


def test_ctrl_c_exits_130_and_leaves_no_folder(run_cli, tmp_path, monkeypatch):
    """Interrupted while it compares, the command exits as shells expect of Ctrl-C and removes the report
    folder it had begun, and the reports/ folder it made for it."""
    import accudiff.api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(accudiff.api, "run_group", interrupted)
    code, _, err = run_cli("compare", fixture("clean"), "--fp16")
    assert code == 130 and "interrupted; no report was written" in err
    assert list(tmp_path.iterdir()) == []


def _interrupted_as_its_folder_is_made(monkeypatch):
    """Every temporary folder made, then a real SIGINT to this process (a Ctrl-C landing at that moment)."""
    import signal
    import tempfile

    made = tempfile.mkdtemp

    def made_then_interrupted(*args, **kwargs):
        path = made(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", made_then_interrupted)
    return signal.signal(signal.SIGINT, signal.default_int_handler)  # pytest-xdist's workers ignore SIGINT


@pytest.mark.parametrize("where", ["compare", "a folder written whole"])
def test_ctrl_c_the_moment_the_report_folder_is_made_leaves_nothing(tmp_path, monkeypatch, where):
    """A Ctrl-C that lands right after the report's staging folder is made, before the run holds it, left the
    folder and the reports/ made for it (a real Ctrl-C under load did). It is held back until the folder is
    the run's, then interrupts: nothing is left."""
    import signal

    from accudiff.atomic import new_folder

    previous = _interrupted_as_its_folder_is_made(monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            if where == "compare":
                accudiff.compare(fixture("clean"), "fp16", report_dir=tmp_path / "reports" / "r")
            else:
                with new_folder(tmp_path / "reports" / "r"):
                    pass
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.iterdir()) == []


def test_a_file_written_atomically_that_cannot_be_put_in_place_leaves_nothing(tmp_path):
    """A baseline (or engine cache) whose rename fails (here a folder holds its name) left its hidden
    '.partial' file beside it."""
    from accudiff.atomic import write_atomically

    (tmp_path / "baseline.json").mkdir()
    with pytest.raises(OSError):
        write_atomically(tmp_path / "baseline.json", b"{}")
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]


def test_a_real_ctrl_c_stops_the_workers_too(tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the command and its worker
    processes. Sent while two workers compare thousands of samples, the command exits 130, no process of
    its group is left, and nothing is left in the folder it ran in."""
    import signal
    import time

    def as_a_terminal_starts_it() -> None:  # pytest-xdist's workers ignore SIGINT, and what they start would inherit that
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    process = subprocess.Popen(["accudiff", "compare", str(fixture("clean")), "--fp16", "--iterations", "20000",
                                "--workers", "2"], cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=user_shell_environment(), preexec_fn=as_a_terminal_starts_it)
    deadline = time.monotonic() + 600  # not a measurement: how long a slow machine may take to start comparing
    while not list((tmp_path / "reports").glob(".*partial*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.poll() is None, process.communicate()  # still comparing: 20000 samples take minutes
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 130 and "interrupted; no report was written" in err, (out, err)
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)  # a process of the group is still there (workers end after their parent)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("worker processes outlived the interrupted command")
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")] == []


def test_python_callers_get_python_words_raised_once():
    """assert_within(flipped_share=...) on a model without a probability map said '--require flipped_share
    ... (--output-kind says what one is)', then 'During handling of the above exception'."""
    with pytest.raises(AccudiffError) as raised:
        accudiff.compare(fixture("clean"), "fp16", candidate="onnxrt", require=["flipped_share=0.01"])
    assert str(raised.value).startswith("a requirement on flipped_share (require=) applies to a probability map")
    assert "output_kind= says what one is" in str(raised.value) and "--" not in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    with pytest.raises(AccudiffError, match=r"keep_fp32=\['nothing_here'\] matches no node of the model"):
        accudiff.compare(fixture("clean"), "fp16", candidate="onnxrt", keep_fp32=["nothing_here"])


def test_a_result_writes_its_report_afterwards_and_its_replay_runs(tmp_path):
    """accudiff.compare without report_dir wrote nothing, and its result could not say how to run it again:
    write_report saves the inputs given in memory with the report, and its replay line reproduces it."""
    result = accudiff.compare(fixture("accumulating_classifier"), "fp16", candidate="onnxrt", inputs=_feeds(), atol=1e-4, rtol=1e-4, stol=0, verify=False)
    assert result.report_dir is None and result.replay == []
    assert "result.write_report(folder) saves them" in format_summary(result)
    folder = result.write_report(tmp_path / "later")
    assert folder == tmp_path / "later" and {"summary.json", "report.html", "inputs.npz", "candidate-fp16.onnx"} <= {p.name for p in folder.iterdir()}
    replay = json.loads((folder / "summary.json").read_text())["replay"]
    assert "--load-inputs" in replay and str(folder / "inputs.npz") in replay
    done = run_printed(replay, tmp_path)
    outside = int(result.table.set_index("tensor").loc["logits", "outside_count"])
    assert done.returncode == 1 and f"output 'logits' FAILS: {outside} of 51200 elements" in done.stdout, done.stdout + done.stderr
    with pytest.raises(AccudiffError, match="already written"):
        result.write_report(tmp_path / "again")


def test_the_console_leads_with_the_verdict_and_wraps_but_never_a_command(tmp_path):
    """The verdict and the next step first; lines wrapped at the terminal's width, commands whole; on a PASS
    by a requirement, no 'worst tensors' of failing tensors, but a line saying they are out of tolerance."""
    result = accudiff.compare(fixture("accumulating_classifier"), "fp16", candidate="onnxrt", inputs=_feeds(), atol=1e-4, rtol=1e-4, stol=0,
                              report_dir=tmp_path / "r")
    lines = format_summary(result, width=80).splitlines()
    assert lines[1].startswith("  verdict: FAIL") and lines[2].startswith("  next:")
    commands = [line for line in lines[1:] if line.strip().startswith("accudiff ")]
    assert commands and all(len(line) > 80 for line in commands)  # pasted whole
    table = lines[lines.index("  worst tensors (failing first, then lowest SQNR):") + 1 : -1]  # a table's rows stay rows
    assert lines[-1].startswith("  report: ")  # a path, whole
    assert all(len(line) <= 80 or line in commands or line in table or " " not in line.strip() for line in lines[:-1])
    passing = accudiff.compare(fixture("accumulating_classifier"), "fp16", candidate="onnxrt", inputs=_feeds(), atol=1e-4, rtol=1e-4, stol=0,
                               require=["top1=0.98"], verify=False)
    text = format_summary(passing)
    assert text.splitlines()[1].startswith("  verdict: PASS") and "worst tensors" not in text
    assert "tensor(s) are outside their elementwise tolerance, which the verdict does not judge them by" in text
