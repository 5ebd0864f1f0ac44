"""Weights in data files stay there: loading reads none of them, transforms read them a block at a time,
a model saved elsewhere copies them in, a model saved beside them refers to them, and one sample's
sessions are made one at a time (so one backend's copy of the weights is in memory at once). The same
paths the 3 GiB model of benchmarks/big_weights.py takes, at a small scale."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import accudiff
from accudiff.execution.engine import Engine
from accudiff.execution.plans import EngineOptions, Measured, PassPlan, ReferencePlan
from accudiff.judging.tolerances import Tolerances
from accudiff.errors import AccudiffError
from accudiff.model import weights as weights_module
from accudiff.model.inputs import generate_feeds
from accudiff.model.loading import load_graph, load_model
from accudiff.model.saving import save_model
from accudiff.model.shapes import SMALL_INITIALIZER_BYTES
from accudiff.model.subgraph import extract
from accudiff.model.weights import is_external, weight_values
from accudiff.runners import CpuOptions, candidate_runner, reference_runner
from accudiff.runners.onnxrt import OnnxrtRunner
from conftest import fixture


def _mlp() -> onnx.ModelProto:
    """Two 64x64 MatMuls (16 KB each, past what loading reads in) with a small bias between them."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), f"w{k}") for k in range(2)]
    bias = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "bias")
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"], name="matmul0"),
        helper.make_node("Add", ["m0", "bias"], ["a0"], name="add"),
        helper.make_node("Tanh", ["a0"], ["t0"], name="tanh"),
        helper.make_node("MatMul", ["t0", "w1"], ["y"], name="matmul1"),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [*weights, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _external(folder: Path, one_file: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(_mlp(), str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=one_file, location="weights.bin", size_threshold=0)
    return folder / "model.onnx"


def test_loading_reads_no_large_weight(tmp_path):
    """Only weights small enough for shape arithmetic are read in; the others stay references to their
    files, and their values read from there are the weights."""
    path = _external(tmp_path / "a folder with spaces", one_file=False)
    info = load_model(path)
    whole = {init.name: onnx.numpy_helper.to_array(init) for init in _mlp().graph.initializer}
    large = [init for init in info.proto.graph.initializer if init.raw_data == b"" and is_external(init)]
    assert large and all(init.name in whole for init in large)
    for init in info.proto.graph.initializer:
        assert is_external(init) == (whole[init.name].nbytes > SMALL_INITIALIZER_BYTES)
        np.testing.assert_array_equal(weight_values(init), whole[init.name])


def test_a_weight_past_the_end_of_its_file_is_one_sentence(tmp_path):
    path = _external(tmp_path)
    data = tmp_path / "weights.bin"
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(AccudiffError, match="external data"):
        load_model(path)


def test_weights_are_read_a_block_at_a_time(tmp_path, monkeypatch):
    """A weight is converted from blocks of its file; the result is the whole weight's conversion."""
    monkeypatch.setattr(weights_module, "BLOCK_BYTES", 64)
    path = _external(tmp_path)
    info = load_model(path)
    from accudiff.transforms.fp16 import to_fp16

    converted = to_fp16(info.proto).model
    expected = to_fp16(_mlp()).model
    got = {init.name: onnx.numpy_helper.to_array(init) for init in converted.graph.initializer if not is_external(init)}
    for init in expected.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT16:
            np.testing.assert_array_equal(got[init.name], onnx.numpy_helper.to_array(init))


def test_a_model_saved_elsewhere_copies_its_weights_in_and_one_saved_beside_them_refers_to_them(tmp_path):
    """An extracted subgraph saved in another folder holds its weights in its own data file (the source
    folder may go away); the candidate saved with its weights moved, and a second model saved beside it,
    share one data file."""
    path = _external(tmp_path / "source")
    info = load_model(path)
    nodes = [0, 1]
    sub = extract(info.proto, nodes)
    (tmp_path / "out").mkdir()
    save_model(sub, tmp_path / "out" / "sub.onnx")
    for file in (tmp_path / "source").iterdir():
        file.unlink()
    onnx.checker.check_model(str(tmp_path / "out" / "sub.onnx"))
    loaded = load_model(tmp_path / "out" / "sub.onnx")
    assert {e.value for init in loaded.proto.graph.initializer for e in init.external_data if e.key == "location"} <= {"sub.onnx.data"}

    info = load_model(_external(tmp_path / "again"))
    (tmp_path / "models").mkdir()
    save_model(info.proto, tmp_path / "models" / "first.onnx", move_weights=True)
    save_model(info.proto, tmp_path / "models" / "second.onnx")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["first.onnx", "first.onnx.data", "second.onnx"]
    [spec] = info.inputs
    feed = {spec.name: np.random.default_rng(0).standard_normal(spec.shape).astype(np.float32)}
    outputs = []
    for name in ("first.onnx", "second.onnx"):
        with OnnxrtRunner(tmp_path / "models" / name, info.output_names) as runner:
            outputs.append(dict(runner.infer(feed)))
    np.testing.assert_array_equal(*[o[info.output_names[0]] for o in outputs])


def test_a_compare_of_a_model_with_data_files_is_that_of_the_model_held_whole(tmp_path):
    """Same table, whether the weights were in the model or in data files (several, in a folder with a
    space in its name); the candidate in the report carries its weights."""
    onnx.save(_mlp(), str(tmp_path / "whole.onnx"))
    whole = accudiff.compare(tmp_path / "whole.onnx", "fp16", candidate="onnxrt", report_dir=tmp_path / "whole")
    path = _external(tmp_path / "a folder with spaces", one_file=False)
    external = accudiff.compare(path, "fp16", candidate="onnxrt", report_dir=tmp_path / "external")
    columns = ["max_abs_err", "tol_ratio", "isolated_tol_ratio"]
    assert whole.table[columns].equals(external.table[columns])
    [candidate] = external.candidate_models
    onnx.checker.check_model(str(external.report_dir / candidate))


def test_one_samples_sessions_are_made_one_at_a_time(tmp_path, monkeypatch):
    """With one sample there is nothing to reuse: each pass's session is made for its run and let go of
    before the next is made, so the reference's and the candidates' weights are not in memory together
    (past AHEAD_UP_TO_BYTES; below it, the next session is made while one runs: the same statistics)."""
    import accudiff.execution.engine
    info = load_model(fixture("layernorm_overflow"))
    [feed] = generate_feeds(info.inputs, {spec.name: spec.shape for spec in info.inputs}, seed=0)
    candidate = tmp_path / "candidate.onnx"
    from accudiff.transforms.fp16 import to_fp16

    save_model(to_fp16(info.proto).model, candidate)
    events: list[str] = []

    def watched(make, label):
        def factory(path, outputs):
            runner = make(path, outputs)
            activate, deactivate = runner.activate, runner.deactivate
            runner.activate = lambda: (events.append(f"+{label}"), activate())[1]
            runner.deactivate = lambda: (events.append(f"-{label}"), deactivate())[1]
            return runner

        return factory

    tensors = [t.name for t in info.tensors]
    measured = Measured(tensors, info.output_names, [[n.name for n in info.proto.graph.node]], Tolerances.build("fp16"), {})
    statistics = []
    for keep, ahead_up_to, expected in (
        (False, 0, ["+reference", "-reference", "+candidate", "-candidate"]),
        (True, 0, ["+reference", "+candidate"]),
        (False, 1 << 30, None),  # made ahead: when it starts against the reference's end is the threads' affair
    ):
        monkeypatch.setattr(accudiff.execution.engine, "AHEAD_UP_TO_BYTES", ahead_up_to)
        events.clear()
        passes = [PassPlan("candidate", candidate, watched(lambda p, o: candidate_runner("onnxrt", p, o, "fp16"), "candidate"))]
        engine = Engine(ReferencePlan(fixture("layernorm_overflow"), watched(reference_runner, "reference")), passes, measured, tmp_path / f"{keep}{ahead_up_to}", EngineOptions(keep_sessions=keep))
        engine.run_sample(0, feed)
        engine.close()
        assert (events[: len(expected)] == expected) if expected else (sorted(events[:4]) == ["+candidate", "+reference", "-candidate", "-reference"]), events
        statistics.append(engine.results["candidate"].stats.values)
        assert statistics[-1].shape[0] == len(tensors)
    np.testing.assert_array_equal(statistics[0], statistics[2])


def test_passes_running_one_file_read_it_once(tmp_path, monkeypatch):
    """Verification runs one switchboard file as several passes (its switches set per pass), in job after
    job: the worker reads the file once, not once per pass nor once per job, and every pass measures what it
    would alone."""
    import accudiff.execution.engine
    import accudiff.execution.remembered
    from accudiff.transforms.fp16 import to_fp16

    info = load_model(fixture("layernorm_overflow"))
    [feed] = generate_feeds(info.inputs, {spec.name: spec.shape for spec in info.inputs}, seed=0)
    candidate = tmp_path / "candidate.onnx"
    save_model(to_fp16(info.proto).model, candidate)
    reads = []
    monkeypatch.setattr(accudiff.execution.remembered, "_WHOLE", {})  # not what earlier tests in this process ran
    monkeypatch.setattr(accudiff.execution.engine, "load_graph", lambda path: (reads.append(path), load_graph(path))[1])
    tensors = [t.name for t in info.tensors]
    measured = Measured(tensors, info.output_names, [[n.name for n in info.proto.graph.node]], Tolerances.build("fp16"), {})
    passes = [PassPlan(f"pass{k}", candidate, lambda p, o: candidate_runner("onnxrt", p, o, "fp16")) for k in range(3)]
    for keep in (False, True):
        reads.clear()
        engine = Engine(ReferencePlan(fixture("layernorm_overflow"), reference_runner), passes, measured, tmp_path / str(keep), EngineOptions(keep_sessions=keep))
        engine.run_sample(0, feed)
        engine.close()
        assert reads == ([] if keep else [fixture("layernorm_overflow"), candidate])  # the second engine: a later job
        for k in (1, 2):
            np.testing.assert_array_equal(engine.results[f"pass{k}"].stats.values, engine.results["pass0"].stats.values)


def test_a_few_samples_session_skips_prepacking_large_weights(tmp_path, monkeypatch):
    """Prepacking copies every MatMul/Gemm weight when a session is made: skipped for large weights unless
    the run compares many samples whose MatMuls take many rows. A decoder's 4 prompts of 32 decode steps are
    132 runs, but 4 wide ones (the prefills): its 1.1B FP32 reference was packed (13 s) for steps it did not
    speed (0.164 s packed, 0.174 s not)."""
    from accudiff.runners import onnxrt

    path = _external(tmp_path)
    many = onnxrt.PREPACK_FROM_SAMPLES
    for limit, samples, wide, skipped in ((1 << 30, 1, None, "0"), (16, 1, None, "1"), (16, many, None, "0"), (16, 33 * 4, 4, "1"), (16, 33 * many, many, "0")):
        monkeypatch.setattr(onnxrt, "PREPACK_UP_TO_BYTES", limit)
        with OnnxrtRunner(path, ["y"], cpu=CpuOptions(samples=samples, wide_runs=wide)) as runner:
            entry = runner._session.get_session_options().get_session_config_entry
            assert (entry("session.disable_prepacking") if _has_entry(entry) else "0") == skipped


def _has_entry(entry) -> bool:
    try:
        entry("session.disable_prepacking")
        return True
    except Exception:  # ONNX Runtime raises when the entry was never set
        return False


def test_load_graph_marks_where_the_weights_are(tmp_path):
    path = _external(tmp_path / "x")
    proto = load_graph(path)
    assert all(weight_values(init).size for init in proto.graph.initializer)


def test_a_model_saved_again_over_its_own_path_keeps_the_weights_it_refers_to(tmp_path):
    """Saving a model at the path whose side file holds some of its weights, with new weights to write,
    writes them to another file instead of truncating the one it refers to."""
    from onnx import numpy_helper

    info = load_model(_external(tmp_path / "source"))
    (tmp_path / "models").mkdir()
    path = tmp_path / "models" / "model.onnx"
    save_model(info.proto, path, move_weights=True)
    extra = np.arange(2048, dtype=np.float32)
    info.proto.graph.initializer.append(numpy_helper.from_array(extra, "extra"))
    save_model(info.proto, path)
    saved = load_graph(path)
    values = {init.name: weight_values(init) for init in saved.graph.initializer}
    np.testing.assert_array_equal(values["extra"], extra)
    np.testing.assert_array_equal(values["w0"], numpy_helper.to_array(_mlp().graph.initializer[0]))


def test_weights_inside_a_model_file_are_referenced_where_they_lie(tmp_path):
    """A model holding its weights is read for a worker with its large weights referenced at their offsets in
    the file (no copy in the proto): a session from the graph alone computes what one from the file does,
    and the small weights stay in the proto."""
    from accudiff.model.wire import spans_in_file

    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(path))
    data = path.read_bytes()
    whole = onnx.load(str(path))
    spans = spans_in_file(data)
    assert {name: data[offset : offset + length] for name, (offset, length) in spans.items()} == {i.name: i.raw_data for i in whole.graph.initializer}
    proto = load_graph(path)
    assert [is_external(init) for init in proto.graph.initializer] == [True, True, False]  # the 256-byte bias stays
    [name] = [o.name for o in whole.graph.output]
    feed = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    with OnnxrtRunner(path, [name]) as runner:
        np.testing.assert_array_equal(runner.infer(feed)[name], _plain_run(whole, feed)[0])


def _plain_run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def test_a_scratch_model_refers_to_the_users_data_file_where_it_is_without_linking_or_copying_it(tmp_path):
    """Verification saves the reference's weights beside its variants once: `in_place`, a data file
    elsewhere (the user's) is referred to where it is, neither copied nor hard-linked (ONNX's loader refuses
    a data file with several hard links: the user's own onnx.load of the model failed while accudiff ran,
    and for good after a run that was killed). A variant saved beside it, holding a weight of its own, refers
    to both folders and runs as the original does."""
    path = _external(tmp_path / "source")
    proto = load_graph(path)
    (tmp_path / "trials").mkdir()
    target = tmp_path / "trials" / "reference-weights.onnx"
    save_model(proto, target, move_weights=True, side_file=True, in_place=True)
    assert sorted(p.name for p in target.parent.iterdir()) == ["reference-weights.onnx"]
    assert (path.parent / "weights.bin").stat().st_nlink == 1
    onnx.load(str(path))  # the user's model still loads with ONNX's own loader
    variant = load_graph(target)
    [w1] = [init for init in variant.graph.initializer if init.name == "w1"]
    w1.CopyFrom(onnx.numpy_helper.from_array(weight_values(w1), "w1"))  # made in memory, as a kept node's FP32 weight is
    save_model(variant, tmp_path / "trials" / "variant.onnx", in_place=True)
    assert sorted(p.name for p in target.parent.iterdir()) == ["reference-weights.onnx", "variant.onnx", "variant.onnx.data"]
    name = _mlp().graph.output[0].name
    feed = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    for saved in (target, tmp_path / "trials" / "variant.onnx"):
        with OnnxrtRunner(saved, [name]) as runner:
            np.testing.assert_array_equal(runner.infer(feed)[name], _plain_run(_mlp(), feed)[0])


def test_a_model_written_whole_shares_its_weights_with_one_saved_beside_it(tmp_path):
    """The candidate is written whole (no side file below 256 MB); its isolated twin beside it must refer to
    the candidate file's weights, not write them again (MiniLM's MatMulNBits candidate: 51 MB written twice,
    0.25 s of its transform)."""
    proto = _mlp()
    save_model(proto, tmp_path / "candidate.onnx", move_weights=True)
    assert [is_external(init) for init in proto.graph.initializer] == [True, True, False]
    save_model(proto, tmp_path / "isolated.onnx")
    assert (tmp_path / "isolated.onnx").stat().st_size < 2048 and sorted(p.name for p in tmp_path.iterdir()) == ["candidate.onnx", "isolated.onnx"]
    name = proto.graph.output[0].name
    feed = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    with OnnxrtRunner(tmp_path / "isolated.onnx", [name]) as runner:
        np.testing.assert_array_equal(runner.infer(feed)[name], _plain_run(_mlp(), feed)[0])


def test_the_worker_reads_the_reference_as_a_graph_referring_to_its_file(tmp_path):
    """The FP32 model a worker reads is its graph as loaded (types inferred), referring to the weights in
    the model file at their offsets: the worker parses a graph, not the weights again, and the user's file
    is neither copied nor linked."""
    from accudiff.stages.group import worker_reference
    from accudiff.model.loading import remember_model

    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(path))
    info = load_model(path)
    remember_model(info)
    (tmp_path / "scratch").mkdir()
    reference = worker_reference(info, tmp_path / "scratch")
    assert reference.name == path.name and reference.stat().st_size < 2048
    assert [p for p in reference.parent.iterdir()] == [reference] and path.stat().st_nlink == 1
    assert len(load_graph(reference).graph.value_info) == len(info.proto.graph.value_info) > 0
    name = info.output_names[0]
    feed = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    with OnnxrtRunner(reference, [name]) as runner:
        np.testing.assert_array_equal(runner.infer(feed)[name], _plain_run(_mlp(), feed)[0])


