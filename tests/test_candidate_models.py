"""Candidates made by other tools (--candidate-model), and quantized models given alone.

The candidates are made by the real tools: ONNX Runtime's quantize_static (QDQ, symmetric, per-channel
weights, as TensorRT builds them; INT8 and FP8) here, and NVIDIA ModelOpt's ONNX PTQ on the trained text
recognizer where ModelOpt is installed (.ci/run installs it). Causes are held to a brute-force oracle
written apart from accudiff (oracle.py): each quantized node left unquantized alone, in ONNX Runtime.
"""

from __future__ import annotations

import json
import re
from collections import Counter
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import accudiff
import oracle
from conftest import ROOT, fixture, run_printed, skip_without, user_shell_environment

sys.path.insert(0, str(ROOT))
from benchmarks import models, realistic_inputs  # noqa: E402
from accudiff.model.inputs import save_feeds  # noqa: E402
from accudiff.report.console import format_summary  # noqa: E402

OUTLIER = fixture("int8_outlier_channel")
TOP = 3


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The candidates ONNX Runtime's quantizer makes of the outlier fixture (INT8, FP8) and its inputs."""
    folder = tmp_path_factory.mktemp("candidates")
    rng = np.random.default_rng(7)
    calibration = [{"x": rng.uniform(0, 1, (1, 8, 6, 6)).astype(np.float32)} for _ in range(4)]
    save_feeds([{"x": rng.uniform(0, 1, (1, 8, 6, 6)).astype(np.float32)}], folder / "inputs.npz")
    for grid in ("int8", "fp8"):
        models.onnxruntime_qdq(OUTLIER, calibration, folder / f"outlier-{grid}.onnx", grid)
    return folder


def _summary(folder) -> dict:
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.parametrize("grid", ["int8", "fp8"])
def test_a_candidate_quantized_by_onnxruntime_is_compared_with_its_float_model(made, grid, run_cli, tmp_path):
    """INT8: the Mul's weight quantized with one scale zeroes seven of its eight channels, and the Conv
    reads its activation on a grid the outlier channel stretches: neither alone repairs the output, both
    together do (several). FP8: the Relu's input saturates at the calibrated range. Every tensor has its
    partner; the repair is printed as the quantizers' options and written as repaired-candidate.onnx, which
    compared again meets the tolerance."""
    candidate = made / f"outlier-{grid}.onnx"
    code, out, err = run_cli("compare", OUTLIER, "--candidate-model", candidate, "--load-inputs", made / "inputs.npz", "-o", "report")
    assert code == 1, err
    summary = _summary(tmp_path / "report")
    assert summary["precision"] == grid
    assert summary["alignment"]["matched"] == summary["alignment"]["reference_tensors"] == 3
    cause, repair = summary["outputs"][0]["cause"], summary["outputs"][0]["repair"]
    assert repair["verified"]
    if grid == "int8":
        assert cause["kind"] == "several" and {cause["node"], *(c["node"] for c in cause["co_causes"])} == {"conv", "channel_gain"}
        gain = next(c for c in [cause, *cause["co_causes"]] if c["node"] == "channel_gain")
        assert any(f["kind"] == "per_tensor_scale" and "7 of its channels" in f["message"] for f in gain["findings"])
    else:
        assert cause["kind"] == "local" and cause["node"] == "relu"
        assert any(f["kind"] == "fp8_clipping" and "FP8 E4M3" in f["message"] for f in cause["findings"])
    assert "--nodes_to_exclude" in out and "nodes_to_exclude=[" in out
    repaired = tmp_path / "report" / "repaired-candidate.onnx"
    assert summary["files"]["repaired_candidate"] == "repaired-candidate.onnx" and repaired.is_file()
    code, again, err = run_cli("compare", OUTLIER, "--candidate-model", repaired, "--load-inputs", made / "inputs.npz", "-o", "repaired")
    assert code == 0, again + err


@pytest.mark.parametrize("grid", ["int8", "fp8"])
def test_the_causes_agree_with_the_keep_one_oracle(made, grid, tmp_path):
    """The oracle leaves each quantized node unquantized alone: where one of them repairs the output, the
    named cause is among its best; where none does, the cause is not 'local'."""
    candidate = made / f"outlier-{grid}.onnx"
    feed = {"x": np.load(made / "inputs.npz")["0/x"]}
    tolerance = oracle.documented_tolerance(grid)  # the README's, for the one format the candidate holds
    ranking = oracle.candidate_single_keep_ranking(OUTLIER, candidate, feed, tolerance, "y")
    result = accudiff.compare(OUTLIER, candidate_model=candidate, inputs=made / "inputs.npz", candidate="onnxrt")
    cause = result.output_failures[0].cause
    if ranking[0][0] <= 1.0:
        assert cause.kind == "local" and cause.node in [node for _, node in ranking[:TOP]], ranking
    else:
        assert cause.kind != "local", ranking
        both = oracle.candidate_output_ratio(OUTLIER, candidate, oracle._session(onnx.load(str(OUTLIER))).run(["y"], feed)[0], feed, tolerance, "y",
                                             {cause.node, *(c.node for c in cause.co_causes)})
        assert both <= 1.0


def test_a_quantized_model_given_alone_is_compared_with_its_float_form(made, run_cli, tmp_path):
    """Without a precision flag, the quantized model is its own candidate; the reference is its float form,
    whose weights are the dequantized ones. Here the weight's one scale already zeroed the channels the
    activation's grid would lose, in the float form too: it passes, and a notice says that the weights'
    rounding cannot show, and how to see it (against the float model it fails, above)."""
    code, out, err = run_cli("compare", made / "outlier-int8.onnx", "--load-inputs", made / "inputs.npz", "-o", "report")
    assert code == 0, err
    assert "2 weight(s) kept only quantized were dequantized" in out and "accudiff compare float.onnx --candidate-model outlier-int8.onnx" in out
    summary = _summary(tmp_path / "report")
    assert summary["precision"] == "int8" and summary["alignment"]["matched"] == summary["alignment"]["reference_tensors"]


