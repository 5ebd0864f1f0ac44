"""The one exception type users see: its message is a single sentence that says what to fix."""

from __future__ import annotations

import errno
import os
import re

# ONNX Runtime's messages carry a status prefix and the C++ source location and signature of the check
# that failed; the reader needs what follows them.
_ONNXRUNTIME_NOISE = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : |/onnxruntime_src/\S+:\d+ (?:[^()]*\([^()]*\)\S* )?")


class AccudiffError(Exception):
    """A problem with the user's input or environment (exit code 2 on the command line)."""


def missing(path: str | os.PathLike, said: str) -> AccudiffError:
    """The error for a path that names no file: `said` (what it should be, named) does not exist, or is
    something else (a folder, a device such as /dev/zero, which is read without end)."""
    return AccudiffError(f"{said} {'is not a file' if os.path.exists(path) else 'does not exist'}")


_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written$")


def out_of_space(exc: OSError, scratch: str, report: str | None = None) -> AccudiffError | None:
    """The sentence for a disk that filled up (or a quota, or a limit on a file's size, was reached) while
    accudiff wrote to it: where its scratch files and its `report` go (the file an OSError names may be the
    one read, not the one written); None for any other OSError, which stays a bug of ours."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "the disk filled up"
    elif exc.errno == errno.EFBIG:
        what = "a file grew past the size its file system or a limit allows (ulimit -f)"
    elif exc.errno is None and _SHORT_WRITE.match(str(exc)):  # numpy's words for a write that stopped short, without the errno
        what = "a write stopped short (a full disk, or a limit on a file's size)"
    else:
        return None
    return AccudiffError(f"{what} while accudiff wrote to it: its scratch files go to {scratch} (TMPDIR moves them) and its report to "
                         f"{report or 'the -o folder'}; free space there or point them elsewhere (nothing was kept)")


class RunFailed(AccudiffError):
    """A backend failed to run a model on a sample: `reason`, its own words (the caller names the sample and
    its inputs, which a backend running one segment of a model does not know)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


# "Non-zero status code returned while running Concat node. Name:'/x/Concat' Status Message: concatbase.h:135
# PrepareForComputeImpl Non concat axis ..." says: "Concat '/x/Concat': Non concat axis ...".
_ONNXRUNTIME_NODE = re.compile(r"Non-zero status code returned while running (\w+) node\. Name:'([^']*)' Status Message: (?:\S+\.(?:h|cc|cpp):\d+ \w+ )?")


def first_line(exc: BaseException) -> str:
    """The first line of a foreign library's exception, without ONNX Runtime's source locations: the part
    of its message worth quoting in our one sentence."""
    text = _ONNXRUNTIME_NODE.sub(r"\1 '\2': ", _ONNXRUNTIME_NOISE.sub("", str(exc))).strip().splitlines()
    return text[0].strip() if text else type(exc).__name__
