"""The judge stage: the worker's statistics become the table, the verdict comes from the graph outputs,
and every failing output gets the rules' cause (a hypothesis until the verify stage tests it)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Mapping

import numpy as np
import pandas as pd

from accudiff.judging.decisions import DEFAULT_THRESHOLD, Decision, SampleOutcome, summarize, threshold_for, tolerance_met
from accudiff.judging.intervals import intervals
from accudiff.judging.objective import Resolution
from accudiff.judging.output_kinds import UNKNOWN, OutputKind, deciding
from accudiff.judging.table import STATUS_FAIL, STATUS_MISSING, STATUS_PASS, build_table, graph_input_table, with_side_run
from accudiff.diagnosis.cause import ancestor_tensors, find_cause
from accudiff.execution.messages import PassResult, WorkerResult
from accudiff.diagnosis.rules import DiagnosisContext, diagnose
from accudiff.errors import AccudiffError
from accudiff.model.inventory import ModelInfo
from accudiff.model.samples import Samples
from accudiff.result import MIN_COVERAGE, CompareResult, TensorFailure
from accudiff.transforms import TransformResult

if TYPE_CHECKING:
    from accudiff.settings import Compared, Judging

STEP_COLUMNS = ["sample", "sequence", "step", "phase", "position", "tokens", "reference_next", "candidate_next"]  # generation.Step
SAMPLE_COLUMNS = ["sample", "tensor", "status", "max_abs_err", "tol_ratio", "outside_share", "sqnr_db", *(f.name for f in fields(Decision))]


def judge(info: ModelInfo, transformed: TransformResult, measured: WorkerResult, compared: Compared, judging: Judging, isolate: bool, samples: Samples,
          kinds: Mapping[str, OutputKind]) -> tuple[CompareResult, DiagnosisContext]:
    """The result of a comparison (tables, verdict, the first failing tensor, the failing outputs with
    their causes) and what the rules knew when they named them. Outputs of `kinds` "state" (a decoder's KV
    cache) are compared, never diagnosed: the logits of later steps judge them."""
    tolerances = judging.tolerances
    row_of = {t.name: k for k, t in enumerate(info.tensors)}

    def table_of(name: str) -> pd.DataFrame:
        result = measured.passes[name]
        notes = {**result.notes, **{row_of[name]: f"no partner in the candidate: {why}" for name, why in transformed.unmatched.items() if name in row_of}}
        return build_table(info.tensors, result.stats, result.seen, notes, tolerances, transformed.quant_ranges)

    table = table_of("candidate")
    if isolate:
        table = with_side_run(table, table_of("isolated"), "isolated")
    if compared.also is not None and compared.also in measured.passes:
        table = with_side_run(table, table_of(compared.also), compared.also)
    float_inputs = [spec for spec in info.inputs if np.issubdtype(spec.dtype, np.floating)]
    context = DiagnosisContext(
        compared.precision,
        info.upstream,
        frozenset(transformed.converted),
        {k.node: k.reason for k in transformed.kept},
        transformed.constant_findings,
        graph_input_table(float_inputs, measured.inputs, transformed.quant_ranges),
        dict(transformed.quant_ranges),
        dict(transformed.weight_findings),
        dict(measured.run_time_ranges),
    )
    indexed = table.set_index("tensor", drop=False)
    failing = table.loc[table["status"] == STATUS_FAIL, "tensor"].tolist()

    def output_failure(name: str) -> TensorFailure:
        row = indexed.loc[name]
        upstream = ancestor_tensors(name, info.upstream)
        first = next((t for t in failing if t in upstream), None)
        return TensorFailure(name, row["node"], row["op_type"], diagnose(name, indexed, context), first, find_cause(name, indexed, context))

    first_failure = None
    if failing:
        row = indexed.loc[failing[0]]
        first_failure = TensorFailure(failing[0], row["node"], row["op_type"], diagnose(failing[0], indexed, context))
    candidate_pass = measured.passes["candidate"]
    steps = pd.DataFrame(measured.steps, columns=STEP_COLUMNS)
    sample_table = _sample_table(candidate_pass.outcomes, steps)
    decisions, met = _decisions(sample_table, candidate_pass, {name: threshold_for(name, kinds.get(name, UNKNOWN).kind, judging.thresholds)
                                                               for name in info.output_names}, row_of)
    objective = judging.objective
    objective.applies(decisions, info.output_names)
    spans = {output: intervals(rows, _units(rows), decisions[output]) for output, rows in sample_table.groupby("tensor", sort=False)}
    observed_outputs = table.loc[(table["status"] != STATUS_MISSING) & table["is_output"], "tensor"].tolist()
    judged = deciding(observed_outputs, kinds)
    # An output with a required decision figure fails by it (--require), when its interval lies below the
    # target (a requirement its interval straddles is unresolved: neither a pass nor a failure); any other
    # output fails by its tolerance.
    resolved = {name: objective.resolve(decisions.get(name, {}), spans.get(name, {})) for name in judged}
    failing_outputs = [name for name in judged if _fails(indexed.loc[name], resolved[name])]
    result = CompareResult(
        model=compared.model,
        precision=compared.precision,
        candidate=candidate_pass.label,
        table=table,
        passed=False,
        first_failure=first_failure,
        output_failures=[output_failure(name) for name in failing_outputs],
        tolerances=tolerances,
        kept=transformed.kept,
        converted=frozenset(transformed.converted),
        not_observable={**info.not_observable, **measured.reference_not_observable, **candidate_pass.not_observable},
        iterations=len(samples),
        samples=sample_table,
        inputs=samples.source,
        candidate_model=compared.candidate_model,
        unmatched=dict(transformed.unmatched),
        inside=dict(transformed.inside),
        quantized_by=dict(transformed.quantized_by),
        reads_constant_weights=set(transformed.reads_constant_weights),
    )
    if len(result.outputs) and not result.outputs["elements"].any():
        raise AccudiffError(f"every graph output of '{info.path.name}' is empty on these inputs: the comparison would cover no element")
    compared, computed = result.coverage
    result.unresolved = {name: [r for r in found if r.outcome == "unresolved"] for name, found in resolved.items() if any(r.outcome == "unresolved" for r in found)}
    result.passed = bool(judged) and not failing_outputs and not result.unresolved and compared + len(result.inside) >= MIN_COVERAGE * computed
    result.points = {name: [point[1:] for point in points] for name, points in candidate_pass.points.items()}  # [reference, candidate]
    result.decisions, result.tolerance_met, result.require = decisions, met, dict(objective.require)
    result.intervals, result.output_kinds = spans, dict(kinds)
    if len(steps):
        result.steps, result.generations = steps, sorted(measured.generations, key=lambda g: g["sequence"])
        result.phases = {output: _phases(rows) for output, rows in sample_table.groupby("tensor", sort=False)
                         if kinds.get(output, UNKNOWN).kind in ("logits", "probabilities")}
    result.nodes, result.weights = info.nodes, info.weights
    return result, context


def _decisions(samples: pd.DataFrame, candidate: PassResult, thresholds: Mapping[str, float], row_of: dict[str, int]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per graph output, its decision figures over every sample (`thresholds`: each output's) and the tolerance it meets."""
    sketches = candidate.stats.sketch
    decisions, met = {}, {}
    for output, rows in samples.groupby("tensor", sort=False):
        threshold = thresholds.get(output, DEFAULT_THRESHOLD)
        errors = sketches[row_of[output]] if output in row_of else None
        decisions[output] = summarize(rows, candidate.sketches.get(output, {}), errors, threshold)
        met[output] = tolerance_met(rows)
    return decisions, met