def test_a_relu_the_quantizer_folded_is_not_compared_with_another_value(run_cli, tmp_path):
    """ONNX Runtime's asymmetric quantizer drops a Relu after a BatchNormalization and lets the Q/DQ pair
    clip: that node then writes the Relu's name. The reference's Relu output has no partner (said why), the
    BatchNormalization's output is compared with the node's own result; given alone, the float form keeps
    the clipping of such pairs, so its output is the model's (not NaN), and the node its verified cause
    names is one of those whose keep repairs the output against the true float model too (the float form
    holds the rounded weights, so the best keep differs: against the true float model, undoing a weight's
    rounding is what repairs most; the two causes were both None before the search covered every node)."""
    quantized = models.ppocr_cls_v2_qdq_int8(tmp_path)
    save_feeds(realistic_inputs.dataset("ppocr_cls_v2", 4), tmp_path / "lines.npz")
    code, out, err = run_cli("compare", models.ppocr_cls_v2(), "--candidate-model", quantized, "--load-inputs", "lines.npz", "-o", "explicit")
    assert code == 1, err  # int8 per tensor on four drawn lines: out of tolerance, as the cause below needs
    explicit = _summary(tmp_path / "explicit")
    unmatched = explicit["alignment"]["unmatched"]
    assert "relu_0.tmp_0" in unmatched and "writes its name" in unmatched["relu_0.tmp_0"]
    assert "batch_norm_1.tmp_2" not in unmatched
    code, out, err = run_cli("compare", quantized, "--load-inputs", "lines.npz", "-o", "alone")
    assert code == 1, err  # int8 per tensor on four drawn lines: out of tolerance, as the cause below needs
    alone = _summary(tmp_path / "alone")
    assert "folded a Relu or a Clip" in out
    assert all(np.isfinite(float(o["max_abs_err"])) for o in alone["outputs"])
    against_float, against_form = (s["outputs"][0]["cause"] for s in (explicit, alone))
    assert against_float["verified"] and against_form["verified"] and against_form["node"] is not None
    repairing = {against_float["node"], *(c["node"] for c in against_float["alternatives"])}
    assert against_form["node"] in repairing, (against_form["node"], repairing)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fp16"], "--fp16 would make another one"),
        (["--calib-data", "inputs.npz"], "--calib-data calibrates an INT8 candidate"),
        (["--no-autokeep"], "--no-autokeep"),
    ],
)
def test_options_that_would_make_another_candidate_are_refused(made, extra, message, run_cli, tmp_path):
    save_feeds([{"x": np.zeros((1, 8, 6, 6), np.float32)}], tmp_path / "inputs.npz")
    code, out, err = run_cli("compare", OUTLIER, "--candidate-model", made / "outlier-int8.onnx", *extra)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_candidate_of_another_model_or_a_quantized_reference_is_one_sentence(made, run_cli):
    code, out, err = run_cli("compare", OUTLIER, "--candidate-model", fixture("clean"))
    assert code == 2 and err.count("\n") == 1 and "is not a version of 'int8_outlier_channel.onnx'" in err, err
    code, out, err = run_cli("compare", made / "outlier-fp8.onnx", "--candidate-model", made / "outlier-int8.onnx")
    assert code == 2 and err.count("\n") == 1 and "give that float model first" in err, err
    code, out, err = run_cli("compare", OUTLIER, "--candidate-model", "missing.onnx")
    assert code == 2 and "candidate model file 'missing.onnx' does not exist" in err, err


def test_a_float_model_given_as_its_own_candidate_is_one_true_sentence(run_cli):
    """An FP32 model given as its own candidate was refused as one that "quantizes only its weights (fp32)":
    it quantizes nothing. It is its own float form: nothing to compare, said so."""
    code, out, err = run_cli("compare", fixture("clean"), "--candidate-model", fixture("clean"))
    assert code == 2 and err.count("\n") == 1 and "stores no value in a narrower format: it is its own float form" in err, err
    assert "quantizes only its weights" not in err


def test_fp8_values_cross_a_segment_boundary(tmp_path):
    """A comparison cut into segments between a QuantizeLinear and its DequantizeLinear: the FP8 value comes
    back from ONNX Runtime widened to FP32 (exactly) and is fed to the next segment that way (it failed with
    'Unexpected input data type ... tensor(Float8E4M3FN)' on ModelOpt's FP8 recognizer)."""
    size = 1 << 20
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["a"], name="double"),
        helper.make_node("QuantizeLinear", ["a", "scale", "zero"], ["q"], name="quantize"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["d"], name="dequantize"),
        helper.make_node("Mul", ["d", "two"], ["y"], name="again"),
    ]
    graph = helper.make_graph(
        nodes, "fp8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, size])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two"), numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
         helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0.0])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), str(tmp_path / "fp8.onnx"))
    save_feeds([{"x": np.random.default_rng(0).uniform(0, 4, (1, size)).astype(np.float32)}], tmp_path / "x.npz")
    result = accudiff.compare(tmp_path / "fp8.onnx", "fp16", inputs=tmp_path / "x.npz", max_memory="16M", candidate="onnxrt", verify=False)
    table = result.table.set_index("tensor")
    assert table.loc["q", "status"] != "not observed" and table.loc["q", "ref_max"] > 0  # the FP8 codes themselves, widened
    assert result.coverage == (4, 4)


