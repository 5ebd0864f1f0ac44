"""Datasets: many samples, per-sample outcomes, class-score agreement, and the same table from one worker,
several worker processes, or a local Ray cluster."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pandas as pd
import pytest

import accudiff
from accudiff.judging.decisions import MAX_CLASSES
from accudiff.model.inputs import save_feeds
from conftest import fixture


def _dataset(folder, count: int, scale_of=lambda i: 1.0):
    """`count` samples for the overflow_activation fixture ([1, 16] inputs), two per file."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    feeds = [{"x": (rng.uniform(0, 1, (1, 16)) * scale_of(i)).astype(np.float32)} for i in range(count)]
    for start in range(0, count, 2):
        save_feeds(feeds[start : start + 2], folder / f"part{start // 2:03d}.npz")
    return folder


def _assert_same(a: accudiff.CompareResult, b: accudiff.CompareResult) -> None:
    """Counts, minima and maxima identical; float64 sums equal up to the order of addition."""
    exact = ["status", "elements", "samples", "outside_count", "max_abs_err", "tol_ratio", "worst_index", "worst_sample", "ref_min", "ref_max", "cand_inf"]
    pd.testing.assert_frame_equal(a.table[["tensor", *exact]], b.table[["tensor", *exact]])
    pd.testing.assert_frame_equal(a.table, b.table, check_exact=False, rtol=1e-12)
    pd.testing.assert_frame_equal(a.samples, b.samples)
    assert a.points == b.points  # the report's scatter plots show the same points


def test_one_worker_two_workers_and_ray_give_the_same_table(tmp_path):
    """And the same verified repair: tried on the 8 worst samples, then on all 12 in one batch, which on Ray runs
    as Ray tasks too (it ran on this machine alone, whatever the cluster)."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'accudiff[ray]')")
    data = _dataset(tmp_path / "data", 12, lambda i: 0.5 if i % 3 else 8.0)
    options = {"candidate": "onnxrt", "inputs": data}
    one = accudiff.compare(fixture("overflow_activation"), "fp16", workers=1, **options)
    two = accudiff.compare(fixture("overflow_activation"), "fp16", workers=2, **options)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=40)
    try:
        on_ray = accudiff.compare(fixture("overflow_activation"), "fp16", ray="local", **options)
    finally:
        ray.shutdown()
    assert one.iterations == 12 and not one.passed
    _assert_same(one, two)
    _assert_same(one, on_ray)
    [local], [remote] = one.output_failures, on_ray.output_failures
    assert local.repair.verified and len(local.repair.samples) < 12 and local.repair.whole_run is not None, local.repair
    assert remote.repair.whole_run.keep == local.repair.whole_run.keep
    assert remote.repair.whole_run.tol_ratio == pytest.approx(local.repair.whole_run.tol_ratio, rel=1e-6)
    # One rule for a dataset's workers, whatever the layout: one thread each, so N workers use N cores; a lone
    # worker with cores to spare runs its candidate beside the reference, each session on its own thread.
    beside = min(os.cpu_count() or 1, 3)  # the reference, the candidate and the isolated pass
    assert [r.layout for r in (one, two, on_ray)] == [{"workers": 1, "threads": [1], "sessions_at_once": beside},
                                                       {"workers": 2, "threads": [1], "sessions_at_once": 1}, {"workers": 2, "threads": [1], "sessions_at_once": 1}]


def test_ray_ships_the_files_a_models_weights_are_in(tmp_path):
    """A model's large weights are referenced in the file that holds them (the model's own, or the
    candidate's for its isolated twin): a Ray task must get those files under the names the models record."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'accudiff[ray]')")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    weights = [numpy_helper.from_array((rng.standard_normal((16, 16)) * 40).astype(np.float32), f"w{k}") for k in range(2)]  # 1 KB each: one file holds them
    weights += [numpy_helper.from_array(rng.standard_normal((16, 256)).astype(np.float32), "wide")]  # 16 KB: referenced where it lies
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"], name="m0"), helper.make_node("MatMul", ["h", "w1"], ["g"], name="m1"),
             helper.make_node("MatMul", ["g", "wide"], ["y"], name="m2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], weights)
    model = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    options = {"candidate": "onnxrt", "inputs": _dataset(tmp_path / "data", 4)}
    local = accudiff.compare(model, "fp16", workers=1, **options)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=40)
    try:
        on_ray = accudiff.compare(model, "fp16", ray="local", **options)
    finally:
        ray.shutdown()
    _assert_same(local, on_ray)