def _fails(row: pd.Series, resolved: list[Resolution]) -> bool:
    """Whether a graph output fails: by its required decision figures where it has them (one that misses its
    target), else by its tolerance."""
    if resolved:
        return any(r.outcome == "missed" for r in resolved)
    return row["status"] == STATUS_FAIL


def side_run_notices(table: pd.DataFrame) -> list[str]:
    """The tensors the candidate run compared that a run beside it (the isolated run, a second backend) did
    not observe: counted and said, as a figure that covers fewer tensors than it seems to."""
    compared = table["status"] != STATUS_MISSING
    notices = []
    for column in [c for c in table.columns if c.endswith("_status") and c != "status"]:
        missing = table.loc[compared & (table[column].isna() | (table[column] == STATUS_MISSING)), "tensor"]
        if len(missing):
            run = column.removesuffix("_status")
            what = "the isolated run (each node fed the reference's values)" if run == "isolated" else f"the run on {run}"
            notices.append(f"{what} did not observe {len(missing)} of the {int(compared.sum())} tensors the candidate run compared "
                           f"(e.g. '{missing.iloc[0]}'): its figures are missing for them")
    return notices


def _units(rows: pd.DataFrame) -> pd.Series:
    """What each sample row belongs to for resampling: its prompt (a decoder's generation), else itself."""
    return rows["sequence"] if "sequence" in rows.columns else rows["sample"]


def _phases(rows: pd.DataFrame) -> dict[str, dict]:
    """A decoder's figures per phase (its prompts' prefills, their decode steps), each with its intervals."""
    found = {}
    for phase, part in rows.groupby("phase", sort=False):
        figures = summarize(part, {}, None, DEFAULT_THRESHOLD)
        found[phase] = {"figures": figures, "intervals": intervals(part, _units(part), figures), "steps": int(part["sample"].nunique())}
    return found


def attach_sketches(result: CompareResult, info: ModelInfo, measured: WorkerResult) -> None:
    """The error sketches the report plots: every failing output's and its (verified) cause's."""
    row_of = {t.name: k for k, t in enumerate(info.tensors)}
    shown = {f.tensor for f in result.output_failures} | {f.cause.tensor for f in result.output_failures if f.cause.tensor}
    sketch = measured.passes["candidate"].stats.sketch
    result.error_sketches = {name: sketch[row_of[name]] for name in shown if name in row_of}


def _sample_table(outcomes: list[SampleOutcome], steps: pd.DataFrame) -> pd.DataFrame:
    """One row per sample and graph output, in sample order; a decoder's generation adds what each sample
    is (its prompt, step, phase and first position)."""
    columns = [c for c in SAMPLE_COLUMNS if c != "status"]
    # Column by column: a frame made of the dataclasses deep-copies each (0.8 s for 400 prompts' 7,000 steps).
    table = pd.DataFrame({c: [getattr(o, c) for o in outcomes] for c in columns}, columns=columns)
    table.insert(2, "status", np.where(table["outside_share"] > 0, STATUS_FAIL, STATUS_PASS))
    if len(steps):
        table = table.merge(steps[["sample", "sequence", "step", "phase", "position"]], on="sample", how="left")
    return table.sort_values("sample", kind="stable").reset_index(drop=True)
