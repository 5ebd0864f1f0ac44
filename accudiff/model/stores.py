"""Reference outputs kept on disk, for callers that compare the same model on the same inputs many times.

A comparison streams its tensors and keeps none. But the pytest plugin checks one model in several
precisions, and the bisectors compare it again and again under changes: with a `ReferenceCache`, the
first comparison records the reference's outputs and the later ones replay them instead of running the
reference again. Only such callers write tensors to disk.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

COMPLETE = "complete"


class ReferenceStore:
    """One model's tensors for one list of samples: `<folder>/<sample>/<digest of the tensor's name>.npy`
    (by name, not position: a model specialized for its samples' If branches reads the same store)."""

    def __init__(self, folder: Path, tensors: Sequence[str]):
        self.folder = Path(folder)
        self._files = {name: hashlib.sha256(name.encode()).hexdigest()[:24] + ".npy" for name in tensors}

    @property
    def complete(self) -> bool:
        """Recorded for every sample, so the reference need not run."""
        return (self.folder / COMPLETE).exists()

    def write(self, sample: int, outputs: Mapping[str, np.ndarray]) -> None:
        folder = self.folder / str(sample)
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in outputs.items():
            if name in self._files:
                np.save(folder / self._files[name], np.asarray(array, order="C"), allow_pickle=False)

    def finish(self) -> None:
        (self.folder / COMPLETE).touch()

    def read(self, sample: int, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The recorded values, memory-mapped: reading one touches only its pages."""
        folder = self.folder / str(sample)
        found = {}
        for name in names:
            path = folder / self._files.get(name, "-")
            if path.exists():
                found[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        return found


class ReferenceCache:
    """Reference stores kept for a session: the same model file fed the same inputs gives the same reference,
    so a test session runs it once however many precisions or tolerances it checks."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="accudiff-reference-cache-"))

    def store(self, model: Path, samples, tensors: Sequence[str]) -> ReferenceStore:
        """The store for `model` and `samples` (model/samples.py): complete when recorded before, empty (to
        record) otherwise."""
        key = self.key(model, samples)
        store = ReferenceStore(self.folder / key, tensors)
        if not store.complete:
            shutil.rmtree(store.folder, ignore_errors=True)  # a recording that was interrupted
        return store

    @staticmethod
    def key(model: Path, samples) -> str:
        """The model file (path, size, time) and the samples' data, by content: the same inputs saved again
        elsewhere still find their reference."""
        digest = hashlib.sha256()
        stat = Path(model).stat()
        digest.update(f"{Path(model).resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        for feed in samples:
            for name in sorted(feed):
                array = np.asarray(feed[name], order="C")
                digest.update(f"{name}|{array.dtype}|{array.shape}".encode())
                digest.update(array.tobytes())
        return digest.hexdigest()[:32]

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
