"""The one exception type users see: its message is a single sentence that says what to fix."""

from __future__ import annotations

import re

# ONNX Runtime's messages carry a status prefix and the C++ source location and signature of the check
# that failed; the reader needs what follows them.
_ONNXRUNTIME_NOISE = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : |/onnxruntime_src/\S+:\d+ (?:[^()]*\([^()]*\)\S* )?")


class AccudiffError(Exception):
    """A problem with the user's input or environment (exit code 2 on the command line)."""


def first_line(exc: BaseException) -> str:
    """The first line of a foreign library's exception, without ONNX Runtime's source locations: the part
    of its message worth quoting in our one sentence."""
    text = _ONNXRUNTIME_NOISE.sub("", str(exc)).strip().splitlines()
    return text[0].strip() if text else type(exc).__name__
