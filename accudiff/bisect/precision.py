"""A small set of nodes to keep in FP32 (for INT8: to leave unquantized) so the graph outputs meet tolerance.

1. One comparison with the isolated run names the cause of each failing output and ranks the converted
   nodes: the local causes first, then every other node by the error it makes on its own (how many
   tolerances its isolated error reaches). That ranking is the table written out.
2. Keeping the top k nodes is tried for k found by bisection over the ranking (about log2(N) runs, not N):
   first the whole ranking (if even that fails, no keep-list of these nodes repairs the model), then
   halving towards the smallest k that passes. A short passing list (up to PRUNE_LIMIT nodes) is then
   pruned: each node, lowest ranked first, is dropped if the rest still passes (one run each).
3. A keep-list is closed over precision boundaries before it is tried: a node kept in FP32 whose output
   exceeds 65504 would overflow where an FP16 consumer reads it, so such consumers are kept too.
4. The keep-list (node names as exact-match patterns, usable with --keep-fp32), the repaired model and
   the ranking are written out. The reference runs once for all of it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from accudiff.api import CompareResult, transform_model
from accudiff.bisect.session import BisectSession
from accudiff.diagnosis.cause import rank_contributors
from accudiff.model.loading import save_model
from accudiff.transforms.fp16 import FP16_MAX

KEEP_LIST_FILE, RANKING_FILE = "keep_fp32.txt", "ranking.csv"
PRUNE_LIMIT = 8


@dataclass
class PrecisionResult:
    passed_without_changes: bool
    keep: list[str] = field(default_factory=list)  # ONNX node names
    repaired: bool = False
    repaired_model: str | None = None  # file name, relative to the result folder
    ranking: pd.DataFrame | None = None
    candidate_runs: int = 0
    bound: int = 0
    interrupted: bool = False


def bisect_precision(session: BisectSession, out_dir: Path) -> PrecisionResult:
    session.progress("step 1: compare the whole model (with isolated errors) and name the causes")
    full = session.compare(isolate=True)
    result = PrecisionResult(passed_without_changes=full.passed)
    if full.passed:
        result.candidate_runs = session.candidate_runs
        return result
    ranking = rank(full)
    result.ranking = ranking
    result.bound = _run_bound(len(ranking))
    ranking.to_csv(out_dir / RANKING_FILE, index=False)
    boundaries = _Boundaries(session, full)
    user_keep = list(session.options.get("keep_fp32", []))
    try:
        best = _smallest_passing_prefix(session, list(ranking["node"]), boundaries, user_keep)
    except KeyboardInterrupt:
        result.interrupted = True
        best = None
    result.candidate_runs = session.candidate_runs
    if best is None:
        return result
    result.keep, result.repaired = best, True
    ranking["kept"] = ranking["node"].isin(result.keep)
    ranking.to_csv(out_dir / RANKING_FILE, index=False)
    (out_dir / KEEP_LIST_FILE).write_text("".join(f"{keep_pattern(name)}\n" for name in result.keep))
    result.repaired_model = f"repaired-{session.precision}.onnx"
    save_model(_repaired(session, user_keep + [keep_pattern(n) for n in result.keep]), out_dir / result.repaired_model)
    return result


def keep_pattern(node: str) -> str:
    """A --keep-fp32 pattern that selects exactly this node name (names may hold regex characters)."""
    return re.escape(node)


def rank(full: CompareResult) -> pd.DataFrame:
    """The converted nodes in the order to try keeping them: local causes first, then by own error."""
    table = full.table.set_index("tensor", drop=False)
    causes = [f.cause for f in full.output_failures if f.cause.kind == "local"]
    rows = [
        {"node": c.node, "op_type": c.op_type, "tensor": c.tensor, "why": "cause of a failing output"}
        for c in dict((c.node, c) for c in causes).values()
    ]
    named = {row["node"] for row in rows}
    rows += [
        {"node": c.node, "op_type": c.op_type, "tensor": c.tensor, "why": "own error (isolated run)"}
        for c in rank_contributors(table, full.converted)
        if c.node not in named
    ]
    ranked = pd.DataFrame(rows, columns=["node", "op_type", "tensor", "why"])
    for column in ("isolated_tol_ratio", "isolated_sqnr_db", "isolated_max_abs_err", "sqnr_db", "status"):
        ranked[column] = table.loc[ranked["tensor"], column].to_numpy() if len(ranked) else []
    ranked = ranked.rename(columns={"sqnr_db": "accumulated_sqnr_db", "status": "accumulated_status"})
    ranked.insert(0, "rank", range(1, len(ranked) + 1))
    ranked["kept"] = False
    return ranked


class _Boundaries:
    """Which FP16 consumers must join a keep-list: those reading a kept node's output beyond 65504."""

    def __init__(self, session: BisectSession, full: CompareResult):
        graph = session.info.proto.graph
        absmax = full.table.set_index("tensor")["ref_absmax"]
        self.overflowing = {
            node.name: [o for o in node.output if o in absmax.index and absmax[o] > FP16_MAX] for node in graph.node
        }
        self.consumers: dict[str, list[str]] = {}
        for node in graph.node:
            for name in node.input:
                if node.name in full.converted:
                    self.consumers.setdefault(name, []).append(node.name)
        self.active = session.precision == "fp16"

    def close(self, keep: list[str]) -> list[str]:
        closed, queue = list(keep), list(keep)
        while self.active and queue:
            for tensor in self.overflowing.get(queue.pop(), []):
                for consumer in self.consumers.get(tensor, []):
                    if consumer not in closed:
                        closed.append(consumer)
                        queue.append(consumer)
        return closed


def _smallest_passing_prefix(session: BisectSession, nodes: list[str], boundaries: _Boundaries, user_keep: list[str]) -> list[str] | None:
    """The keep-list of the smallest k such that keeping nodes[:k] (closed over boundaries) passes; None if
    keeping all of them still fails."""

    def passes(chosen: list[str], what: str) -> bool:
        keep = boundaries.close(chosen)
        session.progress(f"step {session.candidate_runs} of at most {total}: keep {len(keep)} node(s) in FP32 ({what} and what they need)")
        return session.compare(keep_fp32=user_keep + [keep_pattern(n) for n in keep]).passed

    total = _run_bound(len(nodes))
    if not nodes or not passes(nodes, f"all {len(nodes)} ranked"):
        return None
    failing, passing = 0, len(nodes)
    while passing - failing > 1:
        middle = (failing + passing) // 2
        if passes(nodes[:middle], f"the top {middle}"):
            passing = middle
        else:
            failing = middle
    chosen = nodes[:passing]
    if len(chosen) <= PRUNE_LIMIT:
        for node in reversed(chosen[1:]):
            rest = [n for n in chosen if n != node]
            if passes(rest, f"all but '{node}'"):
                chosen = rest
    return boundaries.close(chosen)


def _run_bound(ranked: int) -> int:
    """Candidate runs at most: the isolated comparison (2), all ranked kept, the bisection, the pruning."""
    return 3 + math.ceil(math.log2(max(ranked, 1))) + max(min(PRUNE_LIMIT, ranked) - 1, 0)


def _repaired(session: BisectSession, keep: list[str]):
    """The transformed model with the keep-list applied, built as `compare --keep-fp32` builds it."""
    options = session.options
    return transform_model(
        session.info, session.precision, session.feeds[0], options.get("calib_data"), keep, options.get("autokeep", True), session.seed
    ).model
