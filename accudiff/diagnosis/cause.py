"""The cause of a failing output: the node that introduces the error, or the nodes whose errors add up.

The first tensor out of tolerance is often not the cause: small rounding carried through a network pushes
some harmless tensor (a Clip whose tolerance shrinks with its range) over the line long before the node
that breaks the output. So the cause is sought among the output's ancestors, in topological order:

* `local` — the first node that introduces error: fed the reference's values it still leaves tolerance
  (the isolated run), or it turns finite inputs into NaN/Inf. Without the isolated run, only range faults
  with a failing output count as evidence (its constant became Inf, its own value or an input it reads in
  FP16 exceeds 65504).
* `accumulated` — no node fails on its own: the error builds up over many nodes. The contributors (the
  converted nodes with the largest isolated error) say where to look, and `accudiff bisect precision`
  finds which of them to keep in higher precision.
* `unknown` — without the isolated run and without range evidence, local and accumulated error cannot
  be told apart; the report says so instead of guessing.

What these rules name is a hypothesis: an overflow that a later Tanh absorbs changes nothing at the
output. verification/verify.py tests each suspect at the output and may name another node, several
(`several`), or confirm the error accumulates; `Cause.verified` says whether that was done.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from accudiff.judging.table import STATUS_FAIL
from accudiff.diagnosis.rules import (
    RANGE_KINDS,
    DiagnosisContext,
    isolated_figures,
    isolation_ran,
    new_non_finite,
    range_findings,
)
from accudiff.findings import Cause, Contributor, Finding
from accudiff.model.ops import VALUE_PRESERVING_OPS

CONTRIBUTOR_COUNT = 5
HARD_RANGE_KINDS = frozenset({"overflow", "input_overflow", "constant_overflow"})


def find_cause(output: str, table: pd.DataFrame, context: DiagnosisContext) -> Cause:
    """The cause of `output`'s failure by the rules alone (`table` is indexed by tensor name, in
    topological order): the first flagged node upstream."""
    ancestors = ancestor_tensors(output, context.upstream)
    contributors = [
        replace(c, findings=range_findings(c.tensor, table, context))
        for c in rank_contributors(table[table.index.isin(ancestors)], context.converted)[:CONTRIBUTOR_COUNT]
    ]
    flagged = flagged_nodes(output, table, context)
    if flagged:
        return replace(flagged[0], contributors=contributors)
    return Cause("accumulated" if isolation_ran(table) else "unknown", contributors=contributors)


def flagged_nodes(output: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Cause]:
    """Every node upstream of `output` with evidence that it introduces error itself, in topological
    order, each as a local cause (the suspects verification tests)."""
    rows = table[table.index.isin(ancestor_tensors(output, context.upstream))]
    if isolation_ran(table):  # only a node whose output fails alone or turns finite values into NaN/Inf can introduce error
        suspect = (rows["isolated_status"] == STATUS_FAIL) | (rows["cand_nan"] > rows["ref_nan"]) | (rows["cand_inf"] > rows["ref_inf"])
        rows = rows[rows["node"].isin(set(rows.loc[suspect, "node"]))]
    flagged = []
    for node, node_rows in rows.groupby("node", sort=False):
        findings = _introduced_error(node_rows, table, context)
        if findings:
            first = node_rows.iloc[0]
            failing = node_rows[node_rows["status"] == STATUS_FAIL]
            tensor = (failing.iloc[0] if len(failing) else first)["tensor"]
            flagged.append(Cause("local", str(node), tensor, first["op_type"], findings))
    return flagged


def rank_contributors(rows: pd.DataFrame, converted: frozenset[str]) -> list[Contributor]:
    """Converted nodes that compute (not just move values), noisiest first: lowest isolated SQNR (their own
    error relative to their own signal, whatever their scale: an underflowing tensor can sit within its
    absolute tolerance and still lose half its bits), then how many tolerances it reaches. One entry
    per node (its worst output)."""
    if not isolation_ran(rows):
        return []
    candidates = rows[rows["node"].isin(converted) & ~rows["op_type"].isin(VALUE_PRESERVING_OPS) & rows["isolated_status"].notna()]
    ordered = candidates.sort_values(["isolated_sqnr_db", "isolated_tol_ratio"], ascending=[True, False]).drop_duplicates("node")
    return [
        Contributor(r["node"], r["op_type"], r["tensor"], float(r["isolated_sqnr_db"]), float(r["isolated_max_abs_err"]), float(r["isolated_tol_ratio"]))
        for r in ordered.to_dict("records")  # iterrows builds a Series per row: seconds on large models
    ]


def ancestor_tensors(tensor: str, upstream: dict[str, list[str]]) -> set[str]:
    """`tensor` and every tensor it depends on."""
    seen, stack = {tensor}, [tensor]
    while stack:
        for parent in upstream.get(stack.pop(), []):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _introduced_error(rows: pd.DataFrame, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """The evidence that this node (its output rows) introduces error itself; empty when there is none."""
    findings: list[Finding] = []
    for tensor in rows.index:
        findings += [f for f in range_findings(tensor, table, context) if f not in findings]
    nan_origin = [
        Finding("nan_inf_origin", f"its output '{t}' has NaN/Inf in the candidate ({_non_finite_counts(table.loc[t])}) although "
                                  + ("the activations it reads are finite" if any(f.kind == "constant_overflow" for f in findings) else "its inputs are finite"))
        for t in rows.index
        if new_non_finite(table.loc[t]) and not any(new_non_finite(table.loc[i]) for i in context.inputs_of(t, table) if i in table.index)
    ]
    moves_values = rows.iloc[0]["op_type"] in VALUE_PRESERVING_OPS
    if isolation_ran(table):
        isolated_failures = rows[rows["isolated_status"] == STATUS_FAIL]
        if not len(isolated_failures) and not nan_origin:
            return []
        if moves_values and not any(f.kind in RANGE_KINDS for f in findings) and not nan_origin:
            return []  # an op that only moves values adds no rounding: its input's storage is to blame upstream
        findings += nan_origin
        if len(isolated_failures):
            figures = isolated_figures(isolated_failures.iloc[0])
            if findings:
                findings.append(Finding("isolated", f"fed the reference's values, it still leaves tolerance on its own: {figures}"))
            else:
                findings.append(Finding("rounding", f"no range fault explains it: fed the reference's values, its own rounding leaves tolerance: {figures}"))
        return findings
    if nan_origin:
        return findings + nan_origin
    fails = bool((rows["status"] == STATUS_FAIL).any())
    return findings if fails and any(f.kind in HARD_RANGE_KINDS for f in findings) else []


def _non_finite_counts(row: pd.Series) -> str:
    return f"{int(row['cand_nan'])} NaN and {int(row['cand_inf'])} Inf, the reference {int(row['ref_nan'])} and {int(row['ref_inf'])}"
