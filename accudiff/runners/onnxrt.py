"""ONNX Runtime on CPU, with chosen tensors marked as outputs.

It runs inside the comparison worker process (execution/worker.py), so a native crash (seen on converted
models) ends that process, which the parent turns into a clear error naming the model and step.
Memory: a session's own arena would keep the high-water mark of every session alive at once (a segmented
comparison holds one per segment), so sessions either allocate from the system (memory goes back as soon
as a tensor is dropped) or, in a comparison worker whose tensors are large, from one arena the process
shares among all its sessions (`CpuOptions.shared_arena`): its high-water mark is that of the tensors
alive at once, which the segment plan bounds, and memory a segment dropped serves the next one. With
large tensors fresh memory is what a marked run costs beyond its arithmetic (page faults, zeroing,
unmapping): on a chain of 100 MB tensors the candidate's runs took half the time from the shared arena,
for 110 MB more at the peak. (With the PP-OCRv4 recognizer's small tensors, its sessions took longer to
make and nothing was saved.) The worker gives the arena's memory back after each job (`release_shared_arena`).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import onnx

from accudiff.errors import AccudiffError, RunFailed, first_line
from accudiff.model.graph import tensor_bytes
from accudiff.model.saving import save_model
from accudiff.model.shapes import clear_unknown_dims
from accudiff.model.source import ModelSource, own_weight_bytes
from accudiff.model.subgraph import drop_unread_nodes
from accudiff.model.weights import in_one_folder
from accudiff.runners.fp16_emulation import lower_fp16
from accudiff.runners.numpy_types import carry_in_numpy
from accudiff.runners.base import Runner


# A session whose weights reach this size prepacks them only if its run compares many samples (see CpuOptions).
PREPACK_UP_TO_BYTES = 256 << 20
PREPACK_FROM_SAMPLES = 32
OPTIMIZED_FROM_SAMPLES = 16  # a lowered FP16 model's session is optimized from this many samples in the run
# Weights a model holds itself (not in data files) up to this size go to ONNX Runtime inside the graph's
# bytes; more are written to a side file it maps. It copies weights out of bytes: on resnet18 (45 MB) the
# bytes cost 90 MB more at the peak and no time, writing the side file being as quick as the copy.
INLINE_WEIGHTS_UP_TO = 1 << 20


@dataclass(frozen=True)
class CpuOptions:
    """How a session uses the CPU: `threads` cores per run (0: ONNX Runtime's default, all), and how many
    samples the whole run compares (`samples`, over every worker: a session is made the same way in each,
    since how it is made can move its values by rounding-level amounts).

    ONNX Runtime prepacks MatMul/Gemm weights into its GEMM kernels' layout when a session is created:
    about 1.4 s per GB of weights, and a second copy of a weight at its peak, for runs some 15% faster
    (768x768 GEMMs of 128 rows). A session of a run of fewer than PREPACK_FROM_SAMPLES skips it when its
    weights reach PREPACK_UP_TO_BYTES (below that it costs little, and a graph's results then do not depend
    on how its weights were laid out: a switchboard matches its variants bit for bit). Only float weights
    count, and a model holding MatMulNBits is prepacked whatever its float weights: a 1.1B decoder's
    MatMulNBits prepack in 0.75 s and its prefill then runs in 0.3 s, 2.4 s without. The FP32 copies a gated
    switchboard holds for the nodes a trial may keep are prepacked with them, though they sit in If branches:
    the 1.1B decoder's board of 111 copies takes 17.6 s to make, 0.05 s without prepacking.

    What prepacking gains is in GEMMs of many rows: a decoder's one-token decode steps gain little (the 1.1B
    Llama's FP32 graph, every tensor marked: 0.174 s a step unpacked, 0.164 s packed; its 64-token prefill
    1.33 s against 0.67 s; packing its 4.4 GB took 13 s), so a session counts its `wide_runs` (a decoder's
    prefills; by default every sample) against PREPACK_FROM_SAMPLES.

    A lowered FP16 model (fp16_emulation.py) of a run of fewer than OPTIMIZED_FROM_SAMPLES is not
    optimized: its Cast pairs leave ONNX Runtime's fusions little to fuse, and what remains (convolutions
    in blocked layouts) costs more to plan than it saves in a few runs. Unoptimized against optimized, on
    one thread, the PP-OCRv4 recognizer's whole candidate is made in 0.044 s against 0.118 s, runs first in
    0.091 s against 0.070 s and then in 0.057 s against 0.047 s; resnet18's is made in 0.03 s against
    0.09 s and runs in 0.038 s against 0.029 s. Optimizing pays from about six runs of a worker: sixteen
    samples give eight to each of two workers."""

    threads: int = 0
    samples: int = 1
    wide_runs: int | None = None  # of the samples, the runs whose MatMuls take many rows (see above); None: all of them
    shared_arena: bool = False  # allocate from the process's shared arena (see the module docstring)


class OnnxrtRunner(Runner):
    runs_beside_others = True

    def __init__(
        self, model: str | Path | ModelSource, outputs: Sequence[str] = (), label: str = "ONNX Runtime CPU", emulate_fp16: bool = False, cpu: CpuOptions = CpuOptions()
    ):
        """`model`: a file, or a model in memory (a segment; see ModelSource). `emulate_fp16`: run an FP16 model through
        `fp16_emulation`, so every FP16 tensor is really rounded."""
        self.cpu = cpu
        self.source = model if isinstance(model, ModelSource) else ModelSource(Path(model))
        self.model_path = self.source.path
        self.outputs = list(outputs)
        self.label = label
        self.emulate_fp16 = emulate_fp16
        self._session = None
        self._scratch: Path | None = None
        self._answers: dict[str, str] = {}  # session output -> the tensor it answers for
        self._input_types: dict[str, np.dtype | None] = {}
        self._fed_as: dict[str, str] = {}  # a session input renamed to carry its value in numpy -> the value it is fed

    def activate(self) -> None:
        try:
            self._open_session()
        except BaseException:
            self.deactivate()  # a model that fails to load leaves no scratch folder behind
            raise

    def _open_session(self) -> None:
        import onnxruntime as ort

        model, folder, weight_bytes, lowered, ops = self._marked_model()
        options = ort.SessionOptions()
        if lowered and self.cpu.samples < OPTIMIZED_FROM_SAMPLES:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if ops & QDQ_OPS:  # computed as written, as TensorRT honours them: not fused into this CPU's integer kernels
            options.add_session_config_entry("session.disable_quant_qdq", "1")
        options.log_severity_level = 4  # errors still raise, as one sentence; ONNX Runtime's own lines stay off the console
        options.enable_cpu_mem_arena = self.cpu.shared_arena
        if self.cpu.shared_arena:
            _register_shared_arena()
            options.add_session_config_entry("session.use_env_allocators", "1")
        options.intra_op_num_threads = self.cpu.threads
        if (self.cpu.samples if self.cpu.wide_runs is None else self.cpu.wide_runs) < PREPACK_FROM_SAMPLES and weight_bytes >= PREPACK_UP_TO_BYTES:
            options.add_session_config_entry("session.disable_prepacking", "1")
        # A segmented comparison alternates many sessions and the statistics pass on the same cores: threads
        # left spinning after a run would steal them from whatever runs next.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if folder is not None:  # the graph as bytes; its weights stay in their data files, in this folder
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        try:
            self._session = ort.InferenceSession(model if isinstance(model, bytes) else str(model), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ONNX Runtime raises its own exception types, and RuntimeError
            raise AccudiffError(f"ONNX Runtime failed while loading '{self.model_path.name}': {first_line(exc)}") from exc
        self._input_types = {i.name: _NUMPY_TYPES.get(i.type) for i in self._session.get_inputs()}

    def infer(self, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        inputs = {}
        for name, dtype in self._input_types.items():
            value = feed[self._fed_as.get(name, name)]
            if dtype is not None and value.dtype != dtype:  # e.g. a reference value fed to an FP16 input
                with np.errstate(over="ignore"):
                    value = value.astype(dtype)
            inputs[name] = value
        try:
            results = self._session.run(list(self._answers), inputs)
        except Exception as exc:
            raise RunFailed(f"ONNX Runtime failed while running '{self.model_path.name}': {first_line(exc)}", first_line(exc)) from exc
        return {self._answers[name]: value for name, value in zip(self._answers, results) if isinstance(value, np.ndarray)}

    def deactivate(self) -> None:
        self._session = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    @property
    def not_observable(self) -> dict[str, str]:
        returned = set(self._answers.values())
        return {name: "ONNX Runtime did not return it" for name in self.outputs if name not in returned}

    def _marked_model(self) -> tuple[Path | bytes, Path | None, int, bool, frozenset[str]]:
        """The model with the requested tensors marked as outputs, as ONNX Runtime takes it, and the folder
        of the data files its weights are in (None: none are); also the bytes its weights take (whether
        prepacking them pays, see CpuOptions), whether it was lowered for FP16 emulation (whether
        optimizing it pays) and its main graph's op types. It goes as bytes, its weights left in their data files (nothing is
        written), each data file named from one folder (`in_one_folder`); a model that holds more than
        INLINE_WEIGHTS_UP_TO of weights itself first writes them to a side file in the runner's scratch
        folder, which ONNX Runtime maps rather than copies out of the bytes."""
        try:
            model = self.source.take()
        except Exception as exc:
            raise AccudiffError(f"'{self.model_path.name}' could not be read: {first_line(exc)}") from exc
        clear_unknown_dims(model)  # a size written as 0 means "unknown", not an empty tensor
        # What prepacking would cost: float weights; none where the model holds ops whose runs need it (see CpuOptions).
        weight_bytes = 0 if any(node.op_type in PREPACKED_OPS for node in model.graph.node) else sum(
            tensor_bytes(init) for init in model.graph.initializer if init.data_type in FLOAT_WEIGHTS)
        ops = frozenset(node.op_type for node in model.graph.node)
        carried = carry_in_numpy(model, self.outputs)  # while the model is typed: lowering drops the types
        self._fed_as = carried.inputs
        fp16_copies = lower_fp16(model) if self.emulate_fp16 else {}
        produced = {o for node in model.graph.node for o in node.output}
        self._answers = {}
        for name in self.outputs:
            marked = fp16_copies.get(name, carried.outputs.get(name, name))
            if marked in produced:
                self._answers[marked] = name
        del model.graph.output[:]  # exactly what was asked for: a graph output nobody wants is not kept alive
        model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in self._answers)
        drop_unread_nodes(model.graph)
        if own_weight_bytes(model) > INLINE_WEIGHTS_UP_TO:  # a folder of its own only then: a segmented comparison makes many sessions
            self._scratch = Path(tempfile.mkdtemp(prefix="accudiff-ort-"))
            save_model(model, self._scratch / "marked.onnx", move_weights=True, side_file=True, in_place=True)
        try:
            folder = in_one_folder(model.graph.initializer)  # If/Loop bodies' weights were read in (loading.load_graph)
        except ValueError:  # no folder holds every data file (two drives): they are copied into one
            self._scratch = self._scratch or Path(tempfile.mkdtemp(prefix="accudiff-ort-"))
            save_model(model, self._scratch / "whole.onnx", side_file=True)
            return self._scratch / "whole.onnx", None, weight_bytes, bool(fp16_copies), ops
        return model.SerializeToString(), folder, weight_bytes, bool(fp16_copies), ops


INTEGER_OPS = frozenset({"MatMulInteger", "ConvInteger"})  # ONNX Runtime's own UINT8 x INT8 arithmetic
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_without_vnni(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """An x86 CPU whose flags name AVX2 and no VNNI: there ONNX Runtime multiplies UINT8 by INT8 adding each
    pair of products in 16 bits (64 products of 255 x 127 give 1048544, not 2072640, on an AVX2 EPYC), which
    saturates. Read from the flags, so the caller need not load ONNX Runtime (tests hold it to a probe)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return "avx2" in flags and not flags & VNNI_FLAGS


