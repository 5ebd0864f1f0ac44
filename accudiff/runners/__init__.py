"""Backends behind one interface (`Runner`). The rest of accudiff asks this module for a runner by kind."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from accudiff.errors import AccudiffError
from accudiff.model.formats import formats_of
from accudiff.model.source import ModelSource
from accudiff.runners.base import Runner
from accudiff.runners.onnxrt import CpuOptions, OnnxrtRunner, saturation_notice
from accudiff.runners.trt_build import BuildSettings
from accudiff.runners.trt_env import inference_unavailable_reason

CANDIDATES = ("auto", "onnxrt", "trt")

# What ONNX Runtime's CPU run of each format really computes (README, "How compare works").
_SIMULATES = {
    "fp16": "simulates FP16 storage; its arithmetic is FP32",
    "bf16": "simulates BF16 storage; its arithmetic is FP32",
    "int8": "simulates INT8 rounding: its Q/DQ pairs computed as written, in FP32 arithmetic, not fused into ONNX Runtime's CPU integer kernels; not TensorRT's fused INT8 kernels",
    "fp8": "simulates FP8 rounding, not TensorRT's FP8 kernels",
    "int4": "simulates INT4 rounding, not TensorRT's INT4 kernels",
    "fp4": "simulates FP4 rounding, not TensorRT's FP4 kernels",
    "int8-dynamic": "ONNX Runtime's own kernels quantize activations to INT8 as the model runs",
    "int8-weight": "simulates INT8 weights; its arithmetic is FP32",
    "int4-weight": "simulates INT4 weights; its arithmetic is FP32",
    "int2-weight": "simulates 2-bit weights; its arithmetic is FP32",
}


def onnxrt_label(precision: str) -> str:
    """What the ONNX Runtime candidate of `precision` computes, in words. Activations quantized as the model
    runs beside weights stored on a narrow grid are INT8 activations times those weights, in integer
    arithmetic, whichever kernel does it (MatMulInteger and ConvInteger of quantize_dynamic, MatMulNBits at
    accuracy_level 4): the label names neither, as it is made from the formats alone."""
    formats = [f for f in precision.split("+") if f in _SIMULATES]
    if not formats:
        return "ONNX Runtime CPU, FP32"
    said = [_SIMULATES[f] for f in formats]
    weights = [f for f in formats if f.endswith("-weight")]
    if "int8-dynamic" in formats and weights:
        grids = " and ".join(f.removesuffix("-weight").upper() for f in weights)
        said = [f"ONNX Runtime's own kernels quantize activations to INT8 as the model runs and multiply them by its {grids} weights in integer "
                "arithmetic", *(_SIMULATES[f] for f in formats if f != "int8-dynamic" and f not in weights)]
    model = {"fp16": "the FP16 model", "bf16": "the BF16 model", "int8": "the Q/DQ model"}.get(precision, f"the {precision.upper()} model")
    return f"ONNX Runtime CPU running {model} ({'; '.join(said)})"


def reference_runner(model: Path | ModelSource, outputs: Sequence[str], cpu: CpuOptions = CpuOptions()) -> Runner:
    return OnnxrtRunner(model, outputs, label="ONNX Runtime CPU, FP32 (reference)", cpu=cpu)


@dataclass(frozen=True)
class TrtOptions:
    """How the TensorRT candidate is built (see trt_build.py)."""

    module: str | None = None  # "tensorrt" or "tensorrt_rtx"; None: the first importable
    mark: str = "auto"  # all | unfused | outputs; auto: unfused where supported
    workspace_mb: int | None = None
    legacy_precision: str | None = None  # TensorRT 10 only: fp16 | int8 builder flags
    cache_dir: Path | None = None  # engine and timing cache; default ~/.cache/accudiff
    engine: Path | None = None  # a pre-built engine to compare (its graph outputs only) instead of building one

    def as_json(self) -> dict:
        """These options as a worker job carries them."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def resolve_candidate(kind: str, trt: TrtOptions = TrtOptions(), precision: str = "fp32", onnxruntime_only: Sequence[str] = ()) -> tuple[str, str | None]:
    """The concrete candidate for `kind` in `precision`, and a one-line notice when 'auto' had to fall back.
    `onnxruntime_only`: op types of the candidate that only ONNX Runtime runs (TensorRT cannot build it)."""
    if kind not in CANDIDATES:
        raise AccudiffError(f"unknown candidate '{kind}'; choose one of: {', '.join(CANDIDATES)}")
    saturates = saturation_notice(onnxruntime_only)
    if kind == "onnxrt":
        return kind, saturates
    if onnxruntime_only:
        ops = ", ".join(onnxruntime_only)
        if kind == "trt":
            raise AccudiffError(f"the candidate holds ops only ONNX Runtime runs ({ops}), which TensorRT's ONNX parser does not take: compare it with --candidate onnxrt")
        deployed = f"the candidate holds ops only ONNX Runtime runs ({ops}): it runs in ONNX Runtime, as it would be deployed"
        return "onnxrt", f"{deployed}; {saturates}" if saturates else deployed
    reason = inference_unavailable_reason(trt.module, precision)
    if reason is None:
        return "trt", None
    if kind == "trt":
        raise AccudiffError(reason)
    return "onnxrt", f"{reason}; using the ONNX Runtime candidate"


def unavailable_reason(kind: str, module: str | None = None) -> str | None:
    """Why the `kind` candidate cannot run here (None when it can): lets test suites skip, not fail."""
    return inference_unavailable_reason(module) if kind == "trt" else None


@dataclass(frozen=True)
class EngineShapes:
    """What a TensorRT engine is built for: each input's shape, and the compared samples' values of small
    integer inputs, which an engine fixes where it reads them as shapes."""

    inputs: Mapping[str, Sequence[int]] = field(default_factory=dict)
    values: Mapping[str, Sequence[int]] = field(default_factory=dict)


def candidate_runner(
    kind: str,
    model: Path | ModelSource,
    outputs: Sequence[str],
    precision: str,
    trt: TrtOptions = TrtOptions(),
    shapes: EngineShapes = EngineShapes(),
    layer_report: Path | None = None,
    cpu: CpuOptions = CpuOptions(),
) -> Runner:
    """The runner of a candidate pass: TensorRT (`layer_report`: where the engine's layer report goes;
    it builds from a file) or ONNX Runtime (`cpu`: how it uses the cores)."""
    if kind == "trt":
        from accudiff.runners.trt import TrtRunner

        settings = BuildSettings(trt.mark, dict(shapes.inputs), dict(shapes.values), trt.workspace_mb, trt.legacy_precision)
        path = model.file() if isinstance(model, ModelSource) else model
        return TrtRunner(path, outputs, settings, trt.module, trt.cache_dir, layer_report, trt.engine)
    return OnnxrtRunner(model, outputs, label=onnxrt_label(precision), emulate_fp16=bool({"fp16", "bf16"} & formats_of(precision)), cpu=cpu)


__all__ = ["CANDIDATES", "CpuOptions", "EngineShapes", "OnnxrtRunner", "Runner", "TrtOptions", "candidate_runner", "reference_runner", "resolve_candidate", "unavailable_reason"]
