"""accudiff: find where an ONNX model loses accuracy in FP16, BF16, INT8 or FP8, and why.

The public API is imported on first use, so that light entry points (the ONNX Runtime worker process,
the pytest plugin's registration) do not pay for pandas and the whole pipeline at start-up.
"""

from accudiff.errors import AccudiffError
from accudiff.version import __version__
__all__ = ["AccudiffError", "CompareResult", "RunSettings", "TensorFailure", "TrtOptions", "__version__", "compare"]

_API = {"compare", "CompareResult", "RunSettings", "TensorFailure", "TrtOptions"}


def __getattr__(name: str):
    if name in _API:
        from accudiff import api

        return getattr(api, name)
    raise AttributeError(f"module 'accudiff' has no attribute {name!r}")
