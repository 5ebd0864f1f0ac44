"""Build a TensorRT engine from the candidate ONNX model, with its tensors made observable, and cache it.

The network is strongly typed: FP16 and INT8 come from the ONNX model itself (the same transforms the
ONNX Runtime candidate runs), the only kind of precision TensorRT 11 and TensorRT-RTX have. TensorRT 10's
weakly typed builder flags are reachable only through `legacy_precision`.

What is observed (`mark`):
* `all` — every ONNX tensor that exists in the network becomes a network output. This changes fusion
  (an output cannot be fused away), so the engine differs from the one that ships: the report says so.
* `unfused` — `mark_unfused_tensors_as_debug_tensors`: only tensors that survive fusion are read, through
  the debug listener, so the engine under test is the one that ships.
* `outputs` — graph outputs only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Mapping, Sequence

import onnx

from accudiff.errors import AccudiffError
from accudiff.atomic import write_atomically
from accudiff.model.graph import all_initializers
from accudiff.model.weights import data_file, in_one_folder, is_external, mark_weights_folder
from accudiff.runners.trt_env import is_rtx

MARK_MODES = ("auto", "all", "unfused", "outputs")
LEGACY_PRECISIONS = ("fp16", "int8")
CACHE_ENV = "ACCUDIFF_CACHE_DIR"
ALL_CHANGES_FUSION = "--trt-mark all makes every tensor a network output, which prevents fusions: the engine differs from the shipped one"


@dataclass(frozen=True)
class BuildSettings:
    mark: str = "auto"
    input_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)  # one fixed profile (min = opt = max)
    shape_values: Mapping[str, Sequence[int]] = field(default_factory=dict)  # values of small integer inputs, for shape-tensor inputs
    workspace_mb: int | None = None
    legacy_precision: str | None = None
    compute_capability: tuple[int, int] | None = None  # TensorRT-RTX build target; None = the current GPU


@dataclass
class BuiltEngine:
    plan: bytes
    mark: str  # the mode used ("auto" resolved)
    outputs: list[str]  # ONNX tensors that are network outputs
    not_observable: dict[str, str]  # ONNX tensor -> why TensorRT cannot show it
    from_cache: bool = False
    notices: list[str] = field(default_factory=list)


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "accudiff")


def build_engine(
    trt: ModuleType,
    model_path: Path,
    tensors: Sequence[str],
    settings: BuildSettings,
    cache_dir: Path | None = None,
) -> BuiltEngine:
    """The engine for `model_path`, from the engine cache when model, settings, TensorRT and GPU match."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = _cache_key(trt, model_path, tensors, settings)
    plan_path, meta_path = cache_dir / "engines" / f"{key}.plan", cache_dir / "engines" / f"{key}.json"
    damage = None
    if plan_path.exists() or meta_path.exists():
        cached, damage = _read_cached(plan_path, meta_path)
        if cached is not None:
            return cached
    built = _build(trt, model_path, tensors, settings, cache_dir / "timing.cache")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(plan_path, built.plan)
    meta = {"mark": built.mark, "outputs": built.outputs, "not_observable": built.not_observable, "notices": built.notices,
            "sha256": hashlib.sha256(built.plan).hexdigest()}
    write_atomically(meta_path, json.dumps(meta).encode())
    if damage is not None:
        built.notices.append(f"the cached engine '{plan_path}' could not be used ({damage}); it was built again")
    return built


def _read_cached(plan_path: Path, meta_path: Path) -> tuple[BuiltEngine | None, str | None]:
    """A cached engine, or why it cannot be used (half of it missing, damaged, or from an older accudiff):
    the plan is checked against the checksum written beside it, so a damaged one is rebuilt, not run."""
    try:
        meta = json.loads(meta_path.read_bytes())
        plan = plan_path.read_bytes()
        if hashlib.sha256(plan).hexdigest() != meta["sha256"]:
            return None, "its plan does not match the checksum written with it"
        fields = (str(meta["mark"]), list(meta["outputs"]), dict(meta["not_observable"]), True, list(meta["notices"]))
        return BuiltEngine(plan, *fields), None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)