def test_an_overflow_is_absorbed_by_the_tanh_not_by_a_shape_read_off_its_path(tmp_path):
    """An FP16 overflow a Tanh turns back into 1 is ruled out, absorbed by the Tanh: the Shape of the same
    value, which comes first and is 'within tolerance' as integers are, undoes nothing (it was named)."""
    nodes = [
        helper.make_node("Mul", ["x", "three_hundred"], ["large"], name="enlarge"),
        helper.make_node("Mul", ["large", "large"], ["amplified"], name="amplify"),
        helper.make_node("Shape", ["amplified"], ["shape"], name="shape_of"),
        helper.make_node("Tanh", ["amplified"], ["squashed"], name="squash"),
        helper.make_node("Reshape", ["squashed", "shape"], ["reshaped"], name="reshape"),
        helper.make_node("Mul", ["x", "three_hundred"], ["scaled"], name="scale"),
        helper.make_node("Mul", ["scaled", "scaled"], ["square"], name="square"),
        helper.make_node("Sqrt", ["square"], ["root"], name="root"),
        helper.make_node("Add", ["reshaped", "root"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "absorbed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(np.array(300.0, np.float32), "three_hundred")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "absorbed.onnx"))
    result = accudiff.compare(tmp_path / "absorbed.onnx", "fp16", candidate="onnxrt", val_range=["0.5,1"])
    cause = result.output_failures[0].cause
    assert cause.kind == "local" and cause.node == "square", cause
    absorbed = {a.node: a.by for a in cause.absorbed}
    assert absorbed.get("amplify") == "squash", cause


def test_bisect_precision_and_subgraph_take_the_candidate_model(made, tmp_path):
    """bisect precision keeps nodes of the candidate and writes it repaired (passing when compared);
    bisect subgraph cuts the candidate at the same nodes and its command fails as it says, run verbatim."""
    inputs = made / "inputs.npz"
    candidate = made / "outlier-int8.onnx"
    done = subprocess.run(["accudiff", "bisect", "precision", str(OUTLIER), "--candidate-model", str(candidate), "--load-inputs", str(inputs),
                           "-o", str(tmp_path / "precision")], capture_output=True, text=True, env=user_shell_environment())
    assert done.returncode == 1, done.stderr
    result = json.loads((tmp_path / "precision" / "result.json").read_text())
    # The two causes, and the Relu reading 'conv', kept with it so that what it computed is not quantized again.
    assert result["repaired"] and {"conv", "channel_gain"} <= set(result["keep"]) <= {"conv", "channel_gain", "relu"}
    assert result["repaired_model"] == "repaired-candidate.onnx"
    again = accudiff.compare(OUTLIER, candidate_model=tmp_path / "precision" / "repaired-candidate.onnx", inputs=inputs, candidate="onnxrt")
    assert again.passed
    done = subprocess.run(["accudiff", "bisect", "subgraph", str(OUTLIER), "--candidate-model", str(candidate), "--load-inputs", str(inputs),
                           "-o", str(tmp_path / "subgraph")], capture_output=True, text=True, env=user_shell_environment())
    assert done.returncode == 1, done.stderr
    result = json.loads((tmp_path / "subgraph" / "result.json").read_text())
    assert result["confirmed"] and result["candidate_path"] == "subgraph_candidate.onnx" and "--candidate-model subgraph_candidate.onnx" in result["command"]
    replay = subprocess.run(result["command"] + " -o replay", shell=True, cwd=tmp_path / "subgraph", capture_output=True, text=True, env=user_shell_environment())
    assert replay.returncode == 1, replay.stdout + replay.stderr


def test_the_pytest_plugin_takes_the_candidate_model(made, pytester):
    pytester.makepyfile(
        f"""
        import pytest

        def test_candidate(accudiff):
            accudiff.compare({str(OUTLIER)!r}, candidate_model={str(made / "outlier-int8.onnx")!r}, inputs={str(made / "inputs.npz")!r}).assert_within()
        """
    )
    outcome = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    outcome.assert_outcomes(failed=1)
    assert "several" in outcome.stdout.str() or "channel_gain" in outcome.stdout.str()


def test_the_plugin_judges_a_candidate_model_by_its_own_precisions_tolerance(made, pytester):
    """A team's accudiff_tolerances line for INT8 did not apply to an INT8 candidate given as candidate_model:
    the plugin looked up the precision asked for (fp32), and its summary said [fp32]. The candidate's own
    label names its line, its report folder and its summary line."""
    pytester.makeini('[pytest]\naccudiff_tolerances = int8 atol=1e9 rtol=1e9 stol=1\n')
    given = f"{str(OUTLIER)!r}, candidate_model={str(made / 'outlier-int8.onnx')!r}, inputs={str(made / 'inputs.npz')!r}"
    pytester.makepyfile(
        f"""
        def test_within_the_teams_int8_tolerance(accudiff):
            accudiff.compare({given}).assert_within()

        def test_within_a_tight_one(accudiff):
            accudiff.compare({given}).assert_within(atol=1e-6, rtol=1e-6, stol=0)
        """
    )
    outcome = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    outcome.assert_outcomes(passed=1, failed=1)
    assert f"FAILED {OUTLIER} [int8] (test_the_plugin_judges_a_candidate_model_by_its_own_precisions_tolerance.py::test_within_a_tight_one)" in outcome.stdout.str()
    assert {p.name.split("-")[1] for p in (pytester.path / "reports" / "pytest").iterdir()} == {"int8"}


@pytest.fixture(scope="module")
def modelopt_candidates(tmp_path_factory):
    """The trained recognizer quantized by ModelOpt (INT8 and FP8, calibrated on 32 drawn lines), and 4 others."""
    folder = tmp_path_factory.mktemp("modelopt")
    calibration = np.concatenate([realistic_inputs.ppocr_rec(seed)["x"] for seed in range(100, 132)])
    try:
        made = {mode: models.modelopt_quantized(models.ppocr_rec_v4(), calibration, folder / f"rec-{mode}.onnx", mode) for mode in ("int8", "fp8")}
    except ModuleNotFoundError as missing:
        skip_without(missing)
    save_feeds(realistic_inputs.dataset("ppocr_rec_v4", 4), folder / "lines.npz")
    return made, folder / "lines.npz"


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_modelopt_candidates_of_the_trained_recognizer(modelopt_candidates, mode):
    """ModelOpt's INT8 and FP8 recognizers (it also casts the rest to FP16): at least 90% of the float
    model's tensors compared, the per-time-step top-1 agreement reported, and the cause either verified or
    'accumulated' where the oracle finds that no single node left unquantized repairs the output."""
    made, lines = modelopt_candidates
    result = accudiff.compare(models.ppocr_rec_v4(), candidate_model=made[mode], inputs=lines, candidate="onnxrt")
    compared, computed = result.coverage
    assert compared >= 0.9 * computed
    assert result.precision == f"{mode}+fp16"
    agreement = result.class_agreement()["softmax_11.tmp_0"]
    with np.load(lines) as saved:  # the top-1 agreement over every time step of the 4 lines, counted here, as
        feeds = [{"x": saved[key]} for key in sorted(saved.files, key=lambda k: int(k.split("/")[0]))]
    import onnxruntime  # ONNX Runtime runs the two files by default (its graph optimizations move one FP8 step's top-1)

    reference, quantized = (onnxruntime.InferenceSession(str(m), providers=["CPUExecutionProvider"]) for m in (models.ppocr_rec_v4(), made[mode]))
    same = [r.argmax(-1) == c.argmax(-1) for r, c in ((reference.run(None, f)[0], quantized.run(None, f)[0]) for f in feeds)]
    assert agreement["top1"] == pytest.approx(np.concatenate([s.ravel() for s in same]).mean(), abs=1e-9)
    failure = result.output_failures[0]
    # The split by op type keeps as the other ops only those ModelOpt quantized (reading a Q/DQ pair), not
    # every node it casts to FP16 (107 Adds were said quantized), and names a node only it has (Flatten)
    graph = onnx.load(str(made[mode]), load_external_data=False).graph
    dequantized = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    reading = Counter(n.op_type for n in graph.node if n.op_type not in ("QuantizeLinear", "Conv", "MatMul", "Shape") and dequantized & set(n.input))
    split = result.loss_split[failure.tensor]["op_types"]
    assert set(split["matrix_ops"]) == {"Conv", "MatMul"} and split["other_ops"] == dict(reading), split
    if failure.cause.kind == "accumulated":
        feed = {"x": np.load(lines)["0/x"]}
        tolerance = oracle.documented_tolerance(mode)  # the README's loosest of the formats it holds (FP16's is tighter)
        ranking = oracle.candidate_single_keep_ranking(models.ppocr_rec_v4(), made[mode], feed, tolerance, "softmax_11.tmp_0")
        assert ranking[0][0] > 1.0, ranking[:3]
    else:
        assert failure.repair.verified


def test_modelopt_int4_of_the_trained_sentence_encoder_agrees_with_the_keep_one_oracle(tmp_path):
    """ModelOpt's INT4 (AWQ, blocked INT4 weights in DequantizeLinear; calibrated on sentences other than the
    compared ones) of paraphrase-MiniLM, held to a tolerance it misses: the oracle leaves each of the 18
    quantized MatMuls unquantized alone, reading the FP32 model's weight. accudiff says 'accumulated' for
    an output exactly where no single keep repairs it; it searched every one of the 18; and each keep it
    measured alone is the oracle's figure (within 5%: the oracle runs without ONNX Runtime's graph
    optimizations, which fuse DequantizeLinear and MatMul)."""
    try:
        encoder = models.minilm_l3()
        candidate = models.modelopt_quantized(encoder, realistic_inputs.sentences(100), tmp_path / "int4.onnx", "int4")
    except ModuleNotFoundError as missing:
        skip_without(missing)
    feed = realistic_inputs.sentences(0)
    save_feeds([feed], tmp_path / "sentences.npz")
    tolerance = (0.02, 0.1, 0.02)
    result = accudiff.compare(encoder, candidate_model=candidate, inputs=tmp_path / "sentences.npz", candidate="onnxrt",
                              atol=tolerance[0], rtol=tolerance[1], stol=tolerance[2])
    assert result.precision == "int4-weight" and result.output_failures
    for failure in result.output_failures:
        ranking = oracle.candidate_single_keep_ranking(encoder, candidate, feed, tolerance, failure.tensor)
        assert len(ranking) == 18 and failure.cause.searched is not None
        oracle_ratio = {node: ratio for ratio, node in ranking}
        if failure.cause.kind == "accumulated":
            assert ranking[0][0] > 1, ranking[:TOP]
            assert "of the 18 quantized nodes upstream" in format_summary(result, width=10_000)
        else:
            assert failure.cause.node in [node for _, node in ranking[:TOP]], (failure.cause.node, ranking[:TOP])
        for contributor in failure.cause.contributors:
            if contributor.keep == [contributor.node]:
                assert contributor.tol_ratio_kept == pytest.approx(oracle_ratio[contributor.node], rel=0.05), contributor.node


def test_an_fp16_model_onnx_runtimes_converter_made_is_diagnosed_as_the_keep_one_oracle_finds(tmp_path):
    """The trained text detector converted to FP16 by ONNX Runtime's own converter (onnxruntime.transformers
    .float16, keep_io_types), fed a drawn page: nothing of the candidate comes from accudiff. Its graph is
    unsorted (the converter appends its input Casts last; ONNX Runtime sorts it as it loads): it was refused
    as "fails the ONNX checker: Nodes in a graph must be topologically sorted". The output accudiff fails
    is the one the oracle fails at the README's tolerance, the named cause is the oracle's best single keep,
    and the figures accudiff verified (the output before and with the cause kept) are the oracle's."""
    from onnxruntime.transformers import float16

    try:
        detector = models.ppocr_det_v4()
    except ModuleNotFoundError as missing:
        skip_without(missing)
    candidate = tmp_path / "det-fp16.onnx"
    onnx.save(float16.convert_float_to_float16(onnx.load(str(detector)), keep_io_types=True), str(candidate))
    feed = realistic_inputs.FEEDS["ppocr_det_v4"](0)
    save_feeds([feed], tmp_path / "page.npz")
    result = accudiff.compare(detector, candidate_model=candidate, inputs=tmp_path / "page.npz", candidate="onnxrt")
    tolerance = oracle.documented_tolerance("fp16")
    as_converted = {}
    for output in oracle.graph_outputs(detector):
        as_converted[output] = oracle.fp16_candidate_keep_ranking(detector, candidate, feed, tolerance, output)
    assert {o for o, (base, _) in as_converted.items() if base > 1} == {f.tensor for f in result.output_failures} != set()
    for failure in result.output_failures:
        base, ranking = as_converted[failure.tensor]
        assert failure.repair.steps[0].tol_ratio == pytest.approx(base, rel=1e-3)
        if failure.cause.kind == "accumulated":
            assert ranking[0][0] > 1, ranking[:TOP]
            continue
        assert failure.cause.verified and failure.cause.node == ranking[0][1], (failure.cause.node, ranking[:TOP])
        named = next(c for c in failure.cause.contributors if c.node == failure.cause.node)
        assert named.keep == [failure.cause.node] and named.tol_ratio_kept == pytest.approx(ranking[0][0], rel=1e-3)


def test_bisect_says_the_tolerance_an_output_meets_in_compares_words(run_cli, tmp_path):
    """The FP16 detector by ONNX Runtime's converter, whose map is 0 where the candidate says 1: no rtol can
    pass it. compare says "no rtol (an element whose reference is 0 errs more than atol)"; bisect precision,
    in its "most of the model" answer, said "rtol inf"."""
    from onnxruntime.transformers import float16

    try:
        detector = models.ppocr_det_v4()
    except ModuleNotFoundError as missing:
        skip_without(missing)
    onnx.save(float16.convert_float_to_float16(onnx.load(str(detector)), keep_io_types=True), str(tmp_path / "det-fp16.onnx"))
    save_feeds([realistic_inputs.FEEDS["ppocr_det_v4"](0)], tmp_path / "page.npz")
    code, out, err = run_cli("bisect", "precision", detector, "--candidate-model", "det-fp16.onnx", "--load-inputs", "page.npz", "-o", "fix")
    assert code == 1, err
    assert "as it is meets atol 0.998 (at rtol 0.01, stol 0.002), or no rtol (an element whose reference is 0 errs more than atol)" in out and "rtol inf" not in out, out[-3000:]


def test_a_candidate_compared_in_segments_gives_the_table_of_one_run(tmp_path):
    """Cut into segments by a small memory budget, the candidate's nodes (its Q/DQ pairs among them) run
    with the segment of the model's nodes they answer for, and the table is the one-shot table."""
    try:
        classifier = models.ppocr_cls_v2()
    except ModuleNotFoundError as missing:
        skip_without(missing)
    candidate = models.onnxruntime_qdq(classifier, realistic_inputs.dataset("ppocr_cls_v2", 4, 100), tmp_path / "cls-int8.onnx")
    save_feeds(realistic_inputs.dataset("ppocr_cls_v2", 2), tmp_path / "lines.npz")
    options = {"candidate_model": candidate, "inputs": tmp_path / "lines.npz", "candidate": "onnxrt", "verify": False}
    whole, cut = (accudiff.compare(classifier, max_memory=budget, **options) for budget in ("1G", "16M"))
    assert whole.coverage == cut.coverage and whole.coverage[0] > 0.9 * whole.coverage[1]
    columns = ["tensor", "status", "elements", "outside_count", "max_abs_err", "isolated_max_abs_err"]
    assert whole.table[columns].equals(cut.table[columns])


def test_a_given_candidates_constants_that_became_inf_or_zero_are_findings(tmp_path):
    """A converter that keeps names stored the mask's fill, FP32's lowest, in BF16 (where it is -Inf) and casts
    it to FP32 as the model runs (as ONNX Runtime's FP16 converter leaves the nodes it blocks), and another
    casts the model's epsilon 1e-12 to FP16 as it runs (where it is 0): the first is the verified cause's
    finding, with the NaN that follows, the second a finding of the Add that reads it."""
    from accudiff.model.inventory import describe
    from accudiff.transforms.fp16 import BF16, FP16, to_fp16
    from accudiff.transforms.tool_made import adopt

    lowest = np.float32(np.finfo(np.float32).min)

    def mask_model(fill: onnx.TensorProto, widen: bool) -> onnx.ModelProto:
        nodes = [
            helper.make_node("Sub", ["one", "mask"], ["hidden"], name="invert"),
            *([helper.make_node("Cast", ["lowest"], ["lowest_fp32"], name="widen_lowest", to=TensorProto.FLOAT)] if widen else []),
            helper.make_node("Mul", ["hidden", "lowest_fp32" if widen else "lowest"], ["bias"], name="fill"),
            helper.make_node("Add", ["x", "bias"], ["scores"], name="apply_mask"),
            helper.make_node("Softmax", ["scores"], ["weights"], name="softmax"),
            helper.make_node("Constant", [], ["eps"], name="epsilon", value=numpy_helper.from_array(np.float32(1e-12))),
            helper.make_node("Add", ["weights", "eps"], ["y"], name="add_eps"),
        ]
        graph = helper.make_graph(
            nodes, "mask", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]), helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [numpy_helper.from_array(np.float32(1), "one"), fill],
        )
        return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]))

    reference = tmp_path / "mask.onnx"
    onnx.save(mask_model(numpy_helper.from_array(lowest, "lowest"), widen=False), str(reference))
    stored = helper.make_tensor("lowest", TensorProto.BFLOAT16, [], BF16.values(np.array(lowest)).tobytes(), raw=True)
    onnx.save(mask_model(stored, widen=True), str(tmp_path / "mask-bf16.onnx"))
    onnx.save(to_fp16(onnx.load(str(reference)), half=FP16, autokeep=False).model, str(tmp_path / "mask-fp16.onnx"))
    save_feeds([{"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4), "mask": np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)}], tmp_path / "in.npz")
    result = accudiff.compare(reference, candidate_model=tmp_path / "mask-bf16.onnx", inputs=tmp_path / "in.npz")
    cause = result.output_failures[0].cause
    assert cause.node == "fill" and cause.verified, cause
    found = {f.kind: f.message for f in cause.findings}
    assert "its constant 'lowest' holds -3.4028e+38 (FP32's lowest" in found["constant_overflow"] and "in BF16 it became -Inf" in found["constant_overflow"]
    fp16 = adopt(describe(tmp_path / "mask-fp16.onnx", onnx.load(str(tmp_path / "mask-fp16.onnx"))), describe(reference, onnx.load(str(reference))))
    assert fp16.constant_findings["add_eps"] == [("constant_underflow", "its constant 'eps' holds 1e-12, below half FP16's smallest subnormal 5.96e-08: in FP16 it became 0")]


def test_the_converters_a_repair_names_repair_it_when_run_again(tmp_path):
    """A weight held in a Constant node (as paddle2onnx writes every weight) whose FP16 rounding breaks the
    output: x @ W, W's columns 1000.1 and -1000 (FP16 steps by 0.5 there), x whole numbers. accudiff verifies
    keeping the MatMul. It used to print onnxconverter-common's node_block_list as a way to convert again;
    that converter rounds a Constant's weight to FP16 all the same (run again so, the output still fails),
    so it is named as not repairing it; ModelOpt AutoCast's --nodes_to_exclude, printed, repairs it."""
    from onnxconverter_common.float16 import convert_float_to_float16

    weight = np.array([[1000.1, 3000.1, -500.1, 2000.1], [-1000.0, -3000.0, 500.0, -2000.0]], np.float32)
    nodes = [helper.make_node("Constant", [], ["w"], name="weights", value=numpy_helper.from_array(weight)),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])])
    model = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    feed = {"x": np.array([[1, 1], [2, 2], [3, 3]], np.float32)}
    save_feeds([feed], tmp_path / "x.npz")
    onnx.save(convert_float_to_float16(onnx.load(str(model)), keep_io_types=True), str(tmp_path / "fp16.onnx"))
    result = accudiff.compare(model, candidate_model=tmp_path / "fp16.onnx", inputs=tmp_path / "x.npz", candidate="onnxrt")
    (failure,) = result.output_failures
    assert failure.cause.node == "project" and failure.repair.verified and failure.repair.keep == ["project"]
    text = format_summary(result, width=10_000)
    assert "not onnxconverter-common's node_block_list: it rounds the weights Constant nodes hold for 'project'" in text, text
    assert "ModelOpt AutoCast --nodes_to_exclude 'project$'" in text, text
    tolerance = oracle.documented_tolerance("fp16")
    blocked = tmp_path / "blocked.onnx"
    onnx.save(convert_float_to_float16(onnx.load(str(model)), keep_io_types=True, node_block_list=["project"]), str(blocked))
    reference = oracle._session(onnx.load(str(model))).run(["y"], feed)[0]
    assert oracle._ratio(reference, oracle._session(onnx.load(str(blocked))).run(["y"], feed)[0], tolerance) > 1  # so not printed as a repair
    pytest.importorskip("modelopt", reason="needs modelopt (ModelOpt's AutoCast; .ci/run installs it)")
    converted = tmp_path / "autocast.onnx"
    done = subprocess.run([sys.executable, "-m", "modelopt.onnx.autocast", "--onnx_path", str(model), "--output_path", str(converted),
                           "--keep_io_types", "--log_level", "ERROR", "--nodes_to_exclude", "project$"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert oracle._ratio(reference, oracle._session(onnx.load(str(converted))).run(["y"], feed)[0], tolerance) <= 1


def test_a_candidate_onnx_runtime_refuses_to_load_is_refused_in_one_sentence(run_cli, tmp_path):
    """polygraphy convert --fp-to-fp16 (onnxconverter-common's converter) makes of the trained file-type
    classifier a model ONNX Runtime refuses ('Type parameter (T) of Optype (MatMul) bound to different
    types'); accudiff ran its own retyped form of it and said PASS. Now: exit 2, ONNX Runtime's reason quoted,
    no report left behind."""
    import onnx
    from onnxconverter_common.float16 import convert_float_to_float16

    magika = models.magika_v3()
    converted = tmp_path / "magika_fp16.onnx"
    onnx.save(convert_float_to_float16(onnx.load(str(magika)), keep_io_types=True, disable_shape_infer=True), str(converted))  # as polygraphy calls it
    save_feeds([realistic_inputs.file_bytes(seed) for seed in range(2)], tmp_path / "files.npz")
    code, out, err = run_cli("compare", magika, "--candidate-model", converted, "--load-inputs", tmp_path / "files.npz", "-o", "report")
    assert code == 2 and err.count("\n") == 1, err
    assert "ONNX Runtime refuses to load the candidate model" in err and "bound to different types" in err
    assert not (tmp_path / "report").exists()


def test_the_readmes_modelopt_example_runs_as_written(tmp_path):
    """The README's ModelOpt block, each line pasted into a shell as written: the trained recognizer quantized
    to FP8 (calibrated on 32 drawn lines) fails on 24 others at the top-1 agreement it says; bisect precision
    finds the nodes to keep for --require top1=0.99; ModelOpt quantizes again without them; and the new
    candidate meets the requirement. (Minutes: ModelOpt twice, and the bisection.)"""
    pytest.importorskip("modelopt", reason="needs modelopt (ModelOpt's ONNX quantizer; .ci/run installs it)")
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("A model quantized by NVIDIA ModelOpt, end to end"):]
    lines = [line.split("#")[0].strip() for line in block.split("```\n")[1].splitlines() if line.strip()]
    said = {i: line.split("#", 1)[1] for i, line in enumerate(block.split("```\n")[1].splitlines()) if "#" in line}
    shutil.copy(models.ppocr_rec_v4(), tmp_path / "rec.onnx")
    np.save(tmp_path / "calib.npy", np.concatenate([realistic_inputs.ppocr_rec(seed)["x"] for seed in range(100, 132)]))
    (tmp_path / "lines").mkdir()
    for i, feed in enumerate(realistic_inputs.dataset("ppocr_rec_v4", 24)):
        save_feeds([feed], tmp_path / "lines" / f"{i:02d}.npz")
    outputs = []
    for line, expected in zip(lines, (0, 1, 1, 0, 0, 1), strict=True):  # bisect exits 1: it found what fails; INCONCLUSIVE exits 1
        done = run_printed(line, tmp_path)
        assert done.returncode == expected, (line, done.stdout[-3000:], done.stderr[-2000:])
        outputs.append(done.stdout)
    for index, comment in said.items():  # "FAIL, top-1 94.69%": the verdict as said, the figure within a point and a half
        verdict, figure = re.search(r"(PASS|FAIL|INCONCLUSIVE), top-1 ([\d.]+)%", comment).groups()
        measured = float(re.search(r"top-1 agreement ([\d.]+)%", outputs[index]).group(1))
        assert f"verdict: {verdict}" in outputs[index] and abs(measured - float(figure)) <= 1.5, (comment, measured)


def test_a_blocked_int4_candidate_with_large_scales_is_read_where_they_lie(tmp_path):
    """INT4 weights in blocks of 32 with 16 KB of FP32 scales (as ModelOpt's INT4 writes them): a model's large
    weights are referenced in its file once read, and reading a scale or zero point as numpy's to_array does
    failed on such a reference ("should be stored in int4.onnx, but it is not regular file"); INT4 weights
    counted 0 bytes, so the checker was shown their references too. And INT4 codes held in int32_data (as
    onnx.helper.make_tensor writes them) were saved one a byte, where ONNX Runtime reads two ("external data
    size mismatch")."""
    rng = np.random.default_rng(8)
    weight = rng.standard_normal((2048, 64)).astype(np.float32)
    scale = np.abs(weight.reshape(64, 32, 64)).max(axis=1) / 7
    codes = np.clip(np.rint(weight / np.repeat(scale, 32, axis=0)), -8, 7).astype(np.int8)
    inputs, outputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2048])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])]
    reference = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="project")], "g", inputs, outputs, [numpy_helper.from_array(weight, "w")])
    blocked = helper.make_graph([helper.make_node("DequantizeLinear", ["w_codes", "w_scale"], ["w"], name="dq", axis=0, block_size=32),
                                 helper.make_node("MatMul", ["x", "w"], ["y"], name="project")], "g", inputs, outputs,
                                [helper.make_tensor("w_codes", TensorProto.INT4, codes.shape, codes.ravel().tolist()), numpy_helper.from_array(scale, "w_scale")])
    for graph, name in ((reference, "model.onnx"), (blocked, "int4.onnx")):
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / name))
    save_feeds([{"x": rng.standard_normal((4, 2048)).astype(np.float32)}], tmp_path / "x.npz")
    result = accudiff.compare(tmp_path / "model.onnx", candidate_model=tmp_path / "int4.onnx", inputs=tmp_path / "x.npz", candidate="onnxrt")
    assert result.precision == "int4-weight" and result.coverage[0] == result.coverage[1]


