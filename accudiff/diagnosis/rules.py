"""Why a tensor is out of tolerance: rules over its statistics row and those of the tensors it reads.

Each rule returns a Finding with the evidence in numbers, so a reader can check it against the table.
Rules look only at the statistics table and the transform's record: diagnosis never re-runs a model.
Findings come most specific first: range faults (overflow, underflow, INT8 clipping/resolution), then
where NaN/Inf appear, then inherited error, and plain rounding only when nothing else explains it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from accudiff.comparison.metrics import FP16_SMALLEST_NORMAL
from accudiff.comparison.table import STATUS_FAIL
from accudiff.transforms.fp16 import FP16_MAX

# Shares of affected elements below these are noise, not the cause.
SIGNIFICANT_SHARE = 0.01
CLIPPING_SHARE = 0.001
RESOLUTION_SHARE = 0.5


@dataclass(frozen=True)
class Finding:
    kind: str  # overflow | constant_overflow | underflow | int8_clipping | int8_resolution | nan_inf_origin | nan_inf_inherited | shape | local | inherited | rounding
    message: str


@dataclass(frozen=True)
class DiagnosisContext:
    precision: str
    upstream: dict[str, list[str]]  # tensor -> tensors its node reads
    constant_overflows: dict[str, str] = field(default_factory=dict)  # node -> what overflowed in its constants
    graph_inputs: pd.DataFrame | None = None  # statistics rows of the graph inputs (INT8 range checks)


def diagnose(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """Findings for one tensor of `table` (indexed by tensor name)."""
    row = table.loc[tensor]
    inputs = [name for name in context.upstream.get(tensor, []) if name in table.index]
    findings: list[Finding] = []
    if row["note"].startswith("shape differs"):
        findings.append(Finding("shape", row["note"]))
    if context.precision == "fp16":
        findings += _fp16_overflow(row)
        if row["node"] in context.constant_overflows:
            findings.append(Finding("constant_overflow", context.constant_overflows[row["node"]]))
        findings += _fp16_underflow(table, [tensor, *inputs])
    if context.precision == "int8":
        sources = table if context.graph_inputs is None else pd.concat([table, context.graph_inputs])
        findings += _int8_inputs(sources, [n for n in context.upstream.get(tensor, []) if n in sources.index])
    findings += _non_finite(row, table, inputs)
    if "isolated_status" in row.index and row["status"] == STATUS_FAIL and isinstance(row["isolated_status"], str):
        findings.append(_isolation(row))
        return findings
    failing_inputs = [name for name in inputs if table.loc[name, "status"] == STATUS_FAIL]
    if failing_inputs and not findings:
        findings.append(Finding("inherited", f"its input '{failing_inputs[0]}' is already out of tolerance; the error is carried in"))
    if not findings:
        findings.append(
            Finding(
                "rounding",
                f"rounding error of this {row['op_type']} exceeds tolerance on its own: max abs error {row['max_abs_err']:.3g}, "
                f"{row['outside_share']:.1%} of elements outside tolerance, SQNR {row['sqnr_db']:.1f} dB",
            )
        )
    return findings


def first_failing_ancestor(tensor: str, table: pd.DataFrame, upstream: dict[str, list[str]]) -> str | None:
    """The earliest (topologically) failing tensor among `tensor` and everything it depends on."""
    seen, stack = {tensor}, [tensor]
    while stack:
        for parent in upstream.get(stack.pop(), []):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    failing = [name for name in table.index if name in seen and table.loc[name, "status"] == STATUS_FAIL]
    return failing[0] if failing else None


def _isolation(row: pd.Series) -> Finding:
    """Local or inherited, from the run in which every node read the reference's values."""
    figures = f"isolated SQNR {row['isolated_sqnr_db']:.1f} dB, accumulated {row['sqnr_db']:.1f} dB"
    if row["isolated_status"] == STATUS_FAIL:
        return Finding("local", f"fed the reference's inputs, this {row['op_type']} still fails ({figures}): the error starts here")
    return Finding("inherited", f"fed the reference's inputs, this {row['op_type']} is within tolerance ({figures}): the error comes from upstream")


def _fp16_overflow(row: pd.Series) -> list[Finding]:
    if row["ref_absmax"] > FP16_MAX and (row["cand_dtype"] == "float16" or row["cand_inf"] > row["ref_inf"]):
        return [Finding("overflow", f"reference absmax {row['ref_absmax']:.3g} exceeds the FP16 maximum {FP16_MAX:.0f}, so FP16 turns it into Inf")]
    return []


def _fp16_underflow(table: pd.DataFrame, names: list[str]) -> list[Finding]:
    """The tensor itself, or a tensor it reads, holds values FP16 cannot represent with precision."""
    for name in names:
        row = table.loc[name]
        if not row["elements"] or row["cand_dtype"] != "float16":
            continue
        tiny_share = row["below_fp16_normal"] / row["elements"]
        if tiny_share >= SIGNIFICANT_SHARE:
            where = "of this tensor" if name == names[0] else f"of its input '{name}'"
            return [
                Finding(
                    "underflow",
                    f"{tiny_share:.1%} of the reference values {where} are nonzero but below the FP16 normal range "
                    f"({FP16_SMALLEST_NORMAL:.2g}), where FP16 keeps few or no bits; "
                    f"{row['flushed_to_zero'] / row['elements']:.1%} became exactly 0",
                )
            ]
    return []


def _int8_inputs(table: pd.DataFrame, inputs: list[str]) -> list[Finding]:
    findings = []
    for name in inputs:
        source = table.loc[name]
        if not source["elements"] or pd.isna(source["int8_scale"]):
            continue
        clipped = source["beyond_int8_range"] / source["elements"]
        tiny = source["below_int8_step"] / source["elements"]
        if clipped >= CLIPPING_SHARE:
            findings.append(
                Finding(
                    "int8_clipping",
                    f"{clipped:.1%} of the values of its input '{name}' lie outside its calibrated INT8 range "
                    f"+-{127 * source['int8_scale']:.3g} (reference absmax {source['ref_absmax']:.3g}): they clip",
                )
            )
        if tiny >= RESOLUTION_SHARE:
            findings.append(
                Finding(
                    "int8_resolution",
                    f"{tiny:.1%} of the values of its input '{name}' are smaller than half an INT8 step "
                    f"(scale {source['int8_scale']:.3g}, set by a calibrated range of +-{127 * source['int8_scale']:.3g}), so they round to 0",
                )
            )
    return findings


def _non_finite(row: pd.Series, table: pd.DataFrame, inputs: list[str]) -> list[Finding]:
    if not (row["cand_nan"] > row["ref_nan"] or row["cand_inf"] > row["ref_inf"]):
        return []
    poisoned = [name for name in inputs if table.loc[name, "cand_nan"] + table.loc[name, "cand_inf"] > table.loc[name, "ref_nan"] + table.loc[name, "ref_inf"]]
    counts = f"the candidate has {int(row['cand_nan'])} NaN and {int(row['cand_inf'])} Inf where the reference has {int(row['ref_nan'])} and {int(row['ref_inf'])}"
    if poisoned:
        return [Finding("nan_inf_inherited", f"{counts}; they come from its input '{poisoned[0]}'")]
    return [Finding("nan_inf_origin", f"NaN/Inf first appear here: {counts}")]
