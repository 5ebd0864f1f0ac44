"""What a compare report says, computed once: the summary document (summary.json), the worst tensors and
samples, and the lines that state each cause and repair. The console (console.py), the HTML page and
summary.md (html.py) and the report folder (writer.py) are views of it.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from dataclasses import asdict

from accudiff.version import __version__
from accudiff.judging.objective import LADDERS, REQUIREMENTS, Objective, Resolution, decision_figure, describe, figure_text, strictest_met
from accudiff.report.decision_text import decision_lines, generation_lines, output_kind, phase_lines, said_figure, sample_name, state_lines
from accudiff.report.next_steps import decision_requirement, requirement_option
from accudiff.report.repair_text import repair_lines, tried_subset_lines
from accudiff.text import percent, times_tolerance

SUMMARY_SCHEMA = "accudiff.compare.summary"
SUMMARY_SCHEMA_VERSION = 6
SUMMARY_FILE = "summary.json"
TENSORS_FILE = "tensors.csv"
SAMPLES_FILE = "samples.csv"
MARKDOWN_FILE = "summary.md"
WORST_SAMPLES_FILE = "worst_samples.npz"
INPUTS_FILE = "inputs.npz"
PROMPTS_FILE = "prompts.npz"  # a decoder's prompts as token ids (model/prompts.py)
WORST_SAMPLE_COUNT = 5
JUST_PAST = 2.0  # an output at most this many times its tolerance (or target) is "just past" it
WORST_COUNT = 5
OUTPUT_COLUMNS = ["tensor", "status", "max_abs_err", "max_rel_err", "tol_ratio", "outside_share", "cosine", "sqnr_db"]
HTML_FILE = "report.html"
CANDIDATE_MODEL_FILE = "candidate-{precision}{group}.onnx"


def summary(result) -> dict:
    """The summary document of a CompareResult (non-finite numbers are written as "inf"/"-inf"/"nan")."""
    table = result.table
    outputs = []
    failures = {f.tensor: f for f in result.output_failures}
    for _, row in result.outputs.iterrows():
        entry = {column: row[column] for column in OUTPUT_COLUMNS}
        if row["tensor"] in failures:
            failure = failures[row["tensor"]]
            entry["findings"] = [asdict(f) for f in failure.findings]
            entry["cause"] = asdict(failure.cause)
            entry["repair"] = asdict(failure.repair) if failure.repair is not None else None
            entry["first_failing_upstream"] = failure.first_failing_upstream
            entry["loss_split"] = result.loss_split.get(row["tensor"])
            entry["tolerance_met"] = result.tolerance_met.get(row["tensor"])
        entry["decision"] = result.decisions.get(row["tensor"])
        entry["intervals"] = {name: span.as_json() for name, span in result.intervals.get(row["tensor"], {}).items()}  # 95%, judging/intervals.py
        entry["unresolved"] = [asdict(r) for r in result.unresolved.get(row["tensor"], [])]
        met = strictest_target_met(row["tensor"], result)
        entry["strictest_met"] = {"name": met.name, "target": met.target} if met is not None else None
        kind = result.output_kinds.get(row["tensor"])
        entry["kind"] = {"kind": kind.kind, "why": kind.why} if kind is not None else None
        outputs.append(entry)
    document = {
        "schema": SUMMARY_SCHEMA,
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "accudiff_version": __version__,
        "model": str(result.model),
        "precision": result.precision,
        "candidate": result.candidate,
        "verdict": result.verdict,
        "tolerances": result.tolerances.as_dict(),
        "iterations": result.iterations,
        "seed": result.seed,
        "coverage": {"compared": result.coverage[0], "computed": result.coverage[1], "share": result.coverage[0] / max(result.coverage[1], 1),
                     "inside_fused_nodes": len(result.inside)},
        "branches": result.branches,
        "counts": {
            "tensors": len(table),
            "failing": int((table["status"] == "fail").sum()),
            "not_observed": int((table["status"] == "not observed").sum()) + len(result.not_observable),
        },
        "first_failure": asdict(result.first_failure) if result.first_failure else None,
        "outputs": outputs,
        "worst_tensors": worst_tensors(table).to_dict("records"),
        "kept_fp32": [asdict(k) for k in result.kept],
        "not_observable": result.not_observable,
        "notices": result.notices,
        "timings_s": result.timings,
        "worker_timings_s": result.worker_timings,
        "layout": result.layout,
        "inputs": result.inputs,
        "samples": _samples_summary(result),
        "alignment": _alignment(result),
        "generation": _generation_summary(result),
        "files": {"tensors": TENSORS_FILE, "samples": SAMPLES_FILE, "inputs": INPUTS_FILE, "candidate_models": result.candidate_models,
                  "repaired_candidate": result.repaired_candidate, "html": HTML_FILE, "markdown": MARKDOWN_FILE},
        "replay": shlex.join(result.replay) if result.replay else None,
    }
    return finite(document)


def _generation_summary(result) -> dict | None:
    """A decoder's generation: its prompts and decode steps, the scores' figures per phase with their
    intervals, and each prompt's tokens on both sides (where the candidate, choosing alone, parts)."""
    if not result.generations:
        return None
    phases = {output: {phase: {"figures": found["figures"], "intervals": {n: s.as_json() for n, s in found["intervals"].items()}, "steps": found["steps"]}
                       for phase, found in by_phase.items()} for output, by_phase in result.phases.items()}
    return {"prompts": len(result.generations), "decode_steps": int(result.steps["step"].max()), "files": {"prompts": PROMPTS_FILE},
            "phases": phases, "generations": result.generations}


