"""Values of the FP32 model the caller's stages need before comparing (which If branch each sample takes,
how large the values autokeep keeps in FP32 grow), computed in a worker process as every backend call is:
a native crash there is said in one sentence, and never takes the caller down."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

from accudiff.execution.messages import Probe, ProbedValue
from accudiff.execution.pool import keep_warm_worker, take_worker
from accudiff.model.samples import Samples


def probe_values(model: Path, outputs: list[str], samples: list[list[str]]) -> list[dict[str, ProbedValue]]:
    """Each of `samples`' (model/samples.py's entries) values `outputs` of `model`, as the FP32 model computes
    them, summarized (`ProbedValue`): asked of a worker (one started ahead, kept warm for the comparison)."""
    with tempfile.TemporaryDirectory(prefix="accudiff-probe-") as folder:
        worker = take_worker()
        try:
            found = worker.probe(Probe(str(model), list(outputs), [list(entry) for entry in samples], str(Path(folder) / "probe.json")))
        except BaseException:
            worker.let_go()
            raise
        keep_warm_worker(worker)
    return found


def largest_values(model: Path, outputs: list[str], samples: Samples) -> dict[str, float]:
    """The largest finite magnitude of each of `outputs` over `samples` (autokeep's measure)."""
    largest = dict.fromkeys(outputs, 0.0)
    for values in probe_values(model, outputs, samples.as_json()):
        for name, value in values.items():
            largest[name] = max(largest[name], value.largest_finite)
    return largest


def first_values(model: Path, outputs: Sequence[str], samples: Samples) -> list[dict[str, float]]:
    """Each sample's first element of each of `outputs` (an If's condition)."""
    return [{name: value.first for name, value in values.items()} for values in probe_values(model, list(outputs), samples.as_json())]