@pytest.mark.parametrize("precision", ["int8+fp16", "fp16"])
def test_the_printed_modelopt_patterns_select_exactly_the_nodes_kept(precision):
    """ModelOpt's --nodes_to_exclude (quantization and AutoCast) matches a pattern from a name's start (re.match):
    printed as 'p2o\\.Conv\\.1', keeping the recognizer's p2o.Conv.1 excluded p2o.Conv.10 to .19 as well, more
    than the verified repair. Each printed pattern, read as ModelOpt reads it, selects exactly its node among
    the trained recognizer's."""
    import shlex

    from accudiff.report.repair_text import remake_lines

    names = [node.name for node in onnx.load(str(models.ppocr_rec_v4())).graph.node]
    kept = ["p2o.Conv.1", "p2o.Add.2"]
    [line, *_] = remake_lines(kept, precision, {}, set())
    patterns = shlex.split(re.search(r"--nodes_to_exclude (.*?)(;|$| \()", line).group(1))
    assert [[name for name in names if re.match(pattern, name)] for pattern in patterns] == [[name] for name in kept]


def test_a_repair_whose_pruning_stopped_short_says_how_many_nodes_it_did_not_try(tmp_path, run_cli, monkeypatch):
    """bisect precision prunes a passing prefix of its ranking within PRUNE_LIMIT runs, the last added first: a
    longer list's first nodes are never tried without. It said nothing of them (the recognizer in INT8 with
    --require top1=0.95: 38 nodes pruned to 21 in 32 runs, 6 never tried). MiniLM by quantize_dynamic, its
    passing prefix pruned within 4 runs: its first nodes were not tried; within 32, each was."""
    from accudiff.bisect import precision, report

    try:
        encoder = models.minilm_l3()
    except ModuleNotFoundError as missing:
        skip_without(missing)
    candidate = models.onnxruntime_dynamic(encoder, tmp_path / "int8.onnx")
    save_feeds([realistic_inputs.sentences(0)], tmp_path / "sentences.npz")
    common = ["bisect", "precision", encoder, "--candidate-model", candidate, "--load-inputs", tmp_path / "sentences.npz"]
    code, out, err = run_cli(*common, "-o", tmp_path / "all")
    assert code == 1 and "each of them is needed: without any one of them (each tried)" in out, out + err
    assert "were not tried without" not in out
    assert "ModelOpt" not in out and "quantize_dynamic(..., nodes_to_exclude=" in out  # its tool's own option, not another tool's
    for module in (precision, report):
        monkeypatch.setattr(module, "PRUNE_LIMIT", 4)
    code, out, err = run_cli(*common, "-o", tmp_path / "short")
    kept = (tmp_path / "short" / "nodes.txt").read_text().splitlines()
    [said] = re.findall(r"pruned the last added first \(a long list in groups first, halving down to single nodes\), within 4 runs: (\d+) of them were never "
                        r"left out on their own, so a shorter list may meet it too", out)
    assert code == 1 and 0 < int(said) <= len(kept), out  # the nodes never tried without are still kept
    assert "each of them is needed" not in out