def _alignment(result) -> dict | None:
    """For a candidate made by another tool: how many of the model's tensors it has a partner for, and why
    the others have none."""
    if result.candidate_model is None:
        return None
    return {"candidate_model": str(result.candidate_model), "reference_tensors": len(result.table),
            "matched": len(result.table) - len(result.unmatched), "unmatched": result.unmatched}


def _samples_summary(result) -> dict:
    """How many samples were compared, which fail per graph output, and class-score agreement."""
    per_output = {}
    for output, rows in result.samples.groupby("tensor", sort=False):
        failing = rows[rows["status"] == "fail"]
        per_output[output] = {"failing": int(len(failing)), "failing_samples": [int(s) for s in failing["sample"][:100]]}
    return {"compared": result.iterations, "per_output": per_output, "class_agreement": result.class_agreement()}


def worst_tensors(table, count: int = WORST_COUNT):
    """The worst compared float tensors: failing ones first, then by SQNR. A tensor whose reference is all
    within its absolute tolerance of zero has an SQNR that means nothing (any rounding is loud next to
    no signal): it ranks after the others of its group."""
    compared = table[table["sqnr_db"].notna()]
    order = compared.assign(
        _passes=compared["status"] != "fail",
        _near_zero=compared["ref_absmax"] <= compared["atol"],
    ).sort_values(["_passes", "_near_zero", "sqnr_db"], kind="stable")
    return order.head(count)[["tensor", "op_type", "status", "max_abs_err", "sqnr_db", "outside_share"]]


def failure_headline(output: str, result, verb: str = "FAILS") -> str:
    """A failing output in one line (the console's and the report's): its requirement where it is judged by
    one, how many elements leave the tolerance, and the worst of them, if any."""
    row = result.table.set_index("tensor").loc[output]
    required = requirement_text(output, result)
    worst = (f"; worst element {element_index(row)}: reference {row['worst_ref']:.6g}, candidate {row['worst_cand']:.6g}"
             if row["outside_count"] else "")  # an output failing only its requirement has no element out of tolerance
    return (f"output '{output}' {verb}{f' {required}; elementwise' if required else ''}: {int(row['outside_count'])} of {int(row['elements'])} "
            f"elements ({percent(row['outside_share'])}) outside tolerance{worst}")


def requirement_text(output: str, result) -> str | None:
    """The decision targets an output is judged by (--require), with its figures: None where none applies."""
    figures = result.decisions.get(output, {})
    applied = [(name, target) for name, target in result.require.items() if name in figures]
    if not applied:
        return None
    said = [f"{REQUIREMENTS[name][1]} {'>=' if REQUIREMENTS[name][0] == 'min' else '<='} {target:g} ({figure_text(name, figures[name], target)})"
            for name, target in applied]
    return "its requirement " + " and ".join(said)


