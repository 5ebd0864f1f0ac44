"""The per-tensor table, in topological order, from the statistics the comparison worker returns.

Tensors align by exact name only: a tensor the candidate does not return is listed as not observed,
never matched to some other tensor by a fuzzy rule.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from accudiff.judging.metrics import F, StatsSet, finish_rows
from accudiff.judging.tolerances import Tolerances
from accudiff.model.inventory import InputSpec, TensorInfo
from accudiff.model.formats import QuantRange

STATUS_PASS, STATUS_FAIL, STATUS_MISSING = "pass", "fail", "not observed"
SIDE_COLUMNS = ["max_abs_err", "tol_ratio", "sqnr_db", "outside_share", "status"]


def build_table(
    tensors: Sequence[TensorInfo],
    stats: StatsSet,
    seen: Mapping[int, Sequence[str]],
    notes: Mapping[int, str],
    tolerances: Tolerances,
    quant_ranges: Mapping[str, QuantRange],
) -> pd.DataFrame:
    """One row per tensor: identity, dtypes, shape, tolerance, statistics over every sample, and status."""
    count = len(tensors)
    tol = [tolerances.for_tensor(info.name) for info in tensors]
    described = [seen.get(index, (str(info.dtype) if info.dtype is not None else "", "", "")) for index, info in enumerate(tensors)]
    columns = {
        "tensor": [info.name for info in tensors],
        "node": [info.node for info in tensors],
        "op_type": [info.op_type for info in tensors],
        "is_output": np.array([info.is_output for info in tensors], bool),
        "dtype": [d[0] for d in described],
        "cand_dtype": [d[1] for d in described],
        "shape": [d[2] for d in described],
        "atol": np.array([t.atol for t in tol], float),
        "rtol": np.array([t.rtol for t in tol], float),
        "stol": np.array([t.stol for t in tol], float),
    }
    derived = finish_rows(stats.values[:count], stats.sketch[:count])
    measured = stats.values[:count, F["samples"]] > 0
    if not measured.all():  # a tensor never measured has no statistics (its integer columns become float)
        derived = {name: np.where(measured, value, np.nan) for name, value in derived.items()}
    columns.update(derived)
    note = [notes.get(index, "") for index in range(count)]
    shape_differs = np.array([n.startswith("shape differs") for n in note], bool)
    status = np.where(shape_differs | (np.nan_to_num(derived["outside_count"]) > 0), STATUS_FAIL, STATUS_PASS)
    columns["status"] = np.where(~measured & ~shape_differs, STATUS_MISSING, status).astype(object)
    columns["note"] = note
    table = pd.DataFrame(columns)
    table["int8_scale"] = [quant_ranges[t.name].scale if t.name in quant_ranges and not quant_ranges[t.name].levels else np.nan for t in tensors]
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