def test_a_model_a_user_takes_away_is_one_file(tmp_path):
    """A repaired model refers to weights in scratch data files and in the user's files: saved for the user,
    it holds them itself (the report said 'repaired model: repaired-candidate.onnx', and that file alone
    was missing its 20 MB side file)."""
    path = tmp_path / "source" / "mlp.onnx"
    path.parent.mkdir()
    onnx.save(_mlp(), str(path))
    proto = load_graph(path)  # its weights referenced in the file
    assert any(is_external(init) for init in proto.graph.initializer)
    (tmp_path / "report").mkdir()
    save_model(proto, tmp_path / "report" / "repaired.onnx", one_file=True)
    assert [p.name for p in (tmp_path / "report").iterdir()] == ["repaired.onnx"]
    again = onnx.load(str(tmp_path / "report" / "repaired.onnx"))
    assert again == _mlp() or [i.raw_data for i in again.graph.initializer] == [i.raw_data for i in _mlp().graph.initializer]


def test_a_model_saved_as_one_file_copies_its_weights_in_as_it_is_written(tmp_path):
    """Read in and serialized, a 21 MB repaired MiniLM grew the caller by 46 MB at the end of its run (the
    process tree's peak): its weights are now copied into the file from theirs a block at a time, and the
    file is the model protobuf would write."""
    import tracemalloc

    from onnx import numpy_helper

    model = _mlp()
    model.graph.initializer.append(numpy_helper.from_array(np.arange(4 << 20, dtype=np.float32), "large"))  # 16 MB, read by nothing
    onnx.save(model, str(tmp_path / "mlp.onnx"))
    proto = load_graph(tmp_path / "mlp.onnx")
    (tmp_path / "report").mkdir()
    tracemalloc.start()
    save_model(proto, tmp_path / "report" / "repaired.onnx", one_file=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < (16 << 20) * 3 / 4, peak  # a block of the copy (read in and serialized: twice the weight)
    assert onnx.load(str(tmp_path / "report" / "repaired.onnx")).SerializeToString() == model.SerializeToString()


def test_a_field_written_twice_is_found_where_protobuf_reads_it():
    """protobuf keeps the last value of a field written twice (messages concatenated are merged): the
    offset found for a weight's bytes must be that one, or a model would refer to bytes it does not hold."""
    from accudiff.model.wire import spans_in_file

    def length_delimited(number: int, payload: bytes) -> bytes:
        size, varint = len(payload), b""
        while True:
            varint += bytes([(size & 0x7F) | (0x80 if size > 0x7F else 0)])
            size >>= 7
            if not size:
                return bytes([number << 3 | 2]) + varint + payload

    first = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[2], raw_data=np.zeros(2, np.float32).tobytes())
    second = onnx.TensorProto(raw_data=np.ones(2, np.float32).tobytes())
    data = length_delimited(7, length_delimited(5, first.SerializeToString() + second.SerializeToString()))
    [weight] = onnx.ModelProto.FromString(data).graph.initializer
    offset, length = spans_in_file(data)["w"]
    assert data[offset : offset + length] == weight.raw_data == second.raw_data


