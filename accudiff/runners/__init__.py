"""Backends behind one interface (`Runner`). The rest of accudiff asks this module for a runner by kind."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from accudiff.errors import AccudiffError
from accudiff.runners.base import Runner
from accudiff.runners.onnxrt import OnnxrtRunner

CANDIDATES = ("auto", "onnxrt", "trt")

_ONNXRT_LABELS = {
    "fp32": "ONNX Runtime CPU, FP32",
    "fp16": "ONNX Runtime CPU running the FP16 model (simulates FP16 storage; its arithmetic is FP32)",
    "int8": "ONNX Runtime CPU running the Q/DQ model (simulates INT8 rounding, not TensorRT's fused INT8 kernels)",
}


def reference_runner(model_path: Path, outputs: Sequence[str], external_data: bool = False) -> Runner:
    return OnnxrtRunner(model_path, outputs, label="ONNX Runtime CPU, FP32 (reference)", external_data=external_data)


def resolve_candidate(kind: str) -> tuple[str, str | None]:
    """The concrete candidate for `kind`, and a one-line notice when 'auto' had to fall back."""
    if kind not in CANDIDATES:
        raise AccudiffError(f"unknown candidate '{kind}'; choose one of: {', '.join(CANDIDATES)}")
    if kind == "auto":
        return "onnxrt", "TensorRT inference is not available in this build of accudiff; using the ONNX Runtime candidate"
    if kind == "trt":
        raise AccudiffError("the TensorRT candidate is not available in this build of accudiff; use --candidate onnxrt")
    return kind, None


def unavailable_reason(kind: str) -> str | None:
    """Why the `kind` candidate cannot run here (None when it can): lets test suites skip, not fail."""
    if kind == "trt":
        return "TensorRT inference is not available in this build of accudiff"
    return None


def candidate_runner(kind: str, model_path: Path, outputs: Sequence[str], precision: str, external_data: bool = False) -> Runner:
    return OnnxrtRunner(
        model_path, outputs, label=_ONNXRT_LABELS[precision], emulate_fp16=precision == "fp16", external_data=external_data
    )


__all__ = ["CANDIDATES", "OnnxrtRunner", "Runner", "candidate_runner", "reference_runner", "resolve_candidate", "unavailable_reason"]