def saturation_notice(op_types: Iterable[str]) -> str | None:
    """A notice for a candidate holding ONNX Runtime's integer ops on a CPU whose kernels saturate."""
    held = sorted(INTEGER_OPS.intersection(op_types))
    if not held or not cpu_without_vnni():
        return None
    return (f"this CPU has no VNNI: ONNX Runtime's integer kernels ({', '.join(held)}) add UINT8 x INT8 products two at a time in 16 bits, "
            "which saturates, so the candidate's numbers are this CPU's, and change with how ONNX Runtime fuses its ops, which marking every "
            "tensor changes (its graph outputs here may differ from the model's run unmarked); TensorRT and CPUs with VNNI add them in 32 bits")


def require_loadable(path: Path) -> None:
    """ONNX Runtime loads the model file at `path` as it is (a session made, not run: no optimization, no
    prepacking; weights in data files mapped, not copied); else one sentence quoting why it refuses."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_prepacking", "1")
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ONNX Runtime raises its own exception types
        raise AccudiffError(f"ONNX Runtime refuses to load the candidate model '{path}' as it is ({first_line(exc)}): "
                            "accudiff compares a candidate as it would run, and this one would not") from exc


_shared_arena_registered = False
_GROW_AS_REQUESTED = 1  # OrtArenaCfg's arena_extend_strategy: kSameAsRequested


def _register_shared_arena() -> None:
    """The process's shared CPU arena, registered once; it grows by what is asked (not by powers of two)."""
    global _shared_arena_registered
    if not _shared_arena_registered:
        import onnxruntime as ort

        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, _GROW_AS_REQUESTED, -1, -1))
        _shared_arena_registered = True


def release_shared_arena() -> None:
    """Give the shared arena's free memory back to the system. ONNX Runtime shrinks an arena at the end of a
    run that asks it to, so a one-node session on the arena makes that run."""
    if not _shared_arena_registered:
        return
    import onnxruntime as ort

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "shrink",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])], [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.add_session_config_entry("session.use_env_allocators", "1")
    session = ort.InferenceSession(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=7).SerializeToString(), options, providers=["CPUExecutionProvider"])
    run_options = ort.RunOptions()
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    session.run(None, {"x": np.zeros(1, np.float32)}, run_options)


PREPACKED_OPS = frozenset({"MatMulNBits"})  # ops whose kernels run several times slower on weights not prepacked
# A model's Q/DQ pairs are computed as written (each value quantized and read back, the arithmetic FP32, as
# TensorRT honours the pairs and accumulates in 32 bits), not fused with their nodes into ONNX Runtime's
# integer kernels, whose results differ between CPUs (a trained INT8 direction classifier's score reads 0.99
# fused on an AVX2 CPU, 0.38 as written).
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
FLOAT_WEIGHTS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})
_NUMPY_TYPES = {"tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16), "tensor(double)": np.dtype(np.float64)}
