"""Models whose tensors exceed the memory budget: compared segment by segment, in bounded memory, with the
same table as a one-shot comparison (small sizes, so CI stays fast)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pandas as pd
import pytest

from accudiff.memory import with_huge_pages
from onnx import TensorProto, helper, numpy_helper

import accudiff
from accudiff.errors import AccudiffError
from accudiff.model.segments import memory_budget
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import models  # noqa: E402
from benchmarks.measure import largest_process_peak  # noqa: E402

MB = 1 << 20


def test_segmented_and_one_shot_comparisons_give_identical_tables(tmp_path):
    chain = models.elementwise_chain(tmp_path, 24, 250_000)  # 24 tensors of 1 MB
    one_shot = accudiff.compare(chain, "fp16", candidate="onnxrt", iterations=2)
    segmented = accudiff.compare(chain, "fp16", candidate="onnxrt", iterations=2, max_memory="16M")  # a few tensors per segment
    assert "isolated_sqnr_db" in one_shot.table.columns
    pd.testing.assert_frame_equal(one_shot.table, segmented.table)


def test_a_model_with_unnamed_nodes_is_cut_into_the_same_segments(tmp_path):
    """Found by the backend sweep (light_bvlc_alexnet): segments name their nodes, and the reference file's
    unnamed nodes must get the names the plan gave them."""
    import onnx

    chain = models.elementwise_chain(tmp_path, 12, 250_000)
    model = onnx.load(str(chain))
    for node in model.graph.node:
        node.name = ""
    onnx.save(model, str(tmp_path / "unnamed.onnx"))
    whole = accudiff.compare(tmp_path / "unnamed.onnx", "fp16", candidate="onnxrt")
    parts = accudiff.compare(tmp_path / "unnamed.onnx", "fp16", candidate="onnxrt", max_memory="16M")
    pd.testing.assert_frame_equal(whole.table, parts.table)


@pytest.mark.parametrize("keep_sessions", [True, False], ids=["sessions kept", "one sample: cut when needed"])
def test_segments_are_cut_in_memory_and_never_saved(tmp_path, keep_sessions):
    """A worker hands each pass's segments to ONNX Runtime as it cuts them: before, it saved every segment,
    and the runner read it back and saved it again (0.3-0.5 s of a compare of the PP-OCRv4 recognizer).
    With one sample, each segment is cut only when its runner is made."""
    from accudiff.execution.engine import Engine
    from accudiff.execution.plans import EngineOptions, Measured, PassPlan, ReferencePlan
    from accudiff.judging.tolerances import Tolerances
    from accudiff.model.inputs import generate_feeds
    from accudiff.model.loading import load_model
    from accudiff.runners import candidate_runner, reference_runner

    chain = models.elementwise_chain(tmp_path, 12, 250_000)
    info = load_model(chain)
    names = [node.name for node in info.proto.graph.node]
    tensors = [t.name for t in info.tensors]
    measured = Measured(tensors, info.output_names, [names[:4], names[4:8], names[8:]], Tolerances.build("fp32"), {})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    candidate = PassPlan("candidate", chain, lambda model, outputs: candidate_runner("onnxrt", model, outputs, "fp32"))
    engine = Engine(ReferencePlan(chain, reference_runner), [candidate], measured, scratch, EngineOptions(keep_sessions=keep_sessions))
    try:
        engine.run_sample(0, generate_feeds(info.inputs, {spec.name: spec.shape for spec in info.inputs}, seed=0)[0])
    finally:
        engine.close()
    assert not [p for p in scratch.rglob("*") if p.is_file()]
    assert sorted(engine.results["candidate"].seen) == list(range(len(tensors)))


def test_segments_follow_kept_nodes_and_quantization(tmp_path):
    """Nodes the transforms add (casts around a node kept in FP32, Q/DQ pairs) go with their readers."""
    chain, layers = models.elementwise_chain(tmp_path, 12, 250_000), _matmul_chain(tmp_path / "layers.onnx")
    for model, precision, options in ((chain, "fp16", {"keep_fp32": ["op3", "op7"]}), (layers, "int8", {})):
        whole = accudiff.compare(model, precision, candidate="onnxrt", **options)
        parts = accudiff.compare(model, precision, candidate="onnxrt", max_memory="16M", **options)
        pd.testing.assert_frame_equal(whole.table, parts.table)


def _matmul_chain(path, layers: int = 8, rows: int = 32768, width: int = 64):
    """MatMul + Relu layers on a [rows, width] tensor (8 MB each): INT8 quantizes the MatMuls' inputs."""
    rng = np.random.default_rng(0)
    nodes, weights, previous = [], [], "x"
    for k in range(layers):
        weights.append(numpy_helper.from_array((rng.standard_normal((width, width)) / 8).astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("MatMul", [previous, f"w{k}"], [f"m{k}"], name=f"matmul{k}"),
                  helper.make_node("Relu", [f"m{k}"], [f"r{k}" if k < layers - 1 else "y"], name=f"relu{k}")]
        previous = f"r{k}"
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, width]) for n in ("x", "y")]
    onnx.save(helper.make_model(helper.make_graph(nodes, "layers", io[:1], io[1:], weights), opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("length, elements", [(40, 2_000_000), (160, 500_000)], ids=["8 MB tensors", "2 MB tensors"])
def test_peak_memory_stays_within_the_budget(tmp_path, length, elements):
    """320 MB of tensors compared within a 32 MB budget: the worker's peak grows by about the budget
    over a comparison of the same chain with tiny tensors, far less than the tensors' size. Tensors of 8
    MB each have a mapping of their own, returned when dropped; those of 2 MB are served again from
    malloc's heap (memory.py), which must not hold more for it."""
    big = models.elementwise_chain(tmp_path, length, elements)
    tiny = models.elementwise_chain(tmp_path, length, 1_000)

    def peak(model, *extra) -> float:
        """The worker's peak (the largest process), as the kernel counts it: no sampling, nothing timed."""
        megabytes, code = largest_process_peak([sys.executable, "-m", "accudiff.cli", "compare", str(model), "--fp16", "--candidate", "onnxrt",
                                                "--report-dir", str(tmp_path / f"r{len(list(tmp_path.iterdir()))}"), *extra])
        assert code == 0
        return megabytes

    overhead = peak(tiny)
    bounded = peak(big, "--max-memory", "32M")
    one_shot = peak(big, "--max-memory", "4G")
    inputs = 2 * elements * 4 / MB  # the input, held by the caller and the worker
    assert bounded - overhead < 32 * 2 + inputs + 40, (overhead, bounded)
    assert one_shot - overhead > 320, (overhead, one_shot)  # without segments, every tensor is held


def test_large_tensors_share_one_arena_within_the_budget(tmp_path):
    """Tensors of 32 MB: the worker's sessions allocate from one shared arena (fresh memory is what their
    runs cost) and each tensor is reduced in parts on every core. The table is the one-shot comparison's,
    and the peak still grows by about the budget, not by the 384 MB of tensors."""
    big = models.elementwise_chain(tmp_path, 12, 8 << 20)
    tiny = models.elementwise_chain(tmp_path, 12, 1_000)
    one_shot = accudiff.compare(big, "fp16", candidate="onnxrt", max_memory="4G")
    segmented = accudiff.compare(big, "fp16", candidate="onnxrt", max_memory="96M")
    pd.testing.assert_frame_equal(one_shot.table, segmented.table)

    def peak(model, *extra) -> float:
        """The worker's peak (the largest process), as the kernel counts it: no sampling, nothing timed."""
        megabytes, code = largest_process_peak([sys.executable, "-m", "accudiff.cli", "compare", str(model), "--fp16", "--candidate", "onnxrt",
                                                "--report-dir", str(tmp_path / f"r{len(list(tmp_path.iterdir()))}"), *extra])
        assert code == 0
        return megabytes

    overhead, bounded = peak(tiny), peak(big, "--max-memory", "96M")
    assert bounded - overhead < 96 * 2 + 2 * 32 + 40, (overhead, bounded)


@pytest.mark.parametrize("given, expected", [("512M", 512 * MB), ("2G", 2048 * MB), ("1.5GB", int(1.5 * 1024 * MB)), (64 * MB, 64 * MB)])
def test_memory_budget_sizes(given, expected):
    assert memory_budget(given) == expected


@pytest.mark.parametrize("given, message", [("lots", "is not a size such as 512M or 2G"), ("1M", "below 16M")])
def test_memory_budget_refuses_what_cannot_work(given, message):
    with pytest.raises(AccudiffError, match=message):
        memory_budget(given)


def test_workers_ask_for_huge_pages_unless_the_user_chose():
    assert with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def test_a_large_weight_gives_its_consumer_its_true_size_not_its_own(tmp_path):
    """The planner sized a MatMul's output as its largest input (the weight) when shape inference did not
    know the weight's shape: a 3-layer MLP of 256 MB weights was cut into 3 segments, each saved with its
    weights again (26 s of a 47 s compare)."""
    from accudiff.model.loading import load_model
    from accudiff.model.segments import plan_segments, tensor_sizes

    width = 128  # a 64 KB weight: past the size whose values shape inference is given
    nodes, weights = [], []
    for layer in range(3):
        weights.append(numpy_helper.from_array(np.eye(width, dtype=np.float32), f"w{layer}"))
        nodes.append(helper.make_node("MatMul", ["x" if layer == 0 else f"h{layer - 1}", f"w{layer}"], [f"h{layer}"], name=f"m{layer}"))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info("h2", TensorProto.FLOAT, [1, width])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "mlp.onnx"))
    info = load_model(tmp_path / "mlp.onnx")
    sizes = tensor_sizes(info, {"x": (1, width)})
    assert [sizes[f"h{layer}"] for layer in range(3)] == [width * 4] * 3
    assert len(plan_segments(info, sizes, budget=16 << 10)) == 1


