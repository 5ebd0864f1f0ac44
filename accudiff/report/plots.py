"""The report's plots as static SVG text, drawn by matplotlib (an optional extra: `pip install
'accudiff[plots]'`). Static SVG needs no JavaScript and no network; without matplotlib every function
returns None and the report shows tables instead, with a notice.

Text stays text (svg.fonttype none: small, searchable); dense point clouds are rasterized inside the SVG
so a plot's size does not grow with the number of points.
"""

from __future__ import annotations

import functools
import io
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from accudiff.comparison.metrics import SQNR_CAP_DB, error_histogram

MISSING_NOTICE = "plots need matplotlib (pip install 'accudiff[plots]'): tables are shown instead"
STYLE = {"svg.fonttype": "none", "svg.hashsalt": "accudiff", "font.size": 9}  # text stays text; stable ids
FAIL_COLOUR, KEPT_COLOUR, CAUSE_COLOUR, LINE_COLOUR, ISOLATED_COLOUR = "#c62828", "#6a1b9a", "#ef6c00", "#1565c0", "#2e7d32"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _styled(draw: Callable[..., str | None]) -> Callable[..., str | None]:
    """`draw` run with the report's matplotlib settings (restored after), or None without matplotlib."""

    @functools.wraps(draw)
    def styled(*args, **kwargs) -> str | None:
        if not available():
            return None
        import matplotlib

        with matplotlib.rc_context(STYLE):
            return draw(*args, **kwargs)

    return styled


@_styled
def error_path(table: pd.DataFrame, causes: Sequence[str], kept_nodes: Sequence[str]) -> str | None:
    """SQNR of every compared float tensor along topological order: accumulated (the normal run) and
    isolated (each node fed the reference); failing tensors, nodes kept in FP32 and the causes marked."""
    rows = table.reset_index(drop=True)
    position = np.arange(len(rows))
    measured = rows["sqnr_db"].notna().to_numpy()
    figure = _figure(figsize=(11, 3.6))
    axes = figure.subplots()
    axes.plot(position[measured], rows.loc[measured, "sqnr_db"].clip(-SQNR_CAP_DB, SQNR_CAP_DB), color=LINE_COLOUR, lw=1.2, label="accumulated (normal run)")
    if "isolated_sqnr_db" in rows:
        isolated = rows["isolated_sqnr_db"].notna().to_numpy()
        axes.plot(position[isolated], rows.loc[isolated, "isolated_sqnr_db"].clip(-SQNR_CAP_DB, SQNR_CAP_DB), color=ISOLATED_COLOUR, lw=1, alpha=0.8,
                  label="isolated (fed the reference)")
    failing = (rows["status"] == "fail").to_numpy() & measured
    axes.scatter(position[failing], rows.loc[failing, "sqnr_db"].clip(-SQNR_CAP_DB, SQNR_CAP_DB), color=FAIL_COLOUR, s=14, zorder=3, label="out of tolerance")
    kept = rows["node"].isin(list(kept_nodes)).to_numpy() & measured
    if kept.any():
        axes.scatter(position[kept], rows.loc[kept, "sqnr_db"].clip(-SQNR_CAP_DB, SQNR_CAP_DB), marker="s", facecolors="none", edgecolors=KEPT_COLOUR, s=30,
                     zorder=4, label="kept in FP32")
    for name in causes:
        match = np.flatnonzero(rows["tensor"].to_numpy() == name)
        if match.size:
            axes.axvline(match[0], color=CAUSE_COLOUR, lw=1.5, ls="--", zorder=2)
            axes.annotate(f"cause: {_short(name)}", (match[0], axes.get_ylim()[1]), xytext=(4, -12), textcoords="offset points", color=CAUSE_COLOUR, fontsize=8)
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("tensor, in topological order")
    axes.set_ylabel("SQNR (dB)")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower left", bbox_to_anchor=(0, 1.01), fontsize=8, ncol=4, frameon=False)
    return _svg(figure)


@_styled
def error_distribution(sketch: np.ndarray, name: str, non_finite: int = 0) -> str | None:
    """Histogram of the absolute error of every element (one bar per octave, from the sketch); elements
    where either side is NaN/Inf have no finite error and are counted in the title instead."""
    edges, counts, zeros = error_histogram(sketch)
    figure = _figure(figsize=(5.2, 3.2))
    axes = figure.subplots()
    if counts.size:
        axes.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color=LINE_COLOUR, edgecolor="white", lw=0.5)
        axes.set_xscale("log")
    axes.set_xlabel("|candidate - reference|")
    axes.set_ylabel("elements")
    extra = f", {non_finite} NaN/Inf not shown" if non_finite else ""
    axes.set_title(f"{_short(name)}: absolute error ({zeros} exact{extra})", fontsize=9)
    axes.grid(alpha=0.3)
    return _svg(figure)


@_styled
def candidate_vs_reference(points: Sequence[Sequence[float]], name: str) -> str | None:
    """Candidate against reference for sampled elements; non-finite candidates drawn at the plot's edge."""
    if not points:
        return None
    pairs = np.asarray(points, np.float64)
    ref, cand = pairs[:, 0], pairs[:, 1]
    finite = np.isfinite(ref) & np.isfinite(cand)
    figure = _figure(figsize=(4.4, 3.8))
    axes = figure.subplots()
    axes.scatter(ref[finite], cand[finite], s=5, alpha=0.6, color=LINE_COLOUR, rasterized=True)
    if finite.any():
        low, high = float(min(ref[finite].min(), cand[finite].min())), float(max(ref[finite].max(), cand[finite].max()))
        axes.plot([low, high], [low, high], color="#757575", lw=0.8, ls=":")
        broken = ~np.isfinite(cand) & np.isfinite(ref)
        if broken.any():
            axes.scatter(ref[broken], np.full(broken.sum(), high), marker="x", color=FAIL_COLOUR, s=16, label="candidate NaN/Inf")
            axes.legend(fontsize=8, loc="upper left")
    axes.set_xlabel("reference")
    axes.set_ylabel("candidate")
    axes.set_title(f"{_short(name)}: {len(pairs)} sampled elements", fontsize=9)
    axes.grid(alpha=0.3)
    return _svg(figure)


def _figure(**options):
    """A figure of matplotlib's object API. No pyplot: the caller's backend and global state stay as they
    were (the pytest plugin runs inside a user's test session), and it imports faster."""
    from matplotlib.figure import Figure

    return Figure(**options)


def _svg(figure) -> str:
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    buffer = io.StringIO()
    FigureCanvasSVG(figure)
    figure.tight_layout()
    figure.savefig(buffer, format="svg", dpi=110, metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # the XML prolog and doctype do not belong inside HTML


def _short(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else "..." + name[-(limit - 3):]
