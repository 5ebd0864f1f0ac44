"""Which TensorRT is here, and can it run: imported lazily, so accudiff never needs TensorRT to start.

`tensorrt` (10.x or 11.x) and `tensorrt_rtx` share one API shape for what accudiff uses. Building works
without a GPU (TensorRT-RTX builds on a CPU-only machine); running needs a GPU, and TensorRT-RTX only runs
on compute capabilities 8.0, 8.6, 8.9 and 12.x.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from accudiff.errors import AccudiffError

MODULES = ("tensorrt", "tensorrt_rtx")
INSTALL_HINT = "pip install 'accudiff[trt]' (tensorrt) or 'accudiff[rtx]' (tensorrt-rtx)"
RTX_COMPUTE_CAPABILITIES = {(8, 0), (8, 6), (8, 9)}  # and every 12.x
# The oldest GPU with arithmetic in a format (TensorRT's support matrix): a BF16 or FP8 engine cannot be
# built for an older one, so the comparison could not say how that format behaves there.
FORMAT_MIN_CAPABILITY = {"bf16": (8, 0), "fp8": (8, 9), "fp4": (10, 0)}


def import_tensorrt(module: str | None = None) -> ModuleType:
    """The TensorRT module named (`tensorrt` or `tensorrt_rtx`), or the first importable of the two."""
    if module is not None and module not in MODULES:
        raise AccudiffError(f"unknown TensorRT module '{module}'; choose one of: {', '.join(MODULES)}")
    problems = []
    for name in [module] if module else MODULES:
        try:
            trt = importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if name == "tensorrt" and int(trt.__version__.split(".")[0]) < 10:
            problems.append(f"tensorrt {trt.__version__} is older than 10")
            continue
        return trt
    raise AccudiffError(f"TensorRT is not usable here ({'; '.join(problems)}); install it with {INSTALL_HINT}")


def is_rtx(trt: ModuleType) -> bool:
    return trt.__name__.startswith("tensorrt_rtx")


def missing_gpu() -> str | None:
    """What this machine lacks for running on an NVIDIA GPU, the first missing piece first: a GPU (its
    device files), a driver (libcuda), the CUDA runtime's Python bindings; None when all are here."""
    import ctypes
    import os
    import sys

    if sys.platform.startswith("linux") and not any(name.startswith("nvidia") for name in os.listdir("/dev")):
        return "no NVIDIA GPU is visible on this machine (no /dev/nvidia* device)"
    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return "no NVIDIA driver is installed (libcuda cannot be loaded)"
    return None


def gpu_compute_capability(device: int = 0) -> tuple[int, int]:
    """Compute capability of the GPU TensorRT would run on; AccudiffError saying why there is none (what the
    machine lacks, in order: a GPU, a driver, the CUDA runtime)."""
    missing = missing_gpu()
    if missing is not None:
        raise AccudiffError(f"no usable GPU for TensorRT inference: {missing}")
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python before 12.6
        except ImportError:
            raise AccudiffError(f"cuda-python is not installed; install it with {INSTALL_HINT}") from None
    error, count = cudart.cudaGetDeviceCount()
    if error != cudart.cudaError_t.cudaSuccess:
        message = cudart.cudaGetErrorString(error)[1].decode()
        raise AccudiffError(f"no usable GPU for TensorRT inference: {message}")
    if count <= device:
        raise AccudiffError("no usable GPU for TensorRT inference: CUDA reports no device")
    attributes = cudart.cudaDeviceAttr
    _, major = cudart.cudaDeviceGetAttribute(attributes.cudaDevAttrComputeCapabilityMajor, device)
    _, minor = cudart.cudaDeviceGetAttribute(attributes.cudaDevAttrComputeCapabilityMinor, device)
    return int(major), int(minor)


def require_inference(trt: ModuleType, precision: str = "fp32") -> tuple[int, int]:
    """Check that `trt` can run engines on this machine's GPU (polygraphy runs them), in the formats
    `precision` names; return its compute capability."""
    try:
        import polygraphy  # noqa: F401
    except ImportError:
        raise AccudiffError(f"TensorRT inference runs through polygraphy, which is not installed; install it with {INSTALL_HINT}") from None
    capability = gpu_compute_capability()
    if is_rtx(trt) and capability not in RTX_COMPUTE_CAPABILITIES and capability[0] != 12:
        raise AccudiffError(
            f"TensorRT-RTX cannot run on this GPU (compute capability {capability[0]}.{capability[1]}); "
            "it supports 8.0, 8.6, 8.9 and 12.x"
        )
    missing = missing_arithmetic(precision, capability)
    if missing is not None:
        raise AccudiffError(missing)
    return capability


def missing_arithmetic(precision: str, capability: tuple[int, int]) -> str | None:
    """Why a GPU of `capability` cannot compute in a format `precision` names (None when it can)."""
    for fmt in precision.split("+"):
        oldest = FORMAT_MIN_CAPABILITY.get(fmt)
        if oldest is not None and capability < oldest:
            return (f"this GPU (compute capability {capability[0]}.{capability[1]}) has no {fmt.upper()} arithmetic "
                    f"(TensorRT needs {oldest[0]}.{oldest[1]} or later for it)")
    return None


def inference_unavailable_reason(module: str | None = None, precision: str = "fp32") -> str | None:
    """Why TensorRT inference cannot run here in `precision`, or None when it can."""
    try:
        require_inference(import_tensorrt(module), precision)
    except AccudiffError as exc:
        return str(exc)
    return None
