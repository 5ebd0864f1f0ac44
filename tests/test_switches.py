"""The switchboard computes what the variant it stands for computes: for each keep-list, its graph outputs
with those switches on are the outputs of the FP16 candidate converted with those nodes kept in FP32, or of
a candidate made by another tool with those nodes kept by keep_float.py (both run as the ONNX Runtime
candidate runs them)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from accudiff.model.formats import file_formats, precision_label
from accudiff.execution.probes import largest_values
from accudiff.model.inputs import generate_feeds
from accudiff.model.samples import samples_from_feeds
from accudiff.model.loading import load_model
from accudiff.model.saving import save_model
from accudiff.runners.onnxrt import OnnxrtRunner
from accudiff.transforms.candidate import CandidateRecipe, CandidateVariants, transform_model
from accudiff.transforms.opset import at_forms_opset
from conftest import ROOT, fixture, skip_without

sys.path.insert(0, str(ROOT))
from benchmarks import models, realistic_inputs  # noqa: E402


def _outputs(model, path: Path, names, feed) -> dict[str, np.ndarray]:
    save_model(model, path)
    with OnnxrtRunner(path, names, emulate_fp16=True) as runner:
        return dict(runner.infer(feed))


def _assert_switchboard_matches_variants(model_path: Path, feed, keep_lists, tmp_path: Path, candidate: Path | None = None, precision: str = "fp16",
                                         gated: bool = False) -> None:
    info = load_model(model_path)
    recipe = CandidateRecipe(precision) if candidate is None else CandidateRecipe(precision_label(file_formats(candidate)), candidate_model=candidate)
    variants = CandidateVariants(info, recipe, transform_model(info, recipe, samples_from_feeds([feed], tmp_path / "samples.npz"), largest_values))
    board = variants.switchboard({n for keep in keep_lists for n in keep}, gated=gated)
    if gated:  # every kept copy moved into its switch's If
        assert {n.op_type for n in board.model.graph.node if n.name.endswith("__gate")} == {"If"}
        assert not any(n.name.endswith("__kept") for n in board.model.graph.node)
    assert board is not None
    outputs = info.output_names
    save_model(board.model, tmp_path / "board.onnx")
    with OnnxrtRunner(tmp_path / "board.onnx", outputs, emulate_fp16=True) as runner:
        for k, keep in enumerate(keep_lists):
            switched = runner.infer({**feed, **{s: np.asarray(on) for s, on in board.settings(keep).items()}})
            expected = _outputs(variants.with_kept(keep).model, tmp_path / f"variant{k}.onnx", outputs, feed)
            for name in outputs:
                np.testing.assert_array_equal(switched[name], expected[name], err_msg=f"keep {keep}, output {name}")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["two_faults_one_path", "absorbed_then_overflow", "layernorm_overflow", "multi_io", "cancelling_layernorm"])
def test_every_single_keep_all_keeps_and_adjacent_pairs_on_the_fixtures(name, precision, tmp_path):
    info = load_model(fixture(name))
    [feed] = generate_feeds(info.inputs, {spec.name: spec.shape for spec in info.inputs}, seed=0)
    converted = sorted(transform_model(info, CandidateRecipe(precision), samples_from_feeds([feed], tmp_path / "samples.npz"), largest_values).converted)
    nodes = [n.name for n in info.proto.graph.node if n.name in converted]
    keep_lists = [[], nodes, *([n] for n in nodes), *(list(pair) for pair in zip(nodes, nodes[1:]))]
    _assert_switchboard_matches_variants(fixture(name), feed, keep_lists, tmp_path, precision=precision)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_trained_recognizer_on_a_drawn_text_line(precision, tmp_path):
    """In BF16 the opset-12 recognizer is compared at opset 22 (its Conv has no BF16 form before), where the
    converter rewrote its Softmax-11s: the switchboard of its last nodes once broadcast a flattened softmax
    against the model's own."""
    try:
        path = models.ppocr_rec_v4()
        feed = realistic_inputs.FEEDS["ppocr_rec_v4"](0)
    except ModuleNotFoundError as missing:
        skip_without(missing)
    info, notices = at_forms_opset(load_model(path), precision, tmp_path)
    assert bool(notices) == (precision == "bf16")
    path = info.path
    nodes = [n.name for n in info.proto.graph.node]
    chain = [n for n in nodes if n.startswith(("p2o.Conv.", "p2o.HardSigmoid.", "p2o.Mul."))][:6]
    last = nodes[-3:]  # the nodes feeding the graph output
    middle = nodes[len(nodes) // 2 : len(nodes) // 2 + 4]
    _assert_switchboard_matches_variants(path, feed, [[], chain, last, middle, chain + last, [chain[0], last[-1]]], tmp_path, precision=precision)


def test_candidates_made_by_onnxruntimes_quantizer(tmp_path):
    """INT8 and FP8 Q/DQ candidates of the outlier fixture (a graph output quantized too: keeping its node
    undoes that pair) and of the trained direction classifier."""
    rng = np.random.default_rng(3)
    calibration = [{"x": rng.uniform(0, 1, (1, 8, 6, 6)).astype(np.float32)} for _ in range(4)]
    feed = {"x": rng.uniform(0, 1, (1, 8, 6, 6)).astype(np.float32)}
    for grid in ("int8", "fp8"):
        candidate = models.onnxruntime_qdq(fixture("int8_outlier_channel"), calibration, tmp_path / f"outlier-{grid}.onnx", grid)
        keep_lists = [[], ["conv"], ["relu"], ["channel_gain", "conv"], ["channel_gain", "conv", "relu"]]
        _assert_switchboard_matches_variants(fixture("int8_outlier_channel"), feed, keep_lists, tmp_path, candidate)
    try:
        classifier = models.ppocr_cls_v2()
    except ModuleNotFoundError as missing:
        skip_without(missing)
    candidate = models.onnxruntime_qdq(classifier, realistic_inputs.dataset("ppocr_cls_v2", 4, 100), tmp_path / "cls-int8.onnx")
    nodes = [n.name for n in load_model(classifier).proto.graph.node if n.op_type in ("Conv", "BatchNormalization", "HardSigmoid", "Mul", "Add")]
    _assert_switchboard_matches_variants(classifier, realistic_inputs.ppocr_cls(0), [[], nodes[:4], nodes[10:13], nodes[:4] + nodes[-3:]], tmp_path, candidate)


def test_a_candidate_whose_relus_and_clips_onnxruntimes_quantizer_folded_into_its_pairs(tmp_path):
    """quantize_static with its defaults (asymmetric activations) removes the trained direction classifier's
    15 Relus and 18 Clips and lets the Q/DQ pairs after them clip instead. A kept node read past such a pair,
    and so computed without the Relu: with every node kept, the classifier's output was NaN. Now it applies
    the activation again, on the switchboard as in the variants; with every node kept, the candidate computes
    what the float model computes, as plain ONNX Runtime runs it. (Not on the board with every node kept: there
    its Ifs keep ONNX Runtime from fusing a kept Conv with its kept BatchNormalization, 2e-9 apart.)"""
    import onnxruntime as ort

    try:
        classifier, quantized = models.ppocr_cls_v2(), models.ppocr_cls_v2_qdq_int8(tmp_path)
    except ModuleNotFoundError as missing:
        skip_without(missing)
    folded = {n.op_type for n in load_model(quantized).proto.graph.node} & {"Relu", "Clip"}
    assert not folded, folded  # (the quantizer's doing, which this test is about)
    feed = realistic_inputs.ppocr_cls(0)
    nodes = [n.name for n in load_model(classifier).proto.graph.node if n.op_type not in ("Constant", "Relu", "Clip")]
    _assert_switchboard_matches_variants(classifier, feed, [[], nodes[:8], nodes[20:30], nodes[-12:]], tmp_path, quantized)
    info = load_model(classifier)
    recipe = CandidateRecipe("int8", candidate_model=quantized)
    variants = CandidateVariants(info, recipe, transform_model(info, recipe, samples_from_feeds([feed], tmp_path / "all.npz"), largest_values))
    everything = _outputs(variants.with_kept(nodes).model, tmp_path / "everything-kept.onnx", info.output_names, feed)
    [float_model] = ort.InferenceSession(str(classifier), providers=["CPUExecutionProvider"]).run(info.output_names, feed)
    np.testing.assert_allclose(everything[info.output_names[0]], float_model, rtol=1e-5, atol=1e-6)
    # Given alone, compared with its float form (where a Clip stands for each such pair): every node kept is that form.
    import accudiff
    from accudiff.model.inputs import save_feeds

    save_feeds([feed], tmp_path / "line.npz")
    alone = accudiff.compare(quantized, inputs=tmp_path / "line.npz", keep_fp32=[".*"], verify=False)
    assert alone.passed and (alone.outputs["max_abs_err"] <= 1e-6).all(), alone.outputs


def test_a_candidate_modelopt_made_of_the_trained_recognizer(tmp_path):
    """ModelOpt's FP8 recognizer, which also casts the rest to FP16: switched nodes read FP32 from before
    their Q/DQ pairs and their Casts, and hand their readers their result in FP16."""
    try:
        calibration = np.concatenate([realistic_inputs.ppocr_rec(seed)["x"] for seed in range(100, 108)])
        candidate = models.modelopt_quantized(models.ppocr_rec_v4(), calibration, tmp_path / "rec-fp8.onnx", "fp8")
    except ModuleNotFoundError as missing:
        skip_without(missing)
    nodes = [n.name for n in load_model(candidate).proto.graph.node if n.op_type in ("Conv", "MatMul", "Mul", "Add")]
    keep_lists = [[], nodes[:3], nodes[40:46], nodes[-4:], nodes[:3] + nodes[-4:]]
    _assert_switchboard_matches_variants(models.ppocr_rec_v4(), realistic_inputs.ppocr_rec(0), keep_lists, tmp_path, candidate)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["two_faults_one_path", "multi_io", "cancelling_layernorm"])
