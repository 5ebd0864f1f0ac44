"""What a worker remembers of the model files it ran whole, for as long as it lives: verification's trials send
their switchboard in job after job, and parsing its graph again was 10 ms of a 30 ms job on MiniLM. Keyed by the
file's identity and contents' stamp, and by the tensors compared."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

WHOLE_MODELS_REMEMBERED = 64
# A model file run whole -> its inputs, compared and returned tensors, and weight bytes.
_WHOLE: dict[tuple, tuple[set[str], list[str], list[str], int]] = {}


def whole_model(path: Path, tensors: Sequence[str]) -> tuple[set[str], list[str], list[str], int] | None:
    """What the file at `path`, run whole comparing `tensors`, reads, compares, returns and weighs, if remembered."""
    return _WHOLE.get(_key(path, tensors))


def remember_whole_model(path: Path, tensors: Sequence[str], facts: tuple[set[str], list[str], list[str], int]) -> None:
    if len(_WHOLE) >= WHOLE_MODELS_REMEMBERED:
        _WHOLE.clear()
    _WHOLE[_key(path, tensors)] = facts


def _key(path: Path, tensors: Sequence[str]) -> tuple:
    stat = path.stat()
    return str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, frozenset(tensors)
