"""Why a tensor is out of tolerance: rules over its statistics row and those of the tensors its node reads.

Each rule returns a Finding with the evidence in numbers, so a reader can check it against the table.
Rules look only at the statistics table and the transform's record: diagnosis never re-runs a model.
Findings come most specific first: range faults (overflow, underflow, INT8 clipping/resolution), then
where NaN/Inf appear, then what the isolated run says (the node's own error, or error carried in).
Nothing is called the node's own error without the isolated run behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import pandas as pd

from accudiff.judging.metrics import FP16_SMALLEST_NORMAL, widening
from accudiff.judging.table import STATUS_FAIL
from accudiff.model.formats import FP16_MAX, QUANTIZED_FORMATS, QuantRange, formats_of
from accudiff.findings import Finding
from accudiff.text import percent

# Shares of affected elements below these are noise, not the cause.
SIGNIFICANT_SHARE = 0.01
CLIPPING_SHARE = 0.001
RESOLUTION_SHARE = 0.5

UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "MatMul"})
RANGE_KINDS = frozenset({"overflow", "input_overflow", "constant_overflow", "constant_underflow", "underflow", "per_tensor_scale", "block_scale", "int8_dynamic_range", *(f"{f}_{fault}" for f in QUANTIZED_FORMATS for fault in ("clipping", "resolution"))})


@dataclass(frozen=True)
class DiagnosisContext:
    precision: str
    upstream: dict[str, list[str]]  # tensor -> tensors and graph inputs its node reads
    converted: frozenset[str] = frozenset()  # nodes that compute in reduced precision
    kept: dict[str, str] = field(default_factory=dict)  # node -> why it stays in higher precision
    constant_findings: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # node -> (kind, what its constants became in the format)
    graph_inputs: pd.DataFrame | None = None  # range statistics of the graph inputs
    quant_ranges: dict[str, QuantRange] = field(default_factory=dict)  # tensor -> the grid a Q/DQ pair puts it on
    weight_findings: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (kind, what its weight's quantization scale zeroes)
    run_time_ranges: dict[str, list[float]] = field(default_factory=dict)  # tensor quantized as the model runs -> metrics.run_time_range

    @property
    def formats(self) -> frozenset[str]:
        return formats_of(self.precision)

    @property
    def roundoff(self) -> tuple[float, str] | None:
        """The unit roundoff of the coarsest float format values are stored in (FP16: 2^-11, BF16: 2^-8), and
        its name; None for a candidate that stores none."""
        stored = [f for f in self.formats if f in UNIT_ROUNDOFF]
        if not stored:
            return None
        coarsest = max(stored, key=UNIT_ROUNDOFF.get)
        return UNIT_ROUNDOFF[coarsest], coarsest.upper()

    def inputs_of(self, tensor: str, table: pd.DataFrame) -> list[str]:
        """What the node producing `tensor` reads, among the tensors and graph inputs that have statistics."""
        return [name for name in self.upstream.get(tensor, []) if name in table.index or self._is_graph_input(name)]

    def row(self, name: str, table: pd.DataFrame) -> pd.Series:
        return table.loc[name] if name in table.index else self.graph_inputs.loc[name]

    def _is_graph_input(self, name: str) -> bool:
        return self.graph_inputs is not None and name in self.graph_inputs.index


def isolation_ran(table: pd.DataFrame) -> bool:
    return "isolated_status" in table.columns


def diagnose(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """Findings for one failing tensor of `table` (indexed by tensor name)."""
    row = table.loc[tensor]
    findings: list[Finding] = []
    if row["note"].startswith("shape differs"):
        findings.append(Finding("shape", row["note"]))
    findings += range_findings(tensor, table, context)
    findings += _non_finite(tensor, table, context)
    if isolation_ran(table) and isinstance(row["isolated_status"], str):
        findings.append(_isolation(row))
    elif not findings:
        failing_inputs = [n for n in context.inputs_of(tensor, table) if n in table.index and table.loc[n, "status"] == STATUS_FAIL]
        if failing_inputs:
            findings.append(Finding("inherited", f"its input '{failing_inputs[0]}' is already out of tolerance; error is carried in"))
        else:
            findings.append(
                Finding(
                    "unexplained",
                    "no range fault explains it, and the isolated run that would tell this node's own error from "
                    "error carried in was skipped (--no-isolate)",
                )
            )
    return findings


def range_findings(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """Range faults of the node producing `tensor`: values its reduced-precision storage cannot hold."""
    row = table.loc[tensor]
    node = row["node"]
    converted = node in context.converted
    inputs = context.inputs_of(tensor, table)
    findings = [Finding(kind, text) for kind, text in context.constant_findings.get(node, [])]
    if "fp16" in context.formats:
        if row["ref_absmax"] > FP16_MAX and (row["cand_dtype"] == "float16" or row["cand_inf"] > row["ref_inf"]):
            findings.append(
                Finding("overflow", f"reference absmax {row['ref_absmax']:.3g} exceeds the FP16 maximum {FP16_MAX:.0f}, so FP16 turns it into Inf")
            )
        if converted:
            findings += _fp16_input_overflow(inputs, table, context)
        stored_fp16 = [tensor] if row["cand_dtype"] == "float16" else []
        findings += _fp16_underflow(table, context, stored_fp16 + (inputs if converted else []), tensor)
    if context.formats & QUANTIZED_FORMATS and converted:
        findings += _quantized_values(table, context, inputs, "input")
        stored = table.index[(table["node"] == node) & table["is_output"].astype(bool)]  # a pair right after it (a KV cache in INT8)
        findings += _quantized_values(table, context, list(stored), "output")
    findings += grid_faults(tensor, table, context)
    if converted and context.roundoff is not None:
        findings += absorption(tensor, table, context) + _accumulation(row, inputs, table, context)
    return findings


def grid_faults(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """Faults of the grids the node producing `tensor` quantizes onto that hold whatever its own tolerance
    says (a tensor dominated by a few large values passes while its small ones are lost): a weight scale
    that zeroes channels or blocks, an input quantized as the model runs over a range a few values set."""
    node = table.loc[tensor, "node"]
    found = [Finding(*context.weight_findings[node])] if node in context.weight_findings else []
    if node in context.converted:
        found += [f for name in context.inputs_of(tensor, table) if (f := _run_time_range(name, table, context)) is not None]
    return found


def grid_fault_strength(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> float:
    """How much the grid faults of the node producing `tensor` lose, to try the worst first: its inputs'
    widest run-time range against what their bulk needs; a weight that loses channels or blocks counts as
    a range WIDENING times too wide."""
    node = table.loc[tensor, "node"]
    widest = [widening(context.run_time_ranges[name]) for name in context.inputs_of(tensor, table) if name in context.run_time_ranges]
    return max([*widest, *([WIDENING] if node in context.weight_findings else [])], default=0.0)


WIDENING = 4.0  # an input's range this many times what 99.9% of its values need: two bits of its grid lost


def _run_time_range(name: str, table: pd.DataFrame, context: DiagnosisContext) -> Finding | None:
    """An input quantized per tensor as the model runs (ONNX Runtime's dynamic quantization: each sample
    over its own [min, max], 0 included) whose range a few large values stretch far beyond what the rest
    need: the step they force flattens the small values."""
    record = context.run_time_ranges.get(name)
    grid = context.quant_ranges.get(name)
    if record is None or grid is None or not record[1] or widening(record) < WIDENING:
        return None
    samples, elements, setting, low, high, bulk_low, bulk_high = record
    row = context.row(name, table)
    flattened = row["below_int8_step"] / row["elements"] if row["elements"] else 0.0
    step = (high - low) / grid.levels
    return Finding("int8_dynamic_range",
                   f"its input '{name}' is quantized to {grid.grid} per tensor as the model runs, each sample over its own range: in the widest, "
                   f"[{low:.3g}, {high:.3g}] (a step of {step:.3g}), {widening(record):.3g} times the span 99.9% of its values need "
                   f"([{bulk_low:.3g}, {bulk_high:.3g}]); a few values set it ({setting / samples:.3g} a sample, of {elements / samples:.0f}, lie beyond "
                   f"half its largest magnitude), and {percent(flattened)} of its values lie below half a step and become 0")


def absorption(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """x + y where y is below half an ulp of x's largest values: added to them in the stored format, it is
    lost (a small residual or epsilon added to a large value). Harmless to the sum itself; what is lost
    shows where a later subtraction takes the large part away again."""
    row, inputs = table.loc[tensor], context.inputs_of(tensor, table)
    if row["op_type"] not in ("Add", "Sub") or len(inputs) != 2 or row["node"] not in context.converted or context.roundoff is None:
        return []
    roundoff, name = context.roundoff
    large, small = sorted(inputs, key=lambda n: -float(context.row(n, table)["ref_absmax"]))
    big, tiny = float(context.row(large, table)["ref_absmax"]), float(context.row(small, table)["ref_absmax"])
    half_ulp = 2.0 ** math.floor(math.log2(big)) * roundoff if big > 0 else 0.0  # u = 2^-p is half the spacing at 1
    if not 0 < tiny < half_ulp:
        return []
    return [Finding("absorption", f"{row['op_type']} '{row['node']}': its operand '{small}' (absmax {tiny:.3g}) is below half a {name} ulp of its operand '{large}' at its largest "
                                  f"({half_ulp:.3g} at {big:.3g}): added to values that large in {name}, it is lost")]


def _accumulation(row: pd.Series, inputs: list[str], table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """A long reduction over values stored in the format: the rounding of N terms (the unit roundoff u of
    each) adds up, at random, to about sqrt(N)·u times a term's size. Named when that estimate, with the
    largest term, is beyond the tolerance of the node's largest value: the terms cancel, and their rounding
    is what is left."""
    if row["op_type"] not in REDUCTIONS or not inputs or row["ref_absmax"] == 0:
        return []
    terms, term_size = _terms(row, inputs, table, context)
    if terms < 64:
        return []
    roundoff, name = context.roundoff
    estimate = math.sqrt(terms) * roundoff * term_size
    largest = float(row["ref_absmax"])
    allowed = row["atol"] + (row["rtol"] + row["stol"]) * largest
    if estimate <= allowed:
        return []
    return [Finding("accumulation", f"each of its values sums {terms} terms of up to {term_size:.3g} stored in {name}: their rounding (2^{round(math.log2(roundoff))} each) "
                                    f"adds up to about sqrt({terms}) x 2^{round(math.log2(roundoff))} x {term_size:.3g} = {estimate:.3g}, where its results reach only "
                                    f"{largest:.3g} (tolerance there {allowed:.3g})")]


def _terms(row: pd.Series, inputs: list[str], table: pd.DataFrame, context: DiagnosisContext) -> tuple[int, float]:
    """How many terms each value of a reduction sums, from the shapes compared, and the largest term's
    size; (0, 0) when unknown (a MatMul whose operand is a weight has no statistics for it)."""
    shapes = [str(table.loc[name, "shape"]) if name in table.index else "" for name in (inputs[0], row["tensor"])]
    if not all(shapes):
        return 0, 0.0
    first, result = ([int(d) for d in shape.split("x")] for shape in shapes)
    sizes = [float(context.row(name, table)["ref_absmax"]) for name in inputs]
    if row["op_type"] == "MatMul":
        return (first[-1], sizes[0] * sizes[1]) if len(sizes) == 2 and first else (0, 0.0)
    terms = max(math.prod(first) // max(math.prod(result), 1), 0)
    size = {"ReduceSumSquare": sizes[0] ** 2, "ReduceMean": sizes[0] / max(terms, 1)}.get(row["op_type"], sizes[0])
    return terms, size


def _fp16_input_overflow(inputs: list[str], table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    """An input held in FP32 upstream (a graph input, or the output of a node kept in FP32) that this node
    reads in FP16, where it cannot fit."""
    findings = []
    for name in inputs:
        source = context.row(name, table)
        if source["ref_absmax"] <= FP16_MAX or source.get("cand_dtype") == "float16":
            continue  # fits, or already stored in FP16 by its producer (which overflows first)
        origin = f"'{source['node']}', kept in FP32, produces it" if source["node"] else "it is a graph input"
        findings.append(
            Finding(
                "input_overflow",
                f"its input '{name}' has reference absmax {source['ref_absmax']:.3g}, beyond the FP16 maximum {FP16_MAX:.0f}; "
                f"{origin}, and this node reads it in FP16, where it becomes Inf",
            )
        )
    return findings


def _fp16_underflow(table: pd.DataFrame, context: DiagnosisContext, names: list[str], tensor: str) -> list[Finding]:
    """A tensor stored in FP16 here holds values FP16 cannot represent with precision."""
    for name in names:
        row = context.row(name, table)
        if not row["elements"]:
            continue
        tiny_share = row["below_fp16_normal"] / row["elements"]
        if tiny_share >= SIGNIFICANT_SHARE:
            where = "of this tensor" if name == tensor else f"of its input '{name}'"
            flushed = f"; {percent(row['flushed_to_zero'] / row['elements'])} became exactly 0" if name == tensor else ""
            return [
                Finding(
                    "underflow",
                    f"{percent(tiny_share)} of the reference values {where} are nonzero but below the FP16 normal range "
                    f"({FP16_SMALLEST_NORMAL:.2g}), where FP16 keeps few or no bits{flushed}",
                )
            ]
    return []


def _quantized_values(table: pd.DataFrame, context: DiagnosisContext, names: list[str], role: str) -> list[Finding]:
    """An input (or a graph output, `role`) its Q/DQ pair puts on a grid that does not hold it: values beyond
    the grid's range clip (an integer grid) or saturate (FP8), values below half its smallest step become 0."""
    findings = []
    for name in names:
        source, grid = context.row(name, table), context.quant_ranges.get(name)
        if not source["elements"] or grid is None or grid.levels:  # a grid set as the model runs: _run_time_range
            continue
        clipped = source["beyond_int8_range"] / source["elements"]
        tiny = source["below_int8_step"] / source["elements"]
        floating = grid.format in ("fp8", "fp4")
        symmetric = abs(grid.low + grid.high) <= grid.step  # INT8's -128..127 steps read as +-127 steps
        calibrated = f"+-{grid.high:.3g}" if symmetric else f"{grid.low:.3g}..{grid.high:.3g}"
        if clipped >= CLIPPING_SHARE:
            fate = f"they saturate at its largest value ({grid.high:.3g})" if floating else "they clip"
            findings.append(
                Finding(
                    f"{grid.format}_clipping",
                    f"{percent(clipped)} of the values of its {role} '{name}' lie {'beyond' if floating else 'more than half a step beyond'} "
                    f"its calibrated {grid.grid} range {calibrated} (reference absmax {source['ref_absmax']:.3g}): {fate}",
                )
            )
        if tiny >= RESOLUTION_SHARE:
            step = f"its smallest {grid.grid} step ({grid.step:.3g}" if floating else f"an {grid.grid} step (scale {grid.scale:.3g}"
            findings.append(
                Finding(
                    f"{grid.format}_resolution",
                    f"{percent(tiny)} of the values of its {role} '{name}' are smaller than half {step}, set by a calibrated range of "
                    f"{calibrated}), so they round to 0",
                )
            )
    return findings