def test_a_large_weight_does_not_make_its_tensors_large(tmp_path):
    """A worker gets huge pages (and the worker started ahead is ended for a new one) when the tensors a run
    makes are large. MiniLM's 47 MB embedding table counted as its largest tensor: every compare threw its
    warm worker away and started another (0.4 s of a 2 s compare)."""
    from accudiff.stages.group import plan
    from accudiff.memory import HUGE_PAGES_FROM_TENSOR_BYTES
    from accudiff.model.loading import load_model

    rows = HUGE_PAGES_FROM_TENSOR_BYTES // (64 * 4) + 1
    table = numpy_helper.from_array(np.zeros((rows, 64), np.float32), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["e"], name="emb")], "embedding",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 8, 64])], [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "embedding.onnx"))
    planned = plan(load_model(tmp_path / "embedding.onnx"), {"ids": np.zeros((1, 8), np.int64)}, None, one_segment=False)
    assert planned.largest_tensor == 8 * 64 * 4


def test_handing_freed_memory_back_starts_no_process():
    """`return_freed_memory` reaches malloc_trim through what the process already loaded. Finding the C
    library by name started `ldconfig`: a fork of the whole process, which a measure of the process tree
    counted as a second copy of it (a MiniLM comparison's worker: 130 MB more at the peak)."""
    watch = ("import sys; started = []; "
             "sys.addaudithook(lambda event, args: started.append(event) if event in ('subprocess.Popen', 'os.fork', 'os.posix_spawn', 'os.exec') else None); "
             "from accudiff.memory import return_freed_memory; return_freed_memory(); return_freed_memory(); print(started)")
    done = subprocess.run([sys.executable, "-c", watch], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-400:])