def test_a_gated_switchboard_computes_what_its_variants_do(name, precision, tmp_path):
    """The gated board (each kept copy in an If on its switch: computed only when on) gives every variant's
    outputs, bit for bit, as the board that computes both sides and chooses between them does."""
    info = load_model(fixture(name))
    [feed] = generate_feeds(info.inputs, {spec.name: spec.shape for spec in info.inputs}, seed=0)
    converted = sorted(transform_model(info, CandidateRecipe(precision), samples_from_feeds([feed], tmp_path / "samples.npz"), largest_values).converted)
    nodes = [n.name for n in info.proto.graph.node if n.name in converted]
    keep_lists = [[], nodes, *([n] for n in nodes), *(list(pair) for pair in zip(nodes, nodes[1:]))]
    _assert_switchboard_matches_variants(fixture(name), feed, keep_lists, tmp_path, precision=precision, gated=True)


def test_a_gated_switchboard_of_a_decoder_quantized_to_int4_computes_its_variants(tmp_path):
    """A MatMulNBits decoder candidate (the GenAI builder's form, kept by its float op on the reference's
    weights): the gated board's keep-lists give the variants' outputs."""
    from test_decoders import _simplified_layernorm_model

    model = _simplified_layernorm_model(tmp_path / "m.onnx")
    candidate = models.onnxruntime_nbits(model, tmp_path / "int4.onnx", accuracy_level=4)
    feed = {"x": np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32)}
    _assert_switchboard_matches_variants(model, feed, [[], ["proj"]], tmp_path, candidate=candidate, gated=True)


