"""Runner outputs as .npy files: mapped lazily, and kept on disk across runs.

Keeping the reference's outputs on disk lets its runner shut down before the candidate starts, so only
one backend holds a model in memory at a time, and no run's tensors need to fit in memory at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np


class NpyFiles(Mapping):
    """Tensors as .npy files, each memory-mapped only when asked for: a caller that drops each array once
    measured never holds more than one tensor's pages, however large the model."""

    def __init__(self, files: Mapping[str, str | Path]):
        self._files = dict(files)

    def __getitem__(self, name: str) -> np.ndarray:
        return np.load(self._files[name], mmap_mode="r", allow_pickle=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


class OutputStore:
    """The outputs of successive runs, one folder per run; `store[i]` reads run i back lazily."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._runs: list[NpyFiles] = []

    def keep(self, outputs: Mapping[str, np.ndarray]) -> None:
        run = self.folder / str(len(self._runs))
        run.mkdir(parents=True)
        files = {}
        for index, name in enumerate(outputs):
            array, target = outputs[name], run / f"{index}.npy"
            already_a_file = isinstance(array, np.memmap) and array.filename and _link(array.filename, target)
            if not already_a_file:  # an .npy file is kept by a hard link, without copying a byte
                np.save(target, np.asarray(array), allow_pickle=False)
            files[name] = target
        self._runs.append(NpyFiles(files))

    def __getitem__(self, run: int) -> NpyFiles:
        return self._runs[run]

    def __len__(self) -> int:
        return len(self._runs)


def _link(source: str, target: Path) -> bool:
    try:
        os.link(source, target)
        return True
    except OSError:
        return False  # another file system: the caller copies instead


class ReferenceCache:
    """Reference outputs reused across comparisons: the same model file fed the same inputs gives the same
    reference, so a test session runs it once however many precisions or tolerances it checks."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="accudiff-reference-cache-"))
        self._entries: dict[str, tuple[OutputStore, dict[str, str]]] = {}

    @staticmethod
    def key(model: Path, feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
        digest = hashlib.sha256()
        stat = Path(model).stat()
        digest.update(f"{Path(model).resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        for feed in feeds:
            for name in sorted(feed):
                array = np.ascontiguousarray(feed[name])
                digest.update(f"{name}|{array.dtype}|{array.shape}".encode())
                digest.update(array.tobytes())
        return digest.hexdigest()[:32]

    def get(self, key: str) -> tuple[OutputStore, dict[str, str]] | None:
        return self._entries.get(key)

    def new_store(self, key: str) -> OutputStore:
        shutil.rmtree(self.folder / key, ignore_errors=True)  # a run that was interrupted
        return OutputStore(self.folder / key)

    def put(self, key: str, store: OutputStore, not_observable: dict[str, str]) -> None:
        self._entries[key] = (store, not_observable)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self._entries.clear()