def new_non_finite(row: pd.Series | Mapping[str, float]) -> bool:
    """The candidate has NaN/Inf where the reference has none."""
    return bool(row["cand_nan"] > row["ref_nan"] or row["cand_inf"] > row["ref_inf"])


def _non_finite(tensor: str, table: pd.DataFrame, context: DiagnosisContext) -> list[Finding]:
    row = table.loc[tensor]
    if not new_non_finite(row):
        return []
    poisoned = [name for name in context.inputs_of(tensor, table) if name in table.index and new_non_finite(table.loc[name])]
    counts = f"the candidate has {int(row['cand_nan'])} NaN and {int(row['cand_inf'])} Inf where the reference has {int(row['ref_nan'])} and {int(row['ref_inf'])}"
    if poisoned:
        return [Finding("nan_inf_inherited", f"{counts}; they come from its input '{poisoned[0]}'")]
    return [Finding("nan_inf_origin", f"NaN/Inf first appear here, {_read_finite(row['node'], context)}: {counts}")]


def _read_finite(node: str, context: DiagnosisContext) -> str:
    """What a node where NaN/Inf first appear reads: finite values, or finite values and a constant the
    candidate's format holds as Inf."""
    if any(kind == "constant_overflow" for kind, _ in context.constant_findings.get(node, [])):
        return "where it reads finite values and a constant the format made Inf"
    return "from finite inputs"


def _isolation(row: pd.Series) -> Finding:
    """Local or inherited, from the run in which every node read the reference's values."""
    if row["isolated_status"] == STATUS_FAIL:
        return Finding("rounding", f"fed the reference's values, this {row['op_type']} still leaves tolerance on its own: {isolated_figures(row)}")
    return Finding(
        "inherited",
        f"fed the reference's values, this {row['op_type']} is within tolerance (isolated SQNR {row['isolated_sqnr_db']:.1f} dB, "
        f"accumulated {row['sqnr_db']:.1f} dB): the error comes from upstream",
    )


def isolated_figures(row: pd.Series) -> str:
    """The isolated run's figures for one tensor; where one is undefined (no element compared: an empty
    tensor, or NaN/Inf on both sides), said in words, never 'nan'."""
    error, share, sqnr = (float(row[f"isolated_{name}"]) for name in ("max_abs_err", "outside_share", "sqnr_db"))
    if math.isnan(error) or math.isnan(share):
        return "no element of it could be compared (it is empty, or NaN/Inf on both sides)"
    said = f"max abs err {error:.3g}, {percent(share)} of elements outside"
    return said + (f", SQNR {sqnr:.1f} dB" if not math.isnan(sqnr) else ", no SQNR (the reference is all 0)")