def test_ray_ships_each_folders_files_apart_and_a_task_reads_none_of_the_callers(tmp_path, monkeypatch):
    """A model and its candidate whose data files share a name in two folders (a GenAI folder's
    model.onnx.data; here quantize_dynamic's beside its input's) stopped `--ray` with an internal
    FileNotFoundError: a task was sent the files in the model's own folder, not those its weights say they
    lie in. Ray's run gives the local table, and a task run again on the shipped bytes alone, the caller's
    folders gone, as on another machine, still works."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'accudiff[ray]')")
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from accudiff.execution import shards
    from accudiff.execution.messages import WorkerResult

    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), f"w{k}") for k, shape in enumerate([(16, 256), (256, 256), (256, 16)])]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"], name="m0"), helper.make_node("Relu", ["h0"], ["r0"], name="r0"),
             helper.make_node("MatMul", ["r0", "w1"], ["h1"], name="m1"), helper.make_node("Relu", ["h1"], ["r1"], name="r1"),
             helper.make_node("MatMul", ["r1", "w2"], ["y"], name="m2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], weights)
    (tmp_path / "fp32").mkdir()
    (tmp_path / "int8").mkdir()
    model, candidate = tmp_path / "fp32" / "model.onnx", tmp_path / "int8" / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model), save_as_external_data=True,
              location="model.onnx.data", size_threshold=0)
    quantize_dynamic(str(model), str(candidate), weight_type=QuantType.QInt8, use_external_data_format=True)
    assert (tmp_path / "int8" / "model.onnx.data").exists()
    options = {"candidate_model": candidate, "inputs": _dataset(tmp_path / "data", 4), "verify": False}
    local = accudiff.compare(model, workers=1, **options)
    shipped = []
    run_on_ray = shards._run_on_ray

    def recording(jobs, progress):
        shipped.extend((job, {path: (Path(path).read_bytes()) for path in shards._files_of(job)}) for job in jobs)
        return run_on_ray(jobs, progress)

    monkeypatch.setattr(shards, "_run_on_ray", recording)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=40)
    try:
        on_ray = accudiff.compare(model, ray="local", **options)
    finally:
        ray.shutdown()
    _assert_same(local, on_ray)
    for folder in ("fp32", "int8", "data"):
        for file in (tmp_path / folder).iterdir():
            file.unlink()
    job, payloads = shipped[0]
    assert WorkerResult.decode(*shards._ray_task(job.to_json(), payloads)).passes


def test_a_dataset_gets_a_worker_per_core_and_a_single_sample_every_core(tmp_path):
    """Without --workers, a dataset of SAMPLES_PER_WORKER samples per core runs one worker per core, each on
    one thread (its sessions and its statistics): a single sample runs in one worker on every core."""
    from accudiff.execution.shards import SAMPLES_PER_WORKER

    cores = os.cpu_count() or 1
    data = _dataset(tmp_path / "data", 2 * max(cores * SAMPLES_PER_WORKER // 2, 1))
    many = accudiff.compare(fixture("overflow_activation"), "fp16", candidate="onnxrt", inputs=data, verify=False)
    single = accudiff.compare(fixture("overflow_activation"), "fp16", candidate="onnxrt", verify=False)
    assert many.layout == {"workers": cores, "threads": [1], "sessions_at_once": 1}
    assert single.layout == {"workers": 1, "threads": [cores], "sessions_at_once": 1}


def test_the_isolated_run_covers_the_first_samples_of_a_dataset(tmp_path):
    """Each sample past the eighth costs two marked runs, not three: the isolated figures are those of the
    first eight samples, whichever worker compares them, and the report says so."""
    overflows = lambda i: 0.5 if i % 3 else 8.0  # noqa: E731
    options = {"candidate": "onnxrt", "verify": False}
    twelve = accudiff.compare(fixture("overflow_activation"), "fp16", inputs=_dataset(tmp_path / "twelve", 12, overflows), **options)
    two_workers = accudiff.compare(fixture("overflow_activation"), "fp16", inputs=tmp_path / "twelve", workers=2, **options)
    eight = accudiff.compare(fixture("overflow_activation"), "fp16", inputs=_dataset(tmp_path / "eight", 8, overflows), **options)
    _assert_same(twelve, two_workers)
    isolated = [c for c in twelve.table.columns if c.startswith("isolated_")]
    assert isolated
    pd.testing.assert_frame_equal(twelve.table[isolated], eight.table[isolated])
    assert twelve.table["samples"].max() == 12
    assert [n for n in twelve.notices if "isolated run" in n] == [
        "the isolated run (each node's error when fed the reference's values) ran on the first 8 of the 12 samples; every other figure covers them all"
    ]
    assert not [n for n in eight.notices if "isolated run" in n]


def test_failing_samples_are_named_and_the_worst_replay(tmp_path):
    """Samples 2 and 5 hold values that overflow FP16 in 'amplified'; the others pass."""
    data = _dataset(tmp_path / "data", 6, lambda i: 8.0 if i in (2, 5) else 0.2)
    result = accudiff.compare(fixture("overflow_activation"), "fp16", candidate="onnxrt", inputs=data, report_dir=tmp_path / "r")
    assert sorted(result.failing_samples["sample"]) == [2, 5]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["samples"]["compared"] == 6 and summary["samples"]["per_output"]["y"]["failing_samples"] == [2, 5]
    assert sorted(summary["worst_samples"]["samples"]) == [2, 5]
    assert summary["files"]["inputs"] is None and summary["inputs"].endswith("data'")  # a dataset is not copied
    replay = accudiff.compare(fixture("overflow_activation"), "fp16", candidate="onnxrt", inputs=tmp_path / "r" / "worst_samples.npz")
    assert replay.iterations == 2 and len(replay.failing_samples) == 2


def test_class_score_agreement_over_a_dataset(tmp_path):
    """'logits' of the clean fixture are [batch, classes]: top-1/top-5 agreement is counted per sample."""
    result = accudiff.compare(fixture("clean"), "int8", candidate="onnxrt", iterations=6)
    agreement = result.class_agreement()
    assert agreement["logits"]["rows"] == 6 and 0 <= agreement["logits"]["top1"] <= agreement["logits"]["top5"] == 1.0
    rows = result.samples.set_index("sample")
    assert list(rows.index) == list(range(6)) and (rows["rows"] == 1).all()
    feature_map = accudiff.compare(fixture("drift_then_constant_overflow"), "fp16", candidate="onnxrt")
    assert feature_map.class_agreement() == {"y": None}  # [1, 4, 2, 2] activations: not class scores


def test_a_wide_signal_is_not_class_scores(tmp_path):
    """A [1, N] output wider than any classifier (a signal, a flattened map) is not ranked as class scores:
    ranking millions of values per sample cost seconds on the chain benchmark, and meant nothing."""
    from onnx import helper, numpy_helper

    width = MAX_CLASSES + 1
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"], name="scale")], "wide",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, width])],
        [numpy_helper.from_array(np.array(1.5, np.float32), "k")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "wide.onnx")
    result = accudiff.compare(tmp_path / "wide.onnx", "fp16", candidate="onnxrt")
    assert result.class_agreement() == {"y": None}


def test_a_dataset_calibrates_int8_too(tmp_path):
    data = tmp_path / "calibration"
    data.mkdir()
    for i in range(3):
        np.savez(data / f"{i}.npz", x=np.random.default_rng(i).uniform(0, 1, (1, 3, 16, 16)).astype(np.float32))
    result = accudiff.compare(fixture("clean"), "int8", candidate="onnxrt", calib_data=data)
    assert not any("random data" in notice for notice in result.notices)


def test_each_failing_output_is_verified_on_a_sample_where_it_fails(tmp_path):
    """Two outputs: 'big' overflows FP16 on nine samples, 'fine' loses its small part (2048 + y rounds to
    a multiple of 2 in FP16) on the tenth only. Taken by the worst rows alone, the eight samples
    verification tries were all 'big' ones, where 'fine' passes: its repair was "verified" from the whole
    run's figure to a pass it never had to earn. Each output's worst failing sample is tried now, and
    every repair starts from a control that fails. Neither node of 'fine' repairs it alone: the Sub
    cancels against a weight, a cancellation the rules name with the node computing what it reads."""
    from onnx import helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["big"], name="scale_up"),
         helper.make_node("Add", ["y", "offset"], ["shifted"], name="shift"),
         helper.make_node("Sub", ["shifted", "offset"], ["fine"], name="unshift")],
        "two_faults",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 4]) for n in ("x", "y")],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 4]) for n in ("big", "fine")],
        [numpy_helper.from_array(np.array(1000.0, np.float32), "k"), numpy_helper.from_array(np.array(2048.0, np.float32), "offset")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "two.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(100, 200, (1, 4)).astype(np.float32), "y": np.zeros((1, 4), np.float32)} for _ in range(9)]
    feeds.append({"x": np.ones((1, 4), np.float32), "y": rng.uniform(0.2, 0.8, (1, 4)).astype(np.float32)})
    save_feeds(feeds, tmp_path / "data.npz")
    result = accudiff.compare(tmp_path / "two.onnx", "fp16", candidate="onnxrt", inputs=tmp_path / "data.npz")
    repairs = {f.tensor: f.repair for f in result.output_failures}
    assert set(repairs) == {"big", "fine"}
    assert 9 in repairs["fine"].samples
    for repair in repairs.values():
        assert repair.steps[0].tol_ratio > 1 and repair.verified
    fine = next(f for f in result.output_failures if f.tensor == "fine")
    assert fine.cause.node == "unshift" and "cancellation" in [f.kind for f in fine.cause.findings]
    assert sorted(fine.repair.keep) == ["shift", "unshift"]


def test_an_output_that_passes_in_the_control_keeps_the_rules_hypothesis(tmp_path):
    """Nine outputs, each overflowing FP16 on its own sample: verification tries eight samples, so one
    output passes in its control run (nothing kept). Its cause stays unverified and a notice says why,
    instead of a repair "verified" from a failure the trials never saw (the keep-lists were judged
    against the whole run's figure before)."""
    from onnx import helper, numpy_helper

    count = 9
    nodes = [helper.make_node("Split", ["x"], [f"part{i}" for i in range(count)], name="split", axis=1, num_outputs=count)]
    nodes += [helper.make_node("Mul", [f"part{i}", "k"], [f"y{i}"], name=f"scale{i}") for i in range(count)]
    graph = helper.make_graph(
        nodes, "nine_outputs", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, count])],
        [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, [1, 1]) for i in range(count)],
        [numpy_helper.from_array(np.array(1000.0, np.float32), "k")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "nine.onnx")
    save_feeds([{"x": np.where(np.arange(count) == i, 100.0 + i, 1.0).astype(np.float32)[None]} for i in range(count)], tmp_path / "data.npz")
    result = accudiff.compare(tmp_path / "nine.onnx", "fp16", candidate="onnxrt", inputs=tmp_path / "data.npz")
    assert len(result.output_failures) == count
    unverified = [f for f in result.output_failures if not f.cause.verified]
    assert len(unverified) == 1 and unverified[0].repair is None
    notice = next(n for n in result.notices if "cannot be verified where the failure does not show" in n)
    assert f"'{unverified[0].tensor}'" in notice and "on the 8 sample(s) verification runs" in notice
    assert all(f.repair.verified and f.repair.steps[0].tol_ratio > 1 for f in result.output_failures if f is not unverified[0])


