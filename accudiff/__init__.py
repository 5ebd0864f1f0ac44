"""accudiff: find the tensor where an ONNX model loses accuracy in FP16/INT8, and why."""

__version__ = "0.1.0"

from accudiff.api import CompareResult, TensorFailure, compare  # noqa: E402
from accudiff.errors import AccudiffError  # noqa: E402

__all__ = ["AccudiffError", "CompareResult", "TensorFailure", "__version__", "compare"]
