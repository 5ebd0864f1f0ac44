"""A candidate that already ran elsewhere: its tensors replayed from a store (model/run_results.py reads
polygraphy's RunResults into one), iteration k for the k-th sample, as polygraphy matches them."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from accudiff.runners.base import Runner
from accudiff.model.stores import ReferenceStore


class RecordedRunner(Runner):
    """Answers the k-th `infer` with the tensors recorded for sample `samples[k]` (a worker's share of the
    samples, in the order the comparison feeds them; the model is compared as one segment)."""

    def __init__(self, store: ReferenceStore, outputs: Sequence[str], samples: Sequence[int], label: str):
        self.store, self.outputs, self.samples, self.label = store, list(outputs), list(samples), label
        self._next = 0

    def activate(self) -> None:
        self._next = 0

    def infer(self, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        sample = self.samples[self._next]
        self._next += 1
        return self.store.read(sample, self.outputs)

    def deactivate(self) -> None:
        pass


def recorded_runner(folder: Path, tensors: Sequence[str], outputs: Sequence[str], samples: Sequence[int], label: str) -> RecordedRunner:
    return RecordedRunner(ReferenceStore(folder, tensors), outputs, samples, label)