def test_where_no_folder_holds_every_data_file_the_runner_copies_them_into_one(tmp_path, monkeypatch):
    """ONNX Runtime resolves a model's data files from one folder; where none holds them all (two drives),
    the runner copies them into one in its scratch folder, and the model runs the same."""
    import os

    def two_drives(paths):
        raise ValueError("Paths don't have the same drive")

    path = _external(tmp_path / "source")
    proto = load_graph(path)
    (tmp_path / "trials").mkdir()
    target = tmp_path / "trials" / "reference-weights.onnx"
    save_model(proto, target, move_weights=True, side_file=True, in_place=True)
    monkeypatch.setattr(os.path, "commonpath", two_drives)
    name = _mlp().graph.output[0].name
    feed = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    with OnnxrtRunner(target, [name]) as runner:
        np.testing.assert_array_equal(runner.infer(feed)[name], _plain_run(_mlp(), feed)[0])


def test_a_model_read_without_its_weights_bytes_is_the_model_but_them():
    """wire.without_raw_data drops the raw bytes of the main graph's weights past a size, and only them: the
    rest of the model (the small bias's bytes, names, shapes, the nodes, a field written twice) parses as it was."""
    from accudiff.model.wire import spans_in_file, without_raw_data

    model = _mlp()
    model.graph.doc_string = "kept"
    data = model.SerializeToString() + onnx.ModelProto(producer_name="written twice: the last counts").SerializeToString()
    expected = onnx.ModelProto.FromString(data)
    for init in expected.graph.initializer:
        if len(init.raw_data) > 1024:
            init.ClearField("raw_data")
    assert onnx.ModelProto.FromString(without_raw_data(data, 1024)) == expected
    assert [name for name, (_, length) in spans_in_file(data).items() if length > 1024] == [i.name for i in model.graph.initializer if len(i.raw_data) > 1024]


