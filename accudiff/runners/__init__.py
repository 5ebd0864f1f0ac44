"""Backends behind one interface (`Runner`). The rest of accudiff asks this module for a runner by kind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from accudiff.errors import AccudiffError
from accudiff.runners.base import Runner
from accudiff.runners.onnxrt import OnnxrtRunner
from accudiff.runners.trt_build import BuildSettings
from accudiff.runners.trt_env import inference_unavailable_reason

CANDIDATES = ("auto", "onnxrt", "trt")

_ONNXRT_LABELS = {
    "fp32": "ONNX Runtime CPU, FP32",
    "fp16": "ONNX Runtime CPU running the FP16 model (simulates FP16 storage; its arithmetic is FP32)",
    "int8": "ONNX Runtime CPU running the Q/DQ model (simulates INT8 rounding, not TensorRT's fused INT8 kernels)",
}


def reference_runner(model_path: Path, outputs: Sequence[str], threads: int = 0) -> Runner:
    return OnnxrtRunner(model_path, outputs, label="ONNX Runtime CPU, FP32 (reference)", threads=threads)


@dataclass(frozen=True)
class TrtOptions:
    """How the TensorRT candidate is built (see trt_build.py)."""

    module: str | None = None  # "tensorrt" or "tensorrt_rtx"; None: the first importable
    mark: str = "auto"  # all | unfused | outputs; auto: unfused where supported
    workspace_mb: int | None = None
    legacy_precision: str | None = None  # TensorRT 10 only: fp16 | int8 builder flags
    cache_dir: Path | None = None  # engine and timing cache; default ~/.cache/accudiff
    engine: Path | None = None  # a pre-built engine to compare (its graph outputs only) instead of building one


def resolve_candidate(kind: str, trt: TrtOptions = TrtOptions()) -> tuple[str, str | None]:
    """The concrete candidate for `kind`, and a one-line notice when 'auto' had to fall back."""
    if kind not in CANDIDATES:
        raise AccudiffError(f"unknown candidate '{kind}'; choose one of: {', '.join(CANDIDATES)}")
    if kind == "onnxrt":
        return kind, None
    reason = inference_unavailable_reason(trt.module)
    if reason is None:
        return "trt", None
    if kind == "trt":
        raise AccudiffError(reason)
    return "onnxrt", f"{reason}; using the ONNX Runtime candidate"


def unavailable_reason(kind: str, module: str | None = None) -> str | None:
    """Why the `kind` candidate cannot run here (None when it can): lets test suites skip, not fail."""
    return inference_unavailable_reason(module) if kind == "trt" else None


def candidate_runner(
    kind: str,
    model_path: Path,
    outputs: Sequence[str],
    precision: str,
    trt: TrtOptions = TrtOptions(),
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    layer_report: Path | None = None,
    threads: int = 0,
    shape_values: Mapping[str, Sequence[int]] | None = None,
) -> Runner:
    """`shape_values`: the compared samples' values of small integer inputs, which a TensorRT engine fixes
    where it reads them as shapes."""
    if kind == "trt":
        from accudiff.runners.trt import TrtRunner

        settings = BuildSettings(trt.mark, dict(input_shapes or {}), dict(shape_values or {}), trt.workspace_mb, trt.legacy_precision)
        return TrtRunner(model_path, outputs, settings, trt.module, trt.cache_dir, layer_report, trt.engine)
    return OnnxrtRunner(model_path, outputs, label=_ONNXRT_LABELS[precision], emulate_fp16=precision == "fp16", threads=threads)


__all__ = ["CANDIDATES", "OnnxrtRunner", "Runner", "TrtOptions", "candidate_runner", "reference_runner", "resolve_candidate", "unavailable_reason"]
