"""The per-tensor table, in topological order, from the statistics the comparison worker returns.

Tensors align by exact name only: a tensor the candidate does not return is listed as not observed,
never matched to some other tensor by a fuzzy rule.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from accudiff.comparison.metrics import FIELDS, StatsSet, finish
from accudiff.comparison.tolerances import Tolerances
from accudiff.model.loading import InputSpec, TensorInfo
from accudiff.transforms.base import QuantRange

STATUS_PASS, STATUS_FAIL, STATUS_MISSING = "pass", "fail", "not observed"
SIDE_COLUMNS = ["max_abs_err", "tol_ratio", "sqnr_db", "outside_share", "status"]
_STAT_COLUMNS = list(finish(np.zeros(len(FIELDS)), np.zeros(1, np.int64)))


def build_table(
    tensors: Sequence[TensorInfo],
    stats: StatsSet,
    seen: Mapping[int, Sequence[str]],
    notes: Mapping[int, str],
    tolerances: Tolerances,
    quant_ranges: Mapping[str, QuantRange],
) -> pd.DataFrame:
    """One row per tensor: identity, dtypes, shape, tolerance, statistics over every sample, and status."""
    rows = []
    for index, info in enumerate(tensors):
        tol = tolerances.for_tensor(info.name)
        dtype, cand_dtype, shape = seen.get(index, (str(info.dtype) if info.dtype is not None else "", "", ""))
        row = {
            "tensor": info.name,
            "node": info.node,
            "op_type": info.op_type,
            "is_output": info.is_output,
            "dtype": dtype,
            "cand_dtype": cand_dtype,
            "shape": shape,
            "atol": tol.atol,
            "rtol": tol.rtol,
            "stol": tol.stol,
        }
        measured = stats.seen(index)
        row.update(stats.row(index) if measured else dict.fromkeys(_STAT_COLUMNS, np.nan))
        note = notes.get(index, "")
        shape_differs = note.startswith("shape differs")
        if not measured and not shape_differs:
            row["status"] = STATUS_MISSING
        else:
            row["status"] = STATUS_FAIL if shape_differs or row["outside_count"] else STATUS_PASS
        row["note"] = note
        rows.append(row)
    table = pd.DataFrame(rows)
    table["int8_scale"] = [quant_ranges[t.name].scale if t.name in quant_ranges else np.nan for t in tensors]
    return table


def graph_input_table(inputs: Sequence[InputSpec], stats: StatsSet, quant_ranges: Mapping[str, QuantRange]) -> pd.DataFrame | None:
    """Range statistics of the floating-point graph inputs (fed, not computed, so they never differ), for
    the range diagnosis: an input beyond 65504 overflows where a node reads it in FP16, and an input
    calibrated on a narrower range than it is fed clips in INT8 like any tensor."""
    if not inputs:
        return None
    infos = [TensorInfo(spec.name, "", "graph input", spec.dtype, False) for spec in inputs]
    seen = {i: (str(spec.dtype), str(spec.dtype), "") for i, spec in enumerate(inputs)}
    table = build_table(infos, stats, seen, {}, Tolerances.from_dict({"atol": 0, "rtol": 0, "stol": 0, "per_tensor": {}}), quant_ranges)
    return table.set_index("tensor", drop=False)


def with_side_run(table: pd.DataFrame, other: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """Add another run's key statistics (isolated, or a second candidate) as `<prefix>_<column>`."""
    extra = other.set_index("tensor")[SIDE_COLUMNS].add_prefix(f"{prefix}_")
    return table.join(extra, on="tensor")