def create_network(trt: ModuleType, model_path: Path, strongly_typed: bool = True):
    """Builder, network and parser for an ONNX file; parser errors become one sentence naming the node. The
    parser is given the graph as bytes, its data files named from one folder: a model accudiff saved in
    its scratch folder refers to the user's weights where they are (weights.in_one_folder)."""
    logger = error_log(trt)
    builder = trt.Builder(logger)
    flags = 0
    if strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    graph = _graph(model_path)
    folder = in_one_folder(all_initializers(graph)) or model_path.parent
    if not parser.parse(graph.SerializeToString(), str(folder / model_path.name)):
        raise AccudiffError(f"TensorRT's ONNX parser cannot convert '{model_path.name}': {parser_errors(parser)[0]}")
    return builder, network, parser, logger


def _graph(model_path: Path) -> onnx.ModelProto:
    """The model file's graph, its weights left in their data files, each naming its file's folder: a model
    accudiff saved in its scratch folder refers to the user's weights where they are (saving's `in_place`)."""
    graph = onnx.load(str(model_path), load_external_data=False)
    mark_weights_folder(all_initializers(graph), model_path.parent)
    return graph


def parser_errors(parser) -> list[str]:
    """Each parser error as 'node N 'name' (Op): reason'."""
    errors = []
    for index in range(parser.num_errors):
        error = parser.get_error(index)
        where = f"node {error.node()} '{error.node_name()}' ({error.node_operator()})" if error.node() >= 0 else "the model"
        errors.append(f"{where}: {error.desc().strip() or 'unsupported'}")
    return errors or ["unknown parser error"]


def error_log(trt: ModuleType):
    """A TensorRT logger that keeps error messages, so a failed build can say why."""

    class _ErrorLog(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, message):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(message.strip())

    return _ErrorLog()


def _build(trt: ModuleType, model_path: Path, tensors: Sequence[str], settings: BuildSettings, timing_cache: Path) -> BuiltEngine:
    if settings.legacy_precision is not None and not hasattr(trt.BuilderFlag, "FP16"):
        raise AccudiffError(
            f"--trt-legacy-precision needs TensorRT 10's weakly typed builder; {trt.__name__} {trt.__version__} is strongly "
            "typed only: precision comes from the ONNX model (use --fp16 or --int8)"
        )
    builder, network, _, logger = create_network(trt, model_path, strongly_typed=settings.legacy_precision is None)
    mark = settings.mark
    if mark == "auto":
        mark = "unfused" if hasattr(network, "mark_unfused_tensors_as_debug_tensors") else "all"
    if mark not in MARK_MODES:
        raise AccudiffError(f"unknown --trt-mark '{mark}'; choose one of: {', '.join(MARK_MODES)}")
    outputs, not_observable = _mark(trt, network, tensors, mark)
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the engine inspector then names tactics
    if settings.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_mb << 20)
    if settings.legacy_precision is not None:
        config.set_flag(trt.BuilderFlag.FP16 if settings.legacy_precision == "fp16" else trt.BuilderFlag.INT8)
    if settings.compute_capability is not None and is_rtx(trt):
        major, minor = settings.compute_capability
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, f"SM{major}{minor}"), 0)
    _add_profile(builder, network, config, settings.input_shapes, settings.shape_values)
    cache = _load_timing_cache(trt, config, timing_cache)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        reason = logger.errors[-1] if logger.errors else "no reason given"
        raise AccudiffError(f"TensorRT could not build an engine for '{model_path.name}': {reason}")
    if cache is not None:
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(timing_cache, bytes(memoryview(cache.serialize())))
    notices = [ALL_CHANGES_FUSION] if mark == "all" else []
    return BuiltEngine(bytes(memoryview(plan)), mark, outputs, not_observable, False, notices)