def requirements_met(result) -> list[str]:
    """The outputs that pass by their requirement (--require) while elements leave the elementwise
    tolerance: said, so that a pass never reads as 'within tolerance'. One whose requirement the data cannot
    resolve does not meet it (it is said as unresolved)."""
    not_met, indexed = {f.tensor for f in result.output_failures} | set(result.unresolved), result.table.set_index("tensor")
    lines = []
    for output in result.outputs["tensor"]:
        required = requirement_text(output, result)
        if required and output not in not_met and indexed.loc[output, "status"] == "fail":
            lines.append(f"output '{output}' meets {required}, though {int(indexed.loc[output, 'outside_count'])} elements are outside the elementwise tolerance")
    return lines


def fed_text(result) -> str:
    """What the comparison was fed, counted: a decoder's prompts (each generated from), or samples."""
    return f"{len(result.generations)} prompt(s)" if result.generations else f"{result.iterations} sample(s)"


def failing_outputs_label(result) -> str:
    return "graph outputs failing their requirement or tolerance" if result.require else "graph outputs out of tolerance"


def tolerance_met_line(output: str, result) -> list[str]:
    """The tolerance a failing output does meet: whether the run's is tighter than the format's rounding."""
    met = result.tolerance_met.get(output)
    if met is None:
        return []
    return [f"tolerance met: {met_words(met, result.tolerances.for_tensor(output))}"]


def met_words(met: dict, tolerance) -> str:
    """The atol and the rtol an output meets, each with the rest of `tolerance` it is met at (an atol of 0 alone
    would read as no error at all), in words (where none would do, why)."""
    atol = f"atol {met['atol']:.3g}" if math.isfinite(met.get("atol", math.nan)) else "no atol (NaN/Inf where the reference is finite)"
    rtol = f"rtol {met['rtol']:.3g}" if math.isfinite(met.get("rtol", math.nan)) else "no rtol (an element whose reference is 0 errs more than atol)"
    return f"{atol} (at rtol {tolerance.rtol:g}, stol {tolerance.stol:g}), or {rtol} (at atol {tolerance.atol:g}, stol {tolerance.stol:g})"


def decision_first_lines(output: str, result, python: bool = False) -> list[str]:
    """What a failing output's error does to the decision taken from it, with its intervals, and the
    requirement on that decision it is shown to meet (what to judge it by, if that is what the user decides by)."""
    prompts = len(result.generations)
    lines = [line[2:] for line in decision_lines(output, result.decisions.get(output, {}), result.output_kinds.get(output), result.intervals.get(output), prompts)]
    lines += [f"  {line}" for line in phase_lines(result.phases.get(output, {}))]
    met = decision_requirement(output, result)
    if met is not None:
        lines.append(f"judged by its decision, it passes: {requirement_option(met, python)} is met ({REQUIREMENTS[met.name][1]} "
                     f"{said_figure(met.name, met.value, met.interval, met.target)})")
    return lines + required_met_lines(output, result, python)


def required_met_lines(output: str, result, python: bool = False) -> list[str]:
    """Of each figure the run requires of `output` (--require) that it does not show met, the strictest
    target of its ladder (objective.LADDERS) its 95% interval does show met: what the candidate can be held
    to, as the tolerance met says for the elementwise tolerance."""
    figures, spans = result.decisions.get(output, {}), result.intervals.get(output, {})
    lines = []
    for name, met in held_to(output, result):
        label, shown = REQUIREMENTS[name][1], said_figure(name, figures[name], spans.get(name))
        if met is None:
            ladder = LADDERS[name]
            lines.append(f"what it meets of its requirement: no {label} target from {ladder[0]:g} to {ladder[-1]:g} is shown met ({shown})")
        else:
            lines.append(f"what it meets of its requirement: {requirement_option(met, python)}, the strictest round {label} target shown met ({shown})")
    return lines


