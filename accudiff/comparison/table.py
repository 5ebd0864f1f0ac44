"""Run reference and candidate on each feed and build the per-tensor table, in topological order.

Tensors align by exact name only: a tensor the candidate does not return is listed as not observed,
never matched to some other tensor by a fuzzy rule.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import pandas as pd

from accudiff.comparison.metrics import TensorStats, measure, merge
from accudiff.comparison.tolerances import Tolerances
from accudiff.model.inputs import Feed
from accudiff.model.loading import TensorInfo
from accudiff.runners.base import Runner
from accudiff.transforms.base import QuantRange

Progress = Callable[[int, int], None]

STATUS_PASS, STATUS_FAIL, STATUS_MISSING = "pass", "fail", "not observed"


def compare_runs(
    tensors: list[TensorInfo],
    reference: Runner,
    candidate: Runner,
    feeds: list[Feed],
    tolerances: Tolerances,
    quant_ranges: Mapping[str, QuantRange] | None = None,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """One row per tensor: identity, dtypes, shape, statistics aggregated over all feeds, and status."""
    quant_ranges = quant_ranges or {}
    totals: dict[str, TensorStats] = {}
    seen: dict[str, dict] = {}
    notes: dict[str, str] = {}
    for iteration, feed in enumerate(feeds):
        ref_out = reference.infer(feed)
        cand_out = candidate.infer(feed)
        for info in tensors:
            name = info.name
            if name not in ref_out or name not in cand_out:
                notes[name] = "not returned by the reference" if name not in ref_out else "not returned by the candidate"
                continue
            ref, cand = ref_out[name], cand_out[name]
            seen[name] = {"dtype": str(ref.dtype), "cand_dtype": str(cand.dtype), "shape": "x".join(map(str, ref.shape))}
            if ref.shape != cand.shape:
                notes[name] = f"shape differs: reference {ref.shape}, candidate {cand.shape}"
                continue
            stats = measure(ref, cand, tolerances.for_tensor(name), quant_ranges.get(name))
            totals[name] = merge(totals.get(name, TensorStats()), stats, iteration)
        if progress is not None:
            progress(iteration + 1, len(feeds))
    table = pd.DataFrame([_row(info, seen.get(info.name), totals.get(info.name), notes.get(info.name), tolerances) for info in tensors])
    table["int8_scale"] = [quant_ranges[t.name].scale if t.name in quant_ranges else np.nan for t in tensors]
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