def _mark(trt: ModuleType, network, tensors: Sequence[str], mark: str) -> tuple[list[str], dict[str, str]]:
    """Make the requested ONNX tensors observable; return the network outputs and what cannot be shown."""
    by_name = {}
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        for out in range(layer.num_outputs):
            by_name[layer.get_output(out).name] = (layer.get_output(out), layer)
    not_observable: dict[str, str] = {}
    if mark == "unfused":
        network.mark_unfused_tensors_as_debug_tensors()
    for name in tensors:
        if name not in by_name:
            not_observable[name] = "TensorRT's ONNX parser folded it into another layer (no such network tensor)"
            continue
        tensor, layer = by_name[name]
        if mark != "all" or tensor.is_network_output:
            continue
        reason = _unmarkable(trt, tensor, layer)
        if reason:
            not_observable[name] = reason
        else:
            network.mark_output(tensor)
    outputs = [network.get_output(i).name for i in range(network.num_outputs)]
    return outputs, not_observable


def _unmarkable(trt: ModuleType, tensor, layer) -> str | None:
    if tensor.is_shape_tensor:
        return "a shape tensor: TensorRT computes it at build time and cannot return it"
    if layer.type == trt.LayerType.CONSTANT:
        return "a constant: TensorRT folds it into the engine"
    loop_types = {"TRIP_LIMIT", "RECURRENCE", "ITERATOR", "LOOP_OUTPUT", "CONDITION", "CONDITIONAL_INPUT", "CONDITIONAL_OUTPUT"}
    if layer.type.name in loop_types:
        return "inside a TensorRT loop or conditional, which cannot expose its tensors"
    return None


def _add_profile(builder, network, config, input_shapes: Mapping[str, Sequence[int]], shape_values: Mapping[str, Sequence[int]]) -> None:
    """One optimization profile fixing every dynamic input to the shape it is compared at, and every
    shape-tensor input (an integer input TensorRT reads as a shape, e.g. Reshape's target) to its value."""
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    dynamic = [tensor for tensor in inputs if -1 in tuple(tensor.shape)]
    shape_tensors = [tensor for tensor in inputs if tensor.is_shape_tensor]
    if not dynamic and not shape_tensors:
        return
    profile = builder.create_optimization_profile()
    for tensor in dynamic:
        if tensor.name not in input_shapes:
            raise AccudiffError(f"input '{tensor.name}' is dynamic; give its shape with --input-shapes {tensor.name}:...")
        shape = tuple(input_shapes[tensor.name])
        profile.set_shape(tensor.name, shape, shape, shape)
    for tensor in shape_tensors:
        if tensor.name not in shape_values:
            raise AccudiffError(f"TensorRT reads input '{tensor.name}' as a shape, and its engine needs that input's value: give a sample with it")
        values = [int(v) for v in shape_values[tensor.name]]
        profile.set_shape_input(tensor.name, values, values, values)
    config.add_optimization_profile(profile)


def _load_timing_cache(trt: ModuleType, config, path: Path):
    """The timing cache, reused across runs (TensorRT-RTX has none: its timing cache is a no-op)."""
    if is_rtx(trt):
        return None
    try:
        cache = config.create_timing_cache(path.read_bytes() if path.exists() else b"")
    except (OSError, RuntimeError, TypeError):
        cache = None
    if cache is None:  # damaged or from another TensorRT: start from an empty one, which the build rewrites
        cache = config.create_timing_cache(b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def _cache_key(trt: ModuleType, model_path: Path, tensors: Sequence[str], settings: BuildSettings) -> str:
    """The model file and the data files its weights are in (same graph, other weights: another engine),
    the settings, TensorRT and the GPU."""
    digest = hashlib.sha256()
    files = [model_path, *sorted({data_file(init)[0] for init in all_initializers(_graph(model_path)) if is_external(init)})]
    for path in files:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    target = settings.compute_capability or _current_gpu()
    described = {"settings": asdict(settings), "tensors": list(tensors), "trt": f"{trt.__name__} {trt.__version__}", "gpu": target}
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def _current_gpu() -> str:
    from accudiff.runners.trt_env import gpu_compute_capability

    try:
        return "sm%d%d" % gpu_compute_capability()
    except AccudiffError:
        return "no-gpu"