def held_to(output: str, result) -> list[tuple[str, Resolution | None]]:
    """Each figure the run requires of `output` that its interval does not show met (of those LADDERS has
    targets for), with the strictest target of it that it does show met (None: none)."""
    figures, spans = result.decisions.get(output, {}), result.intervals.get(output, {})
    unmet = [name for name, target in result.require.items()
             if name in figures and name in LADDERS and not Objective("tolerance", {name: target}).met(math.inf, figures, spans)]
    return [(name, strictest_met(figures, spans, names={name})) for name in unmet]


def strictest_target_met(output: str, result) -> Resolution | None:
    """The strictest target (objective.LADDERS) `output`'s figures are shown to meet: of the figures the run
    requires of it where it has them, else of any (summary.json's `strictest_met`)."""
    figures = result.decisions.get(output, {})
    required = [name for name in result.require if name in figures]
    return strictest_met(figures, result.intervals.get(output, {}), names=required or None)


def sample_lines(result, shown: frozenset[str] = frozenset(), generation: bool = True) -> list[str]:
    """Per-sample outcome (with several samples) and what the error does to the decision, per graph output
    (but those `shown` already, by decision_first_lines); a decoder's KV-cache outputs in one line and,
    unless `generation` is False (report.html gives them a section of their own), its figures per phase
    and its greedy generation."""
    lines = []
    samples = result.samples
    prompts = len(result.generations)
    state = [o for o in samples["tensor"].unique() if output_kind(result, o) == "state"]
    for output, rows in samples.groupby("tensor", sort=False):
        if output in state:
            continue
        failing = rows[rows["status"] == "fail"]
        if result.iterations > 1 or prompts:
            # An output a requirement judges is judged over them all together: each alone is only in or out of tolerance.
            judged = "is outside its elementwise tolerance on" if requirement_text(output, result) else "fails on"
            text = f"  {'steps' if prompts else 'samples'}: output '{output}' {judged} {len(failing)} of {len(rows)}"
            if len(failing):
                worst = failing.loc[failing["tol_ratio"].idxmax()]
                text += f" (worst: {sample_name(result, int(worst['sample']))}, {percent(worst['outside_share'])} of elements outside, {times_tolerance(worst['tol_ratio'])})"
            lines.append(text)
        if output not in shown:
            lines += decision_lines(output, result.decisions.get(output, {}), result.output_kinds.get(output), result.intervals.get(output), prompts)
            lines += [f"    {line}" for line in phase_lines(result.phases.get(output, {}))] if generation else []
    lines += state_lines(result, state)
    lines += generation_lines(result) if generation else []
    if result.report_dir is not None and result.iterations > 1 and len(result.failing_samples) and not prompts:
        lines.append(f"  the worst failing samples are saved for replay: --load-inputs {result.report_dir / 'worst_samples.npz'}")
    return lines


def fused_nodes_text(inside: dict[str, str]) -> str:
    """How many reference tensors the candidate's fused nodes hold, by op type: "3 Attention nodes hold
    40 each, 1 EmbedLayerNormalization node 25"."""
    held: dict[str, dict[str, int]] = {}
    for node in inside.values():
        op_type = node.split(" ", 1)[0]
        held.setdefault(op_type, {})
        held[op_type][node] = held[op_type].get(node, 0) + 1
    parts = []
    for op_type, counts in sorted(held.items(), key=lambda item: -sum(item[1].values())):
        values = sorted(counts.values(), reverse=True)
        each = f"{values[0]} each" if len(set(values)) == 1 and len(values) > 1 else ", ".join(map(str, values))
        verb = ("hold " if len(values) > 1 else "holds ") if not parts else ""
        parts.append(f"{len(values)} {op_type} node{'s' if len(values) > 1 else ''} {verb}{each}")
    return "; ".join(parts)


