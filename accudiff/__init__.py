"""accudiff: find where an ONNX model loses accuracy in FP16, BF16, INT8, FP8 or INT4, and why.

The public API is imported on first use, so that light entry points (the ONNX Runtime worker process,
the pytest plugin's registration) do not pay for pandas and the whole pipeline at start-up.
"""

from accudiff.errors import AccudiffError
from accudiff.version import __version__
__all__ = ["AccudiffError", "Bisection", "CompareResult", "RunSettings", "TensorFailure", "TrtOptions", "__version__", "bisect_precision",
           "bisect_subgraph", "compare"]

_API = {"compare": "api", "CompareResult": "api", "RunSettings": "api", "TensorFailure": "api", "TrtOptions": "api",
        "bisect_precision": "bisect.python_api", "bisect_subgraph": "bisect.python_api", "Bisection": "bisect.python_api"}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f"accudiff.{_API[name]}"), name)
    raise AttributeError(f"module 'accudiff' has no attribute {name!r}")
