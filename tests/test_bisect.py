"""Isolated error and the bisectors, on the fault fixtures with the ONNX Runtime candidate (real runs)."""

from __future__ import annotations

import re

import json
import math
import subprocess
import tempfile

import numpy as np
import onnx
import pytest

import accudiff
from accudiff.bisect.precision import bisect_precision
from accudiff.bisect.session import BisectSession
from accudiff.bisect.subgraph import bisect_subgraph
from accudiff.settings import RunSettings
from conftest import fixture, user_shell_environment

CPU = {"candidate": "onnxrt"}


def _session(name: str, precision: str, **options) -> BisectSession:
    return BisectSession(RunSettings(fixture(name), precision, **{**CPU, **options}))


def test_isolated_error_separates_local_from_inherited():
    result = accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="onnxrt")  # isolation is on by default
    table = result.table.set_index("tensor")
    assert table.loc["squared", "isolated_status"] == "fail"  # overflows by itself
    assert table.loc["logits", "status"] == "fail" and table.loc["logits", "isolated_status"] == "pass"  # only inherits
    [output] = result.output_failures
    assert [f.kind for f in output.findings] == ["inherited"]


def test_a_node_kept_in_fp32_is_fed_exact_values_in_the_isolated_run():
    """'bn' stays FP32: alone it reads its input as FP32 holds it, so FP16's rounding of that input is
    charged where it happens, not to 'bn'; 'attenuate' reads 'bn''s output in FP16 and fails alone."""
    table = accudiff.compare(fixture("kept_feeds_fp16"), "fp16", candidate="onnxrt", keep_fp32=["bn"]).table.set_index("tensor")
    assert table.loc["centred", "status"] == "fail" and table.loc["centred", "isolated_status"] == "pass"
    assert table.loc["attenuated", "isolated_status"] == "fail"


@pytest.mark.parametrize(
    "name, precision, options, nodes",
    [
        ("layernorm_overflow", "fp16", {}, ["ln_square"]),
        ("nan_midgraph", "fp16", {}, ["denominator", "ratio"]),  # verified cause: the underflowing denominator, cut to where it breaks
        ("overflow_activation", "fp16", {}, ["amplify"]),
        ("kept_feeds_fp16", "fp16", {"keep_fp32": ["bn"]}, ["attenuate"]),
        ("drift_then_constant_overflow", "fp16", {"autokeep": False}, ["bn"]),  # dominant: keeping 'bn' alone leaves 1.18x, the drift accumulates
        ("underflow", "fp16", {}, ["shrink", "restore"]),  # accumulated: bisected; 'restore' alone reads exact values
        ("int8_outlier_channel", "int8", {}, ["conv"]),
    ],
)
def test_subgraph_bisect_starts_from_the_cause_and_its_command_fails_when_pasted(name, precision, options, nodes, tmp_path):
    session = _session(name, precision, **options)
    result = bisect_subgraph(session, tmp_path)
    session.close()
    assert result.nodes == nodes
    assert result.confirmed
    assert result.candidate_runs <= result.bound
    assert result.model_path == "subgraph.onnx" and (tmp_path / result.model_path).is_file()
    onnx.checker.check_model(onnx.load(str(tmp_path / result.model_path)), full_check=True)
    # The printed command runs verbatim in a POSIX shell from the result folder, and fails.
    assert result.command.startswith("accudiff compare subgraph.onnx")
    done = subprocess.run(["bash", "-c", result.command], cwd=tmp_path, capture_output=True, text=True, env=user_shell_environment())
    assert done.returncode == 1, done.stdout + done.stderr


def test_subgraph_bisect_finds_an_accumulating_chain_in_log_runs(tmp_path):
    session = _session("accumulated_drift", "fp16", iterations=2)
    result = bisect_subgraph(session, tmp_path)
    nodes = len(session.info.proto.graph.node)
    session.close()
    # The drift crosses tolerance near step 60, a fact: the reproducer ends at the output and holds the part
    # of the chain that brings at least half its error (the last two nodes alone fail too, at 1.8x of 83x).
    assert result.cause_kind == "accumulated" and result.tensor == "y"
    assert result.nodes[-1] == "remove_offset" and 30 <= len(result.nodes) <= 70
    assert result.confirmed and 0.5 * result.whole_tol_ratio <= result.tol_ratio <= result.whole_tol_ratio
    # at most: the comparison (2), a single-node cause's two cuts, the bisection of every node, the confirmation
    assert result.candidate_runs <= 2 + 2 + math.ceil(math.log2(nodes - 1)) + 1 == result.bound


def test_subgraph_bisect_on_a_clean_model_finds_nothing(tmp_path):
    session = _session("clean", "fp16")
    result = bisect_subgraph(session, tmp_path)
    session.close()
    assert result.output is None and result.nodes == [] and result.candidate_runs == 2