def cause_lines(failure, result, python: bool = False) -> list[str]:
    """The cause of one failing output and its repair, as the console, report and pytest plugin show it
    (`python`: its options as `accudiff.compare`'s keyword arguments, for the plugin)."""
    cause = failure.cause
    status = "not verified: the rules' hypothesis"
    target = "its requirement" if requirement_text(failure.tensor, result) else "the tolerance"
    if cause.verified:
        status = f"verified at the output on {cause.stand_in}, standing in for the captured candidate" if cause.stand_in else "verified at the output"
    if cause.kind in ("local", "several", "dominant"):
        what = {"local": "introduces the error", "several": "is one of several causes", "dominant": "carries most of the error, the rest accumulates"}[cause.kind]
        lines = [f"cause: {cause.op_type} '{cause.node}' {what} (its output '{cause.tensor}'; {status})"]
        before = failure.repair.steps[0].tol_ratio if failure.repair is not None and failure.repair.steps else math.inf
        if cause.alternatives and before <= JUST_PAST:  # several single keeps each repair a barely failing output: no one node introduces the error
            lines = [f"cause: the error accumulates just past {target}: keeping {cause.op_type} '{cause.node}' repairs the output, the best of "
                     f"the {len(cause.alternatives) + 1} single keeps that each do (its output '{cause.tensor}'; {status})"]
        lines += [f"  {f.kind}: {f.message}" for f in cause.findings]
        lines += tried_subset_lines(failure, result)
        lines += [f"  also repairs it alone: {c.op_type} '{c.node}' ({_kept_effect(c, result.require)})" for c in cause.alternatives]
        for c in cause.co_causes:
            lines.append(f"  also: {c.op_type} '{c.node}' ({_kept_effect(c, result.require)})")
            lines += [f"    {f.kind}: {f.message}" for f in c.findings if f.kind != "own_error"]
    elif cause.kind in ("accumulated", "not_found"):
        lines = [accumulated_headline(cause, target) if cause.kind == "accumulated" else
                 "cause: not found: NaN/Inf reach this output and no keep tried removes them (see the findings upstream)"]
        lines += [f"  {f.kind}: {f.message}" for f in cause.findings]
        lines += tried_subset_lines(failure, result)
    else:
        lines = ["cause: unknown: no range fault found, and without the isolated run (--no-isolate) one node's own error "
                 "cannot be told from error that adds up"]
    lines += split_lines(failure.tensor, result)
    for absorbed in cause.absorbed:
        # What the table shows of the node named is the error the path carries there (every node's upstream, not
        # only this one's): the keep is what rules the node out.
        by = f"; on its way to the output, the error shrinks across {absorbed.by_op_type} '{absorbed.by}' ({absorbed.evidence})" if absorbed.by else ""
        lines.append(f"  ruled out: {absorbed.op_type} '{absorbed.node}' (flagged by the rules): kept in higher precision alone, it leaves the output at "
                     f"{describe(absorbed.tol_ratio_kept, absorbed.figures_kept, result.require)}{by}")
    if cause.kind in ("accumulated", "not_found", "dominant", "unknown") and cause.contributors:
        measured = cause.contributors[0].tol_ratio_kept is not None
        lines.append("  contributors, by their effect at the output (the output with each kept):" if measured
                     else "  largest own errors upstream (isolated run):")
        for c in cause.contributors:
            lines.append(f"    {c.op_type} '{c.node}': {_kept_effect(c, result.require) if measured else _own_error(c)}")
            if not measured:
                lines += [f"      {f.kind}: {f.message}" for f in c.findings]
    lines += repair_lines(failure, result, python)
    return lines


def accumulated_headline(cause, target: str) -> str:
    """An error no single node breaks: small errors growing, or, where nodes upstream err past their own
    tolerance (the isolated run), their errors adding up (a dozen Mul nodes each far off is no small error)."""
    # Only a search over every node upstream shows that none breaks it alone: unverified, it is the rules' reading.
    said = ": no single node breaks this output" if cause.verified else " (not verified: the rules' hypothesis)"
    if not cause.failing_alone:
        return f"cause: accumulated error{said}; small errors grow past {target} on the way"
    return (f"cause: accumulated error{said}; errors made at more than one place add up past {target} "
            f"({cause.failing_alone} node(s) upstream err past their own tolerance fed the reference's values)")