def test_a_q_dq_rebuild_without_the_kept_nodes_is_said_to_be_unverified(tmp_path):
    """quantize_static(nodes_to_exclude=[node]) leaves the node reading a Q/DQ pair its quantized writer keeps, where
    the repaired candidate reads the value unrounded: the rebuild is not what bisect verified, and the options
    say so (the trained Magika's 26 nodes left out this way: top-1 79% on 24 files, the repaired candidate 100%).
    A tool that leaves a node's own quantization out whole (quantize_dynamic) gets no such caveat."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from accudiff.report.repair_text import QDQ_REBUILD_CAVEAT, remake_lines

    rng = np.random.default_rng(3)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="project"), helper.make_node("Mul", ["h", "h"], ["s"], name="square"),
                               helper.make_node("Tanh", ["s"], ["y"], name="squash")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
                              [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "model.onnx"))

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(tmp_path / "model.onnx"), str(tmp_path / "rebuilt.onnx"), Feeds(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Mul", "Tanh"], nodes_to_exclude=["squash"])
    rebuilt = onnx.load(str(tmp_path / "rebuilt.onnx")).graph
    writer = {out: node for node in rebuilt.node for out in node.output}
    [squash] = [node for node in rebuilt.node if node.name == "squash"]
    assert writer[squash.input[0]].op_type == "DequantizeLinear"  # left out, it still reads its input rounded
    assert remake_lines(["squash"], "int8", {}, set())[-1] == QDQ_REBUILD_CAVEAT
    assert QDQ_REBUILD_CAVEAT not in remake_lines(["project"], "int8", {"project": "quantize_dynamic"}, set())


def test_a_long_repair_is_read_from_the_files_bisect_writes(tmp_path):
    """Past a screen of nodes (160 on the ModelOpt INT8 recognizer, each spelled twice on one line), the options
    read the nodes from the files bisect precision writes: pasted into a shell, ModelOpt's part expands to the
    patterns; evaluated, the Python part is the names; the GenAI builder's comma list too."""
    import shlex

    from accudiff.model.quantized_ops import GENAI_BUILDER, modelopt_pattern
    from accudiff.report.repair_text import remake_lines

    names = [f"p2o.Conv.{k}" for k in range(12)]
    patterns, listing = tmp_path / "keep_fp32.txt", tmp_path / "nodes.txt"
    patterns.write_text("".join(f"{modelopt_pattern(n)}\n" for n in names))
    listing.write_text("".join(f"{n}\n" for n in names))
    [line, caveat] = remake_lines(names, "int8", {}, set(), listed=(patterns, listing))
    assert "p2o.Conv.11" not in line and caveat.startswith("(a rebuild is not what was verified"), line
    shell = re.search(r"--nodes_to_exclude (\$\(cat [^)]*\))", line).group(1)
    assert subprocess.run(["bash", "-c", f"printf '%s\\n' {shell}"], capture_output=True, text=True, check=True).stdout.split() == [modelopt_pattern(n) for n in names]
    python_list = re.search(r"quantize_static\(\.\.\., nodes_to_exclude=(.*)\)$", line).group(1)
    assert eval(python_list) == names
    [builder] = remake_lines(names, "int4", dict.fromkeys(names, GENAI_BUILDER), set(), listed=(patterns, listing))
    option = re.search(r"--extra_options (nodes_to_exclude=\$\([^)]*\))", builder).group(1)
    assert subprocess.run(["bash", "-c", f"printf %s {option}"], capture_output=True, text=True, check=True).stdout == "nodes_to_exclude=" + ",".join(names)
    assert shlex.quote(str(listing)) in builder
