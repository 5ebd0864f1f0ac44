"""Numerical mechanisms a numerical analyst would name, read from the statistics table with their figures.

* cancellation: an Add/Sub whose result is much smaller than its operands. Each operand carries FP16's
  rounding (2^-11 of its size); relative to the result that error is amplified by (|a|+|b|)/|a±b| (against
  a weight, |a|/|a±b|: only the computed operand counts). The classic case is a variance computed as
  E[x²] − E[x]².
* amplifiers: ops downstream that grow a small relative error (Reciprocal, Sqrt, Div, Exp, Pow, Log):
  where the accumulated SQNR falls across such a node, it is named with the drop.
* absorption: a node whose error a later node measurably undoes: the first node downstream, reading a
  value that carries the error, across which it shrinks (NaN/Inf turned back into finite values, as a
  saturating Tanh, Sigmoid, Min/Clip or Softmax does, or the Q/DQ pair before it, which puts them on its grid;
  or the mean error at least halved while the SQNR rises by ABSORBED_DB or more, by a node that does more
  than move values, and that the error cannot go around), named with that evidence.
These are findings to explain a cause, never a cause on their own: verify.py decides what matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pandas as pd

from accudiff.diagnosis.cause import ancestor_tensors
from accudiff.findings import Finding
from accudiff.diagnosis.rules import DiagnosisContext, absorption, new_non_finite

AMPLIFYING_OPS = frozenset({"Reciprocal", "Sqrt", "Div", "Exp", "Pow", "Log"})
SATURATING_OPS = frozenset({"Tanh", "Sigmoid", "HardSigmoid", "Min", "Clip", "Softmax", "LogSoftmax", "Erf", "Relu"})
AMPLIFIER_DROP_DB = 6.0  # an SQNR fall of at least this across one node is worth naming
ABSORBED_DB = 6.0  # ... and a rise of at least this, an error undone
# Ops that only rearrange or join values: each element they hand on carries the error it had. Their mean error
# can still read lower than their input's (YOLOv8's last Concat joins its boxes, off by 5.8, to its class
# scores, off by thousandths), but nothing is undone there.
MOVING_OPS = frozenset({"Concat", "DepthToSpace", "Expand", "Flatten", "Identity", "Pad", "Reshape", "SpaceToDepth", "Split", "Squeeze",
                        "Tile", "Transpose", "Unsqueeze"})
MAX_UNIT_NODES = 12


@dataclass(frozen=True)
class Cancellation:
    """An Add/Sub that cancels: the node, the finding with its figures, and the nodes that compute its
    operands from their common source (keeping those in FP32 is what removes the cancellation's error)."""

    node: str
    tensor: str
    op_type: str
    findings: list[Finding]  # the cancellation's, then what its operands lost before it (absorption)
    unit: list[str]


def cancellations(output: str, table: pd.DataFrame, context: DiagnosisContext, rtol: float) -> list[Cancellation]:
    """Add/Sub nodes upstream of `output` whose operands' rounding, amplified by cancellation, exceeds `rtol`
    of the result (`table` indexed by tensor, topological order)."""
    if context.roundoff is None:
        return []
    roundoff, fmt = context.roundoff  # of the coarsest float format the candidate stores values in
    written = f"2^{round(math.log2(roundoff))}"
    ancestors = ancestor_tensors(output, context.upstream)
    found = []
    for tensor, row in table[table.index.isin(ancestors) & table["op_type"].isin(["Add", "Sub"])].iterrows():
        if row["node"] not in context.converted or not row["ref_absmax"] > 0:
            continue
        # A weight or graph input operand has no row: only the computed operands' rounding is counted.
        operands = [name for name in context.upstream.get(tensor, []) if name in table.index]
        if not 1 <= len(operands) <= 2:
            continue
        sizes = [float(table.loc[name, "ref_absmax"]) for name in operands]
        amplification = sum(sizes) / float(row["ref_absmax"])
        if amplification * roundoff < rtol:
            continue
        form = "the variance computed as E[x²] − E[x]² cancels" if any(_is_square(name, table, context) for name in operands) else "it cancels"
        reach = f"its operands reach {sizes[0]:.3g} and {sizes[1]:.3g}" if len(sizes) == 2 else (
            f"its operand '{operands[0]}' reaches {sizes[0]:.3g} (the other is a weight or a graph input)")
        message = (
            f"{form}: {reach}, its result only {row['ref_absmax']:.3g}, so {fmt}'s rounding of what it reads "
            f"({written} of its size) is amplified {amplification:.0f}x, to {amplification * roundoff:.1%} of the result (tolerance rtol {rtol:g})"
        )
        lost = [f for name in operands for f in absorption(name, table, context)]
        found.append(Cancellation(row["node"], tensor, row["op_type"], [Finding("cancellation", message), *lost], _operand_unit(tensor, operands, table, context)))
    return found


def amplifiers(start: str, output: str, table: pd.DataFrame, context: DiagnosisContext, limit: int = 2) -> list[Finding]:
    """Amplifying ops on the way from `start` to `output` across which the accumulated SQNR falls."""
    findings = []
    for tensor, row in _path_rows(start, output, table, context).iterrows():
        if row["op_type"] not in AMPLIFYING_OPS:
            continue
        inputs = [name for name in context.upstream.get(tensor, []) if name in table.index]
        before = min((float(table.loc[name, "sqnr_db"]) for name in inputs), default=float("nan"))
        if before - float(row["sqnr_db"]) >= AMPLIFIER_DROP_DB:
            findings.append(
                Finding("amplified", f"then amplified by {row['op_type']} '{row['node']}': accumulated SQNR {before:.1f} dB before it, {row['sqnr_db']:.1f} dB after")
            )
            if len(findings) == limit:
                break
    return findings


def absorber(start: str, output: str, table: pd.DataFrame, context: DiagnosisContext) -> tuple[str, str, str] | None:
    """(node, op type, the evidence in words) of the first node after `start` on the way to `output` that
    measurably undoes what it reads of `start`'s error (see the module's docstring); None where none does.
    A node is judged against the inputs it reads on the path (the values that carry the error)."""
    path = _path_rows(start, output, table, context)
    carrying = {start, *path.index}
    columns = ["dtype", "node", "op_type", "sqnr_db", "mean_abs_err", "cand_nan", "ref_nan", "cand_inf", "ref_inf"]
    rows = table.loc[table.index.isin(carrying), columns].to_dict("index")  # read as dicts: a row looked up in pandas costs ~0.1 ms
    for tensor in path.index:
        row = rows[tensor]
        if "float" not in str(row["dtype"]):
            continue  # a shape or an index read off the path carries none of its values: it undoes nothing
        names = [name for name in context.upstream.get(tensor, []) if name in rows and "float" in str(rows[name]["dtype"])]
        read = [rows[name] for name in names]
        if not read:
            continue
        if any(new_non_finite(r) for r in read) and not new_non_finite(row):
            if _bypassed(start, tensor, output, table, context):
                continue
            gridded = [context.quant_ranges[name] for name in names if new_non_finite(rows[name]) and name in context.quant_ranges]
            if gridded:  # the pair before the node made them finite, not the node
                grid = gridded[0]
                return (row["node"], row["op_type"], f"the Q/DQ pair before it puts what it reads on its {grid.grid} grid ({grid.low:.3g} to {grid.high:.3g}), "
                                                     "where the NaN/Inf become finite values")
            return row["node"], row["op_type"], "it turns the NaN/Inf it reads into finite values"
        if any(new_non_finite(r) for r in read) or new_non_finite(row):
            continue
        # The error itself shrinks (a scaling alone does that) and against the signal too (an added constant
        # alone does that): both, or nothing is undone.
        before_sqnr = min(float(r["sqnr_db"]) for r in read)
        before_error = max(float(r["mean_abs_err"]) for r in read)
        sqnr, error = float(row["sqnr_db"]), float(row["mean_abs_err"])
        if (error <= before_error / 2 and sqnr >= before_sqnr + ABSORBED_DB and row["op_type"] not in MOVING_OPS
                and not _bypassed(start, tensor, output, table, context)):
            return (row["node"], row["op_type"], f"the mean error falls across it from {before_error:.3g} to {error:.3g}, "
                                                 f"the SQNR rises from {before_sqnr:.1f} to {sqnr:.1f} dB")
    return None


def _bypassed(start: str, across: str, output: str, table: pd.DataFrame, context: DiagnosisContext) -> bool:
    """Whether `start`'s values reach `output` by a path of float values that avoids `across`: an error that
    shrinks across a node it also goes around is not undone (a SiLU's Sigmoid shrinks its input's error, and
    its Mul reads that input as it is). A shape or an index read off the path carries none of the values."""
    dtypes = table["dtype"].to_dict()
    return across != output and output in _reached(start, context, lambda tensor: tensor != across and "float" in str(dtypes.get(tensor, "float")))


def is_saturating(op_type: str | None) -> bool:
    return op_type in SATURATING_OPS


def _path_rows(start: str, output: str, table: pd.DataFrame, context: DiagnosisContext) -> pd.DataFrame:
    """Rows strictly after `start` that depend on it and feed `output`, in topological order."""
    return table[table.index.isin(_reached(start, context) & ancestor_tensors(output, context.upstream))]


def _reached(start: str, context: DiagnosisContext, passes: Callable[[str], bool] = lambda tensor: True) -> set[str]:
    """The tensors that depend on `start` through tensors that each `passes`."""
    readers: dict[str, list[str]] = {}
    for tensor, reads in context.upstream.items():
        for name in reads:
            readers.setdefault(name, []).append(tensor)
    reached, stack = set(), [start]
    while stack:
        for reader in readers.get(stack.pop(), []):
            if reader not in reached and passes(reader):
                reached.add(reader)
                stack.append(reader)
    return reached


def _is_square(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> bool:
    reads = context.upstream.get(tensor, [])
    op = table.loc[tensor, "op_type"]
    return (op == "Mul" and len(reads) == 2 and reads[0] == reads[1]) or op == "Pow"


def _operand_unit(tensor: str, operands: list[str], table: pd.DataFrame, context: DiagnosisContext) -> list[str]:
    """The nodes computing the operands from their common source (with one computed operand, its own
    node), and the cancelling node itself."""
    nodes = [table.loc[name, "node"] for name in operands] + [table.loc[tensor, "node"]]
    if len(operands) == 2:
        first, second = (ancestor_tensors(name, context.upstream) for name in operands)
        own = (first | second) - (first & second)
        common = list(dict.fromkeys(table.loc[table.index.isin(own), "node"].tolist() + [table.loc[tensor, "node"]]))
        nodes = common if len(common) <= MAX_UNIT_NODES else nodes
    return [node for node in nodes if node in context.converted]

