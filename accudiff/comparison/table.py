"""Run reference and candidate on each feed and build the per-tensor table, in topological order.

Tensors align by exact name only: a tensor the candidate does not return is listed as not observed,
never matched to some other tensor by a fuzzy rule.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from accudiff.comparison.metrics import TensorStats, measure, merge
from accudiff.comparison.tolerances import Tolerance, Tolerances
from accudiff.model.inputs import Feed
from accudiff.model.loading import ModelInfo, TensorInfo
from accudiff.runners.base import Runner
from accudiff.runners.outputs import OutputStore
from accudiff.transforms.base import QuantRange

Progress = Callable[[int, int], None]

STATUS_PASS, STATUS_FAIL, STATUS_MISSING = "pass", "fail", "not observed"


def record_runs(runner: Runner, feeds: list[Feed], store: OutputStore, progress: Progress | None = None) -> None:
    """Run every feed and keep the outputs on disk, so `runner` can shut down before the next one starts."""
    for iteration, feed in enumerate(feeds):
        store.keep(runner.infer(feed))
        if progress is not None:
            progress(iteration + 1, len(feeds))


def compare_runs(
    tensors: list[TensorInfo],
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Runner,
    feeds: list[Feed],
    tolerances: Tolerances,
    quant_ranges: Mapping[str, QuantRange] | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """One row per tensor: identity, dtypes, shape, statistics aggregated over all feeds, and status.

    `reference[i]` holds the reference outputs for `feeds[i]` (an `OutputStore`, or plain dicts).
    """
    aggregate = _Aggregate(tensors, tolerances, quant_ranges or {})
    for iteration, feed in enumerate(feeds):
        aggregate.add(reference[iteration], candidate.infer(feed), iteration)
        if progress is not None:
            progress(iteration + 1, len(feeds))
    return aggregate.table()


class _Aggregate:
    """Running statistics of every tensor; each iteration's arrays are released once measured."""

    def __init__(self, tensors: list[TensorInfo], tolerances: Tolerances, quant_ranges: Mapping[str, QuantRange]):
        self.tensors, self.tolerances, self.quant_ranges = tensors, tolerances, quant_ranges
        self.totals: dict[str, TensorStats] = {}
        self.seen: dict[str, dict] = {}
        self.notes: dict[str, str] = {}

    def add(self, ref_out: Mapping[str, np.ndarray], cand_out: Mapping[str, np.ndarray], iteration: int) -> None:
        for info in self.tensors:
            name = info.name
            if name not in ref_out or name not in cand_out:
                self.notes[name] = "not returned by the reference" if name not in ref_out else "not returned by the candidate"
                continue
            ref, cand = ref_out[name], cand_out[name]
            self.seen[name] = {"dtype": str(ref.dtype), "cand_dtype": str(cand.dtype), "shape": "x".join(map(str, ref.shape))}
            if ref.shape != cand.shape:
                self.notes[name] = f"shape differs: reference {ref.shape}, candidate {cand.shape}"
                continue
            stats = measure(ref, cand, self.tolerances.for_tensor(name), self.quant_ranges.get(name))
            self.totals[name] = merge(self.totals.get(name, TensorStats()), stats, iteration)

    def table(self) -> pd.DataFrame:
        rows = [_row(t, self.seen.get(t.name), self.totals.get(t.name), self.notes.get(t.name), self.tolerances) for t in self.tensors]
        table = pd.DataFrame(rows)
        table["int8_scale"] = [self.quant_ranges[t.name].scale if t.name in self.quant_ranges else np.nan for t in self.tensors]
        return table


_STAT_COLUMNS = list(TensorStats().as_row())


def _row(info: TensorInfo, seen: dict | None, stats: TensorStats | None, note: str | None, tolerances: Tolerances) -> dict:
    tol = tolerances.for_tensor(info.name)
    seen = seen or {}
    row = {
        "tensor": info.name,
        "node": info.node,
        "op_type": info.op_type,
        "is_output": info.is_output,
        "dtype": seen.get("dtype", str(info.dtype) if info.dtype is not None else ""),
        "cand_dtype": seen.get("cand_dtype", ""),
        "shape": seen.get("shape", ""),
        "atol": tol.atol,
        "rtol": tol.rtol,
        "stol": tol.stol,
    }
    row.update(stats.as_row() if stats is not None else {key: np.nan for key in _STAT_COLUMNS})
    shape_mismatch = bool(note) and bool(seen)
    if stats is None and not seen:
        row["status"] = STATUS_MISSING
    else:
        row["status"] = STATUS_FAIL if shape_mismatch or stats.outside_count else STATUS_PASS
    row["note"] = note or ""
    return row


def graph_input_table(info: ModelInfo, feeds: Sequence[Feed], quant_ranges: Mapping[str, QuantRange]) -> pd.DataFrame | None:
    """Range statistics of the floating-point graph inputs (they are fed, not computed, so never differ), for
    the range diagnosis: an input beyond 65504 overflows where a node reads it in FP16, and an input
    calibrated on a narrower range than it is fed clips in INT8 like any tensor."""
    floats = [TensorInfo(spec.name, "", "graph input", spec.dtype, False) for spec in info.inputs if np.issubdtype(spec.dtype, np.floating)]
    if not floats:
        return None
    aggregate = _Aggregate(floats, Tolerances(Tolerance(0.0, 0.0)), quant_ranges)
    for iteration, feed in enumerate(feeds):
        aggregate.add(feed, feed, iteration)
    return aggregate.table().set_index("tensor", drop=False)


SIDE_COLUMNS = ["max_abs_err", "tol_ratio", "sqnr_db", "outside_share", "status"]


def with_side_run(table: pd.DataFrame, other: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """Add another run's key statistics (isolated, or a second candidate) as `<prefix>_<column>`."""
    extra = other.set_index("tensor")[SIDE_COLUMNS].add_prefix(f"{prefix}_")
    return table.join(extra, on="tensor")
