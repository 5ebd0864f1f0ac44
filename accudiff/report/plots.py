"""The report's plots, as static SVG text (report/svg.py): no JavaScript, no network, no plotting library.

Each function takes what the comparison measured and returns one `<svg>` element, or None when there is
nothing to draw.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from accudiff.judging.metrics import SQNR_CAP_DB, error_histogram
from accudiff.report.svg import Chart, short

ABSORBER_LABEL = 28  # characters of an absorbing node's name on the plot (the end; hovering shows it whole)
MAX_HOVER = 3000  # points of the error's path given a name on hover (failing ones always): the page stays small
FAIL_COLOUR, KEPT_COLOUR, CAUSE_COLOUR, LINE_COLOUR, ISOLATED_COLOUR, ABSORBED_COLOUR = "#c62828", "#6a1b9a", "#ef6c00", "#1565c0", "#2e7d32", "#757575"


def error_path(
    table: pd.DataFrame, causes: Sequence[tuple[str, str]], kept_nodes: Sequence[str], absorbed: Sequence[tuple[str, str | None, tuple[str, str] | None]] = ()
) -> str | None:
    """SQNR of every compared float tensor along topological order: accumulated (the normal run) and
    isolated (each node fed the reference). Marked: failing tensors, nodes kept in FP32, `causes` as
    (tensor, label) and ruled-out drops (`absorbed`) as (flagged tensor, the tensor of the node across which
    the error its path carries shrinks or None, (op type, name) of that node or None): a flagged node whose
    keep alone leaves the output failing is not the cause."""
    rows = table.reset_index(drop=True)
    sqnr = rows["sqnr_db"].clip(-SQNR_CAP_DB, SQNR_CAP_DB).to_numpy(np.float64)
    measured = np.isfinite(sqnr)
    if not measured.any():
        return None
    isolated = rows["isolated_sqnr_db"].clip(-SQNR_CAP_DB, SQNR_CAP_DB).to_numpy(np.float64) if "isolated_sqnr_db" in rows else np.full(len(rows), np.nan)
    shown = np.concatenate([sqnr[measured], isolated[np.isfinite(isolated)]])
    position = np.arange(len(rows), dtype=np.float64)
    chart = Chart(900, 380, (0, max(len(rows) - 1, 1)), (float(shown.min()), float(shown.max())))
    chart.x_label, chart.y_label = "tensor, in topological order (hover a point for its name)", "SQNR (dB)"
    chart.name_x(rows["tensor"].astype(str).tolist())
    chart.line(position[measured], sqnr[measured], LINE_COLOUR, "accumulated (normal run)")
    finite_isolated = np.isfinite(isolated)
    chart.line(position[finite_isolated], isolated[finite_isolated], ISOLATED_COLOUR, "isolated (fed the reference)", width=1.0)
    failing = (rows["status"] == "fail").to_numpy() & measured
    chart.markers(position[failing], sqnr[failing], FAIL_COLOUR, "out of tolerance")
    kept = rows["node"].isin(list(kept_nodes)).to_numpy() & measured
    chart.markers(position[kept], sqnr[kept], KEPT_COLOUR, "kept in FP32", shape="square", size=4)
    where = {name: k for k, name in reversed(list(enumerate(rows["tensor"])))}  # each tensor's first row
    drops = [(where[t], where.get(r) if r else None, by) for t, r, by in absorbed if t in where and measured[where[t]]]
    labelled = set()
    for start, end, by in drops:
        if end is not None and measured[end]:
            chart.line([start, end], [sqnr[start], sqnr[end]], ABSORBED_COLOUR, dash="2,2")
        if by not in labelled:  # several drops one node absorbs: one label, at the first
            labelled.add(by)
            said, whole = (f"shrinks across {by[0]} '{short(by[1], ABSORBER_LABEL)}'", f"the error shrinks across {by[0]} '{by[1]}'") if by else ("ruled out", "")
            chart.note(start, sqnr[start], said, ABSORBED_COLOUR, whole)
    chart.markers([d[0] for d in drops], [sqnr[d[0]] for d in drops], ABSORBED_COLOUR, "ruled out: kept alone, the output still fails", shape="cross", size=4)
    for name, label in causes:
        if name in where:
            chart.vline(where[name], CAUSE_COLOUR, f"{label}: {short(name)}")
    named = _hovered(measured, failing)
    chart.hover(position[named], sqnr[named], [_point_title(row) for row in rows[named].to_dict("records")])
    return chart.render()


def _hovered(measured: np.ndarray, failing: np.ndarray) -> np.ndarray:
    """The points that get a name on hover: all, or past MAX_HOVER the failing ones and an even spread."""
    if measured.sum() <= MAX_HOVER:
        return measured
    spread = np.zeros_like(measured)
    spread[np.flatnonzero(measured)[np.linspace(0, measured.sum() - 1, MAX_HOVER).astype(int)]] = True
    return spread | failing


def _point_title(row: dict) -> str:
    isolated = f", isolated {row['isolated_sqnr_db']:.1f} dB" if pd.notna(row.get("isolated_sqnr_db")) else ""
    return f"{row['tensor']} ({row['op_type']}): SQNR {row['sqnr_db']:.1f} dB{isolated}, {row['status']}"


def error_distribution(sketch: np.ndarray, name: str, non_finite: int = 0) -> str | None:
    """Histogram of the absolute error of every element (one bar per octave, from the sketch); elements
    where either side is NaN/Inf have no finite error and are counted in the title instead. None when no
    finite error is above 0: empty axes would say nothing (the caller says it in words)."""
    edges, counts, zeros = error_histogram(sketch)
    if not counts.size:
        return None
    extra = f", {non_finite} NaN/Inf not shown" if non_finite else ""
    chart = Chart(460, 290, (edges[0], edges[-1]), (0, float(counts.max())), x_log=True)
    chart.title = f"{short(name, 36)}: absolute error ({zeros} exact{extra})"
    chart.x_label, chart.y_label = "|candidate - reference|", "elements"
    chart.bars(edges[:-1], edges[1:], counts, LINE_COLOUR)
    return chart.render()


def candidate_vs_reference(points: Sequence[Sequence[float]], name: str) -> str | None:
    """Candidate against reference for sampled elements; non-finite candidates drawn at the plot's top edge,
    above their reference values (which the axes cover too)."""
    if not points:
        return None
    pairs = np.asarray(points, np.float64)
    ref, cand = pairs[:, 0], pairs[:, 1]
    finite = np.isfinite(ref) & np.isfinite(cand)
    broken = ~np.isfinite(cand) & np.isfinite(ref)
    values = np.concatenate([ref[finite], cand[finite], ref[broken]])
    if not values.size:
        values = np.array([0.0, 1.0])
    low, high = float(values.min()), float(values.max())
    chart = Chart(400, 340, (low, high), (low, high))
    chart.title = f"{short(name, 36)}: {len(pairs)} sampled elements"
    chart.x_label, chart.y_label = "reference", "candidate"
    edge_low, edge_high = chart.y_low, chart.y_high  # the axes' ends (a range of one value is widened)
    chart.line([edge_low, edge_high], [edge_low, edge_high], ABSORBED_COLOUR, dash="2,3", width=0.8)
    chart.markers(ref[finite], cand[finite], LINE_COLOUR, size=1.6)
    chart.markers(ref[broken], np.full(int(broken.sum()), edge_high), FAIL_COLOUR, "candidate NaN/Inf", shape="cross")
    return chart.render()


def by_step(samples: pd.DataFrame, phases: dict) -> str | None:
    """A decoder's KL divergence (mean over prompts) at its prefill and at each decode step, per output of
    token scores: whether the candidate's error grows as its own KV cache carries it."""
    chart, drawn = None, False
    for output in phases:
        rows = samples[(samples["tensor"] == output) & (samples["rows"] > 0)]
        if rows.empty or "step" not in rows:
            continue
        per_step = rows.groupby("step").agg(kl=("kl_sum", "sum"), positions=("rows", "sum"))
        mean = (per_step["kl"] / per_step["positions"]).to_numpy(np.float64)
        steps = per_step.index.to_numpy(np.float64)
        if not np.isfinite(mean).any():
            continue
        if chart is None:
            chart = Chart(900, 260, (0, max(float(steps.max()), 1.0)), (0.0, float(np.nanmax(mean[np.isfinite(mean)])) or 1.0))
            chart.x_label, chart.y_label = "step (0: the prefill, then each decode step)", "KL divergence, mean over prompts"
        chart.line(steps, mean, LINE_COLOUR, f"'{short(output)}'")
        chart.markers(steps, mean, LINE_COLOUR, "", size=3)
        drawn = True
    return chart.render() if drawn else None