def test_a_job_that_tries_nothing_on_the_switchboard_lets_go_of_its_session_only_when_told(tmp_path):
    """A switchboard's session stays open in its worker for the next round, except before a round that tries
    nothing on it (verification's last: a cause's parts), whose variants' sessions it would sit beside
    (MiniLM quantize_dynamic: 268 -> 246 MB at the peak)."""
    from accudiff.execution import worker
    from accudiff.execution.messages import Job, PassSpec
    from accudiff.judging.tolerances import Tolerances

    info = load_model(fixture("clean"))
    samples = samples_from_feeds(generate_feeds(info.inputs, {s.name: s.shape for s in info.inputs}, seed=0), tmp_path / "inputs.npz", info.inputs)

    def job(name: str, reuse: bool, release: bool = False) -> Job:
        return Job(reference=str(info.path), passes=[PassSpec("variant0", str(info.path), "onnxrt", reuse=reuse)], precision="fp32",
                   tensors=list(info.output_names), outputs=list(info.output_names), segments=[[n.name for n in info.proto.graph.node]],
                   tolerances=Tolerances.build("fp32").as_dict(), quant_ranges={}, samples=samples.as_json(), sample_indices=[0], result=str(tmp_path / name / "result"),
                   input_specs=[[s.name, str(s.dtype), list(s.shape)] for s in info.inputs], release_reused=release, points=0)

    try:
        worker._work(job("board", reuse=True), lambda event: None)
        worker._work(job("variant", reuse=False), lambda event: None)
        assert len(worker._REUSED._runners) == 1  # kept for the next round on the switchboard
        worker._work(job("last", reuse=False, release=True), lambda event: None)
        assert not worker._REUSED._runners
    finally:
        worker._REUSED.close()
