"""The suspects tried at a failing output (verify.py), in the order they are tried: the nodes the rules flag
upstream (range faults and NaN/Inf first, then weights and run-time ranges a grid loses, by strength), the
cancellations with what computes their operands, then the contributors by their own error and by where the
accumulated SQNR falls; each as a `Suspect`, read once it is tried, and said as a `Contributor`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from accudiff.diagnosis.cause import ancestor_tensors, flagged_nodes, rank_contributors
from accudiff.diagnosis.mechanisms import amplifiers, cancellations
from accudiff.diagnosis.rules import RANGE_KINDS, DiagnosisContext, grid_fault_strength, isolated_figures, isolation_ran, range_findings
from accudiff.findings import Contributor, Finding
from accudiff.judging.objective import decision_error
from accudiff.model.ops import VALUE_PRESERVING_OPS
from accudiff.verification.readings import Reading

CONTRIBUTORS_PER_RANKING = 3
SQNR_CAP = 200.0


@dataclass
class Suspect:
    node: str
    tensor: str
    op_type: str
    keep: list[str]
    findings: list[Finding]
    flagged: bool = False
    tried: list[str] = field(default_factory=list)  # the keep-list as tried (closed over boundaries)
    reading: Reading | None = None  # the output with it kept

    @property
    def score(self) -> float:
        return self.reading.score if self.reading is not None else math.inf

    @property
    def rank(self) -> tuple[float, float]:
        """How keeps are ordered, best first: by score, a tie broken by what the decision gets wrong (a ratio
        at its ceiling: every keep of a detector's map read 33.3x, the best then named by file order)."""
        error = decision_error(self.reading.figures) if self.reading is not None else None
        return self.score, math.inf if error is None else error


def nominate(output: str, table: pd.DataFrame, context: DiagnosisContext, rtol: float) -> list[Suspect]:
    """The suspects in the order they are tried (the budget may stop short of the last): nodes with range
    or NaN/Inf evidence, then the cancellations (with what computes their operands), then the nodes that
    only fail on their own (in a format as coarse as BF16, many do), then contributors by their own error
    and by where the accumulated error grows."""
    flagged = [Suspect(c.node, c.tensor, c.op_type, [c.node], c.findings, flagged=True) for c in flagged_nodes(output, table, context)]
    hard = [s for s in flagged if any(f.kind in RANGE_KINDS or f.kind.startswith("nan_inf") for f in s.findings)]
    found = list(hard)
    # A weight's scale zeroing channels, an input's run-time range set by a few values: faults whatever the
    # tolerance says of the node's own output (a tensor dominated by a few large values passes while its
    # small ones are lost). The strongest first.
    rows = table[table.index.isin(ancestor_tensors(output, context.upstream)) & table["node"].isin(context.converted)].drop_duplicates("node")
    graded = sorted(((grid_fault_strength(tensor, table, context), tensor, row) for tensor, row in rows.iterrows()), key=lambda item: -item[0])
    found += [Suspect(row["node"], tensor, row["op_type"], [row["node"]], range_findings(tensor, table, context), flagged=True)
              for strength, tensor, row in graded if strength > 0]
    for cancel in cancellations(output, table, context, rtol):
        found.append(Suspect(cancel.node, cancel.tensor, cancel.op_type, cancel.unit, [*cancel.findings, *amplifiers(cancel.tensor, output, table, context)]))
    found += [s for s in flagged if s not in hard]
    rows = table[table.index.isin(ancestor_tensors(output, context.upstream))]
    by_own_error = [(c.node, c.tensor, c.op_type) for c in rank_contributors(rows, context.converted)[:CONTRIBUTORS_PER_RANKING]]
    for node, tensor, op_type in _interleave(by_own_error, _by_sqnr_fall(rows, table, context)[:CONTRIBUTORS_PER_RANKING]):
        found.append(Suspect(node, tensor, op_type, [node], findings_of(tensor, table, context)))
    unique, seen = [], set()
    for suspect in found:
        if suspect.node not in seen and suspect.keep:
            seen.add(suspect.node)
            unique.append(suspect)
    return unique


def _by_sqnr_fall(rows: pd.DataFrame, table: pd.DataFrame, context: DiagnosisContext) -> list[tuple[str, str, str]]:
    """Converted nodes that compute, ordered by how far the accumulated SQNR falls from their inputs to
    their output: where error enters the path (graph inputs and weights count as exact)."""
    falls = []
    sqnr = table["sqnr_db"].to_dict()
    for tensor, row in zip(rows.index, rows[["node", "op_type", "sqnr_db"]].to_dict("records")):
        if row["node"] not in context.converted or row["op_type"] in VALUE_PRESERVING_OPS or not np.isfinite(row["sqnr_db"]):
            continue
        before = min((float(sqnr[n]) for n in context.upstream.get(tensor, []) if n in sqnr), default=SQNR_CAP)
        falls.append((min(before, SQNR_CAP) - float(row["sqnr_db"]), row["node"], tensor, row["op_type"]))
    falls.sort(key=lambda item: -item[0])
    return list(dict.fromkeys((node, tensor, op_type) for _, node, tensor, op_type in falls))


def _interleave(first: list, second: list) -> list:
    merged = []
    for pair in zip(first, second):
        merged += pair
    longer = first if len(first) > len(second) else second
    return merged + longer[min(len(first), len(second)) :]


def findings_of(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """What the rules say of the node writing `tensor`, found by a search rather than nominated by them: its
    range faults (a weight's scale, an input's run-time range), then its own error."""
    return [*range_findings(tensor, table, context), *own_error(table.loc[tensor])]


def own_error(row: pd.Series) -> list[Finding]:
    if "isolated_status" not in row.index or not isinstance(row["isolated_status"], str):
        return []
    return [Finding("own_error", f"its own rounding, fed the reference's values: {isolated_figures(row)}")]


def contributor(suspect: Suspect, table: pd.DataFrame) -> Contributor:
    row = table.loc[suspect.tensor]
    isolated = isolation_ran(table) and isinstance(row["isolated_status"], str)
    return Contributor(
        suspect.node,
        suspect.op_type,
        suspect.tensor,
        float(row["isolated_sqnr_db"]) if isolated else math.nan,
        float(row["isolated_max_abs_err"]) if isolated else math.nan,
        float(row["isolated_tol_ratio"]) if isolated else math.nan,
        suspect.findings,
        tol_ratio_kept=suspect.reading.tol_ratio if suspect.reading else math.inf,
        keep=suspect.tried,
        figures_kept=suspect.reading.figures if suspect.reading else {},
    )