def test_loading_a_model_never_holds_its_weights(tmp_path):
    """A 64 MB weight held in the model file: loading maps the file and parses it without the weights'
    bytes (they stay in the file, referenced where they lie). It read the file and parsed it, twice the
    weights for a moment (MiniLM's 69 MB took the caller from 80 to 213 MB; before that a checker's copy
    too, 286 MB); the worker's loading of each model it runs is the same function."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    imports = "import accudiff.model.loading as loading"
    alone, code = largest_process_peak([sys.executable, "-c", imports])
    loaded, code_loaded = largest_process_peak([sys.executable, "-c", f"{imports}; loading.load_model({str(tmp_path / 'm.onnx')!r})"])
    graph_only, code_graph = largest_process_peak([sys.executable, "-c", f"{imports}; loading.load_graph({str(tmp_path / 'm.onnx')!r})"])
    assert code == code_loaded == code_graph == 0
    assert loaded - alone < 0.4 * 64 and graph_only - alone < 0.4 * 64, (alone, loaded, graph_only)


def test_a_loaded_model_leaves_its_weights_in_its_file(tmp_path):
    """After loading, the model holds references to where its large weights lie in its file, not their
    bytes: the caller no longer carries them through the run beside the worker that reads them itself
    (MiniLM's 69 MB: the process tree's peak 337 -> 318 MB with quantize_dynamic, 396 -> 276 MB with
    MatMulNBits). Measured as the process's resident memory after loading, against before."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    script = ("import gc, re, pathlib, accudiff.model.loading as loading\n"
              "rss = lambda: int(re.search(r'VmRSS:\\s+(\\d+)', pathlib.Path('/proc/self/status').read_text()).group(1)) / 1024\n"
              f"before = rss(); info = loading.load_model({str(tmp_path / 'm.onnx')!r}); gc.collect()\n"
              "print(rss() - before, info.proto.graph.initializer[0].data_location)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    grown, location = done.stdout.split()
    assert location == str(TensorProto.EXTERNAL) and float(grown) < 16, done.stdout + done.stderr