@pytest.mark.parametrize("op_type", ["Gather", "MatMul", "ConvTranspose"])
def test_a_weights_per_tensor_loss_is_found_reading_it_a_block_at_a_time(tmp_path, monkeypatch, op_type):
    """An embedding table read whole to look for channels its one scale zeroes was 47 MB of MiniLM's caller at
    its peak: read in blocks of whole slices, each channel's largest value (along whichever axis) is the
    one the weight read whole gives, and so is what is said."""
    from onnx import numpy_helper

    from accudiff.model import quantized_weights

    rng = np.random.default_rng(5)
    values = rng.standard_normal((40, 6, 3)).astype(np.float32)
    values[7] *= 1e-4  # channel 7 along axis 0, ...
    values[:, 2] *= 1e-4  # ... 2 along axis 1 ...
    values[..., 1] *= 1e-4  # ... and 1 along the last
    model = onnx.helper.make_model(onnx.helper.make_graph([], "w", [], [], [numpy_helper.from_array(values, "table")]))
    onnx.save(model, str(tmp_path / "w.onnx"), save_as_external_data=True, location="w.bin", size_threshold=0)
    [weight] = load_graph(tmp_path / "w.onnx").graph.initializer
    assert is_external(weight)
    monkeypatch.setattr(quantized_weights, "CHANNEL_BLOCK_BYTES", 6 * 3 * 4 * 3)  # three slices a block
    said = quantized_weights.per_tensor_loss(weight, op_type, 0.05, "INT8", "table")
    assert said is not None and said == quantized_weights.per_tensor_loss(values, op_type, 0.05, "INT8", "table")