def test_precision_bisect_repairs_the_model_with_few_runs(tmp_path):
    """Through the public call (`accudiff.bisect_precision`, which the bisectors lacked: only the command ran
    them), with the folder the command writes; a keyword it does not take is one sentence naming it."""
    found = accudiff.bisect_precision(fixture("layernorm_overflow"), "fp16", candidate="onnxrt", report_dir=tmp_path / "b")
    result, folder = found.found, found.folder
    assert found.summary.startswith("accudiff bisect precision: ") and (folder / "result.json").exists()
    # The cause comes first; keeping it in FP32 moves the overflow to its consumers, which are kept too.
    assert result.repaired and result.keep[:2] == ["ln_square", "ln_variance"]
    assert len(result.keep) < len(result.ranking) and result.candidate_runs <= result.bound and result.candidate_runs < len(result.ranking)
    keep = (folder / "keep_fp32.txt").read_text().split()
    assert accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="onnxrt", keep_fp32=keep).passed
    with pytest.raises(accudiff.AccudiffError, match=re.escape("bisect_subgraph() takes no option 'keep_fp23': did you mean keep_fp32=?")):
        accudiff.bisect_subgraph(fixture("layernorm_overflow"), "fp16", keep_fp23=["ln_square"], report_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()
    repaired = onnx.load(str(folder / result.repaired_model))
    assert {n.name for n in repaired.graph.node} >= set(result.keep)
    ranking = result.ranking.set_index("node")
    assert ranking.loc["ln_square", "rank"] == 1 and bool(ranking.loc["ln_square", "kept"])


def test_while_bisect_runs_the_users_model_still_loads_with_onnx(tmp_path):
    """accudiff's scratch models refer to the user's data file where it is: they hard-linked it before, and
    ONNX's loader refuses a data file with several hard links, so the user's own onnx.load of the model
    (a quantizer run beside) failed at every step of the search, and for good after a killed run."""
    model = onnx.load(fixture("layernorm_overflow"))
    [head] = [init for init in model.graph.initializer if init.name == "w"]
    head.CopyFrom(onnx.numpy_helper.from_array(np.tile(onnx.numpy_helper.to_array(head), (1, 4)), "w"))  # 16 KB: left in its file when read
    model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value = 64
    del model.graph.value_info[:]
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    seen = []

    def step(message: str) -> None:
        seen.append((folder / "model.onnx.data").stat().st_nlink)
        onnx.load(str(folder / "model.onnx"))

    session = BisectSession(RunSettings(folder / "model.onnx", "fp16", **CPU), progress=step)
    result = bisect_precision(session, tmp_path)
    session.close()
    assert result.repaired and len(seen) >= 3 and set(seen) == {1}


def test_precision_bisect_keeps_the_overflowing_consumer_and_what_feeds_the_kept_node(tmp_path):
    session = _session("kept_feeds_fp16", "fp16", keep_fp32=["bn"])
    result = bisect_precision(session, tmp_path)
    session.close()
    assert result.repaired and set(result.keep) == {"attenuate", "lift"}
    assert result.ranking.iloc[0]["node"] == "attenuate" and result.ranking.iloc[0]["why"] == "in the verified repair of a failing output"


def test_precision_bisect_for_int8_leaves_the_outlier_conv_unquantized(tmp_path):
    session = _session("int8_outlier_channel", "int8")
    result = bisect_precision(session, tmp_path)
    session.close()
    assert result.keep == ["conv"] and result.repaired


def test_bisect_stops_cleanly_on_ctrl_c_and_keeps_what_it_found(tmp_path):
    session = _session("accumulated_drift", "fp16")
    real_compare, calls = session.compare, []

    def interrupted_after_two(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real_compare(*args, **kwargs)

    session.compare = interrupted_after_two
    result = bisect_subgraph(session, tmp_path)
    session.close()
    assert result.interrupted and result.cause_kind == "accumulated" and result.tensor == "y" and not result.confirmed


def test_bisect_commands_write_their_report(run_cli, tmp_path):
    code, out, err = run_cli("bisect", "subgraph", fixture("nan_midgraph"), "--fp16", "--candidate", "onnxrt", "-o", tmp_path / "s")
    assert code == 1, err
    assert "smallest failing subgraph (2 node(s), checked at 'ratio'): denominator, ratio" in out and "reproducer confirmed to fail" in out
    assert "step 1: compare the whole model" in err  # progress goes to stderr
    document = json.loads((tmp_path / "s" / "result.json").read_text())
    assert document["schema"] == "accudiff.bisect.result" and document["nodes"] == ["denominator", "ratio"]
    assert document["model_path"] == "subgraph.onnx" and document["cause_kind"] == "several"  # relative to the folder
    code, out, _ = run_cli("bisect", "precision", fixture("clean"), "--fp16", "--candidate", "onnxrt", "-o", tmp_path / "p")
    assert code == 0 and "already meets tolerance" in out


@pytest.mark.parametrize("command", ["subgraph", "precision"])
def test_a_missing_calibration_file_is_refused_before_any_step(run_cli, tmp_path, command, monkeypatch):
    """bisect printed "step 1: compare the whole model" and only then refused a --calib-data file that did not exist.
    Refused, it left its reference cache behind (a temporary folder holding the inputs): nothing is left now."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    code, out, err = run_cli("bisect", command, fixture("clean"), "--int8", "--calib-data", tmp_path / "nope.npz", "-o", tmp_path / "b")
    assert code == 2 and err.strip().splitlines() == [f"accudiff: error: calibration file '{tmp_path / 'nope.npz'}' does not exist"], err
    assert out == "" and not (tmp_path / "b").exists() and not list((tmp_path / "tmp").iterdir())


def test_bisect_precision_numbers_only_the_steps_it_runs(run_cli, tmp_path):
    """Pruning drifting_probability_map's repair tries a keep-list the search ran before: it is answered from
    that run, and its progress line said 'step 6' a second time. Each step number is printed once, and each
    says the bound of the whole search (the comparison is one step of two runs): starting from compare's
    verified repair (layernorm_overflow), the steps said "of at most 5", where that repair failing on every
    sample falls back to a search of some 75 more."""
    runs = {name: run_cli("bisect", "precision", fixture(name), "--fp16", "--candidate", "onnxrt", "-o", tmp_path / name)
            for name in ("drifting_probability_map", "layernorm_overflow")}
    code, _, err = runs["drifting_probability_map"]
    steps = [line.split()[1] for line in err.splitlines() if line.strip().startswith("step ")]
    assert code == 1 and len(steps) == len(set(steps)) > 2, err  # 1: the candidate as made fails
    assert "(pruning: fewer nodes): answered by an earlier run" in err
    page = (tmp_path / "drifting_probability_map" / "report.html").read_text()
    assert "each kept node needed" in page and "already meets tolerance" in page
    for name, (_, out, err) in runs.items():
        bound = int(re.search(r"candidate runs \(at most (\d+) on any path", out).group(1))
        assert set(re.findall(r"step \d+ of at most (\d+):", err)) == {str(bound - 1)}, (name, err)


def test_bisect_precision_says_the_target_it_judged_by(run_cli, tmp_path):
    """Judged by --require, a model that meets it was said to 'already meet tolerance' (console) and 'already
    within tolerance' (report.html), which it need not: its target is named."""
    code, out, _ = run_cli("bisect", "precision", fixture("accumulating_classifier"), "--fp16", "--candidate", "onnxrt", "--require", "top1=0.9",
                           "-o", tmp_path / "p")
    assert code == 0 and "the model already meets top1=0.9 (--require): nothing to keep" in out, out
    page = (tmp_path / "p" / "report.html").read_text()
    assert "already meets top1=0.9 (--require)" in page and "tolerance" not in page.split("<h2>Result</h2>")[1].split("</table>")[0]


def test_repaired_int8_model_is_the_one_compare_verified(tmp_path):
    """The repaired model must be built exactly as `compare --keep-fp32` builds it (same calibration data)."""
    session = _session("clean", "int8")
    repaired = session.trials(session.compare()).setup.variants.with_kept(["fc"]).model
    session.close()
    accudiff.compare(fixture("clean"), "int8", candidate="onnxrt", keep_fp32=["fc"], report_dir=tmp_path / "compare")
    verified = onnx.load(str(tmp_path / "compare" / "candidate-int8.onnx"))
    scales = lambda model: {i.name: onnx.numpy_helper.to_array(i).tolist() for i in model.graph.initializer if i.name.endswith("_scale")}  # noqa: E731
    assert scales(verified) and scales(repaired) == scales(verified)


def test_a_requirement_the_data_cannot_resolve_even_with_everything_kept_is_said_so(run_cli, tmp_path):
    """layernorm_overflow has 8 positions: keeping every converted node brings top-1 back to 100%, whose
    interval [67.6%, 100%] cannot tell 0.99. bisect precision said 'even keeping every converted node in
    higher precision does not meet top1=0.99': the recognizer's FP8 candidate on 4 lines read so too."""
    code, out, _ = run_cli("bisect", "precision", fixture("layernorm_overflow"), "--fp16", "--require", "top1=0.99", "-o", "b")
    assert code == 1 and "does not meet" not in out
    assert "even with every converted node kept in higher precision, the data cannot tell whether the outputs meet top1=0.99" in out
    assert "100.000% [67.6%, 100.0%] over 8 positions of 1 sample; about 49 samples like these would" in out
    assert not (tmp_path / "b" / "keep_fp32.txt").exists()