def split_lines(output: str, result) -> list[str]:
    """Which share of a candidate's loss each part of its narrowing brings, over every node it narrows (not
    the cause's alone: its own parts are its "part" finding): its quantization against its FP16/BF16
    casts, its activations' quantization against its weights', its matrix ops' against the other ops'."""
    split = result.loss_split.get(output)
    if not split:
        return []
    ratios, figures = split["ratios"], split["figures"]
    formats = result.precision.split("+")
    stored = "/".join(f.upper() for f in formats if f in ("fp16", "bf16"))
    quantized = "+".join(f.upper() for f in formats if f not in ("fp16", "bf16"))
    # what is left when a part is undone: the other part alone
    said = {"casts": f"the quantization alone ({quantized})", "quantization": f"the {stored} casts alone",
            "activations": "the weights' quantization alone (every activation float)", "weights": "the activations' quantization alone (every weight float)",
            **_by_op_type(split.get("op_types", {}))}

    def read(key: str, named: bool = False) -> str:
        """A part's figure: by the output's requirement where it has one, else by its tolerance ratio."""
        return describe(ratios[key], {name: value for name, value in figures[key].items() if name in result.require}, result.require, named)

    lines = []
    for first, second, over in (("casts", "quantization", "over the whole candidate"), ("activations", "weights", "over the whole candidate"),
                                ("other_ops", "matrix_ops", "by op type")):
        if first in ratios and second in ratios:
            lines.append(f"  loss split {over}: {said[first]} leaves the output at {read(first)}, {said[second]} at "
                         f"{read(second)}, both at {read('with_both', named=True)}{_split_decisions([figures[key] for key in (first, second, 'with_both')], result.require)}")
    return lines


# How a loss split's decision figure is said beside its three ratios: a ratio set by the worst element saturates
# where a map's element flips from 0 to 1 (every part of a detector's split read 33.3x, while the share of its
# map flipped was 4.17%, 5.17% and 5.52%).
SPLIT_FIGURE_TEXT = {"top1": lambda v: percent(v, 1), "cosine_min": lambda v: figure_text("cosine_min", v),
                     "detections": lambda v: percent(v, 1), "flipped_share": lambda v: figure_text("flipped_share", v)}


def _split_decisions(readings: list[Mapping[str, float]], require: Mapping[str, float]) -> str:
    """The output's decision figure for each part of a loss split and for both, where the output has one and no
    requirement says it already (`describe` gives a required figure with its reading)."""
    name = decision_figure(readings[-1])
    if name is None or name in require or any(name not in reading for reading in readings):
        return ""
    said = SPLIT_FIGURE_TEXT[name]
    return f"; {REQUIREMENTS[name][1]} {said(readings[0][name])}, {said(readings[1][name])} and {said(readings[2][name])}"


def _by_op_type(op_types: Mapping[str, Mapping[str, int]]) -> dict[str, str]:
    """What each side of the split by op type leaves quantized, by the op types it keeps ("matrix_ops": the
    Conv, MatMul and Gemm nodes)."""
    if not op_types:
        return {}
    matrix = " and ".join(op_types["matrix_ops"])
    counts = ", ".join(f"{t} x{k}" for t, k in op_types["other_ops"].items())
    return {"other_ops": f"the {matrix} nodes' quantization alone (every other quantized node float: {counts})",
            "matrix_ops": f"the other ops' quantization alone (every {matrix} node float)"}


def _kept_effect(c, require: Mapping[str, float]) -> str:
    return f"kept, the output is at {describe(c.tol_ratio_kept, c.figures_kept, require)}" + (f" (with {len(c.keep) - 1} node(s) it needs kept beside it)" if len(c.keep) > 1 else "")


def _own_error(c) -> str:
    return f"SQNR {c.isolated_sqnr_db:.1f} dB, max abs err {c.isolated_max_abs_err:.3g} ({times_tolerance(c.isolated_tol_ratio)})"


def element_index(row) -> str:
    shape = [int(d) for d in str(row["shape"]).split("x") if d]
    flat = int(row["worst_index"])
    if flat < 0:
        return "?"
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return "[" + ", ".join(map(str, reversed(index))) + "]"


def worst_samples(result, count: int = WORST_SAMPLE_COUNT) -> list[int]:
    """The failing samples, by what they lose (CompareResult.losing_samples: a replay shows a lost decision
    too; none to pick out of a single sample: inputs.npz replays it)."""
    if result.iterations < 2 or result.generations:  # a decoder's samples are steps of its prompts: prompts.npz replays them
        return []
    return result.losing_samples()[:count]


def finite(value):
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
