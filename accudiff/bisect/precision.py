"""A small set of nodes to keep in FP32 (for INT8: to leave unquantized) so the graph outputs meet tolerance.

1. One comparison with `isolate` ranks the nodes the transform converted by the error each makes on its
   own (lowest isolated SQNR first; failing ones first of all). That ranking is the table written out.
2. Keeping the top k nodes is tried for k found by bisection over the ranking (about log2(N) runs, not N):
   first the whole ranking (if even that fails, no keep-list of these nodes repairs the model), then
   halving towards the smallest k that passes.
3. The keep-list (node names as exact-match patterns, usable with --keep-fp32), the repaired model and
   the ranking are written out. The reference runs once for all of it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from accudiff.api import transform_model
from accudiff.bisect.session import BisectSession
from accudiff.comparison.table import STATUS_FAIL
from accudiff.model.loading import save_model
from accudiff.transforms.int8 import QUANTIZED_OPS

KEEP_LIST_FILE, RANKING_FILE = "keep_fp32.txt", "ranking.csv"


@dataclass
class PrecisionResult:
    passed_without_changes: bool
    keep: list[str] = field(default_factory=list)  # ONNX node names
    repaired: bool = False
    repaired_model: Path | None = None
    ranking: pd.DataFrame | None = None
    candidate_runs: int = 0
    bound: int = 0
    interrupted: bool = False


def bisect_precision(session: BisectSession, out_dir: Path) -> PrecisionResult:
    session.progress("step 1: compare the whole model (with isolated errors)")
    full = session.compare(isolate=True)
    result = PrecisionResult(passed_without_changes=full.passed)
    if full.passed:
        result.candidate_runs = session.candidate_runs
        return result
    ranking = _rank(full.table, session.precision, {k.node for k in full.kept})
    result.ranking = ranking
    result.bound = 2 + math.ceil(math.log2(max(len(ranking), 1))) + 1
    ranking.to_csv(out_dir / RANKING_FILE, index=False)
    nodes = list(ranking["node"])
    user_keep = list(session.options.get("keep_fp32", []))
    try:
        best = _smallest_passing_prefix(session, nodes, user_keep)
    except KeyboardInterrupt:
        result.interrupted = True
        best = None
    result.candidate_runs = session.candidate_runs
    if best is None:
        return result
    result.keep, result.repaired = nodes[:best], True
    ranking["kept"] = ranking["node"].isin(result.keep)
    ranking.to_csv(out_dir / RANKING_FILE, index=False)
    (out_dir / KEEP_LIST_FILE).write_text("".join(f"{keep_pattern(name)}\n" for name in result.keep))
    result.repaired_model = out_dir / f"repaired-{session.precision}.onnx"
    save_model(_repaired(session, user_keep + [keep_pattern(n) for n in result.keep]), result.repaired_model)
    return result


def keep_pattern(node: str) -> str:
    """A --keep-fp32 pattern that selects exactly this node name (names may hold regex characters)."""
    return re.escape(node)


def _rank(table: pd.DataFrame, precision: str, already_kept: set[str]) -> pd.DataFrame:
    """Converted nodes, worst isolated error first (one row per node: its worst output)."""
    rows = table[(table["status"] != "not observed") & ~table["node"].isin(already_kept)]
    if precision == "int8":
        rows = rows[rows["op_type"].isin(QUANTIZED_OPS)]
    else:  # FP16 values, and graph outputs (computed in FP16, then cast back to their FP32 type)
        rows = rows[(rows["cand_dtype"] == "float16") | (rows["is_output"] & (rows["dtype"] == "float32"))]
    rows = rows.assign(isolated_fails=rows["isolated_status"] == STATUS_FAIL)
    rows = rows.sort_values(["isolated_fails", "isolated_sqnr_db"], ascending=[False, True])
    ranked = rows.drop_duplicates("node")[["node", "op_type", "tensor", "isolated_fails", "isolated_sqnr_db", "sqnr_db", "status"]]
    ranked = ranked.rename(columns={"sqnr_db": "accumulated_sqnr_db", "status": "accumulated_status"}).reset_index(drop=True)
    ranked.insert(0, "rank", range(1, len(ranked) + 1))
    ranked["kept"] = False
    return ranked


def _smallest_passing_prefix(session: BisectSession, nodes: list[str], user_keep: list[str]) -> int | None:
    """Smallest k such that keeping nodes[:k] passes; None if keeping all of them still fails."""

    def passes(k: int, step: int, total: int) -> bool:
        session.progress(f"step {step} of about {total}: keep the top {k} node(s) in FP32")
        return session.compare(keep_fp32=user_keep + [keep_pattern(n) for n in nodes[:k]]).passed

    total = 2 + math.ceil(math.log2(max(len(nodes), 1)))
    if not nodes or not passes(len(nodes), 2, total):
        return None
    failing, passing, step = 0, len(nodes), 2
    while passing - failing > 1:
        middle = (failing + passing) // 2
        step += 1
        if passes(middle, step, total):
            passing = middle
        else:
            failing = middle
    return passing


def _repaired(session: BisectSession, keep: list[str]):
    """The transformed model with the keep-list applied, built as `compare --keep-fp32` builds it."""
    shapes = {spec.name: session.feeds[0][spec.name].shape for spec in session.info.inputs}
    options = session.options
    return transform_model(
        session.info, session.precision, shapes, options.get("calib_data"), keep, options.get("autokeep", True), session.seed
    ).model