def test_the_command_lines_ray_option_starts_a_local_cluster_and_says_nothing_of_it(run_cli, tmp_path):
    """`--ray` without an address, as the README shows it: a local cluster for the run, the same table as
    local workers, and none of Ray's own lines on the console."""
    pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'accudiff[ray]')")
    data = _dataset(tmp_path / "data", 4, lambda i: 0.5 if i % 3 else 8.0)
    code, out, err = run_cli("compare", fixture("overflow_activation"), "--fp16", "--load-inputs", data, "--ray", "-o", "on-ray")
    assert code == 1 and [line for line in err.splitlines() if line.strip()] == [], err
    assert all(line.startswith(("accudiff compare", "  ")) for line in out.splitlines() if line.strip()), out
    local = accudiff.compare(fixture("overflow_activation"), "fp16", candidate="onnxrt", inputs=data, workers=2)
    on_ray = json.loads((tmp_path / "on-ray" / "summary.json").read_text())
    assert on_ray["verdict"] == local.verdict and on_ray["layout"]["workers"] >= 1
    assert on_ray["counts"]["failing"] == int((local.table["status"] == "fail").sum()) > 0
    failing = {output: rows.loc[rows["status"] == "fail", "sample"].tolist() for output, rows in local.samples.groupby("tensor")}
    assert on_ray["samples"]["compared"] == 4 and {o: v["failing_samples"] for o, v in on_ray["samples"]["per_output"].items()} == failing
