"""What to do next, in commands that run as printed (the console, report.html, the pytest plugin's message):
the comparison again with a repair's nodes kept, judged by a requirement its decision is shown to meet,
or `accudiff bisect precision` on it. Every option the run was given goes with them, its inputs as the
report saved them. Python callers (the API, the pytest plugin) get `accudiff.compare`'s keyword arguments
instead of flags.
"""

from __future__ import annotations

import re
import shlex

from accudiff.judging.objective import REQUIREMENTS, TIGHTER_BY, Resolution, figure_text, strictest_met, tighter_target, wrong_by
from accudiff.model.quantized_ops import op_types_option


def decision_requirement(output: str, result) -> Resolution | None:
    """The strictest requirement on the decision taken from `output` its figures are shown to meet
    (objective.strictest_met); None where the run already judges the output by a requirement."""
    figures = result.decisions.get(output, {})
    if any(name in figures for name in result.require):
        return None
    return strictest_met(figures, result.intervals.get(output, {}))


def requirements_every_output_meets(held: list[Resolution]) -> list[str]:
    """The requirements (`name=target`) that every output whose decision is shown to hold meets, one per
    figure: of several outputs' on one figure, the least strict, as a later --require of a figure replaces
    an earlier one (both printed, the stricter would fail an output the other passes)."""
    least = {r.name: r for r in sorted(held, key=lambda r: r.target if r.direction == "max" else -r.target)}
    return [f"{r.name}={r.target:g}" for r in least.values()]


def requirement_option(resolution: Resolution, python: bool) -> str:
    """A requirement as an option: `--require top1=0.99`, or `require=['top1=0.99']`."""
    text = f"{resolution.name}={resolution.target:g}"
    return f"require=[{text!r}]" if python else f"--require {text}"


def compare_command(result, extra: list[str]) -> str | None:
    """The comparison again with `extra` arguments, as a shell command; None where its inputs are saved nowhere."""
    return shlex.join([*result.replay, *extra]) if result.replayable else None


def bisect_command(result, extra: list[str] = ()) -> str | None:
    """`accudiff bisect precision` on what was compared, with every option it takes (and `extra`); None as above."""
    return shlex.join(["accudiff", "bisect", "precision", *result.settings.arguments("bisect"), *extra]) if result.replayable else None


CEILING_SHARE = 0.99  # a worst element erring by this share of the range the reference takes, or more: the ratio at its ceiling


def ratio_ceiling(output: str, result) -> str | None:
    """Where `output`'s tolerance ratio sits at its ceiling, what sets it: its worst element moved across the
    whole range the reference takes (a probability map's pixel from 0 to 1). The ratio stays there while that
    element does, and a search by the tolerance keeps nodes until no element does (on the PP-OCRv4 detector
    quantized per tensor, 315 of its 330 nodes; by its flipped share, 1% needed 27)."""
    rows = result.table[result.table["tensor"] == output]
    if rows.empty:
        return None
    row = rows.iloc[0]
    span = float(row["ref_max"]) - float(row["ref_min"])
    if not span > 0 or not abs(float(row["worst_cand"]) - float(row["worst_ref"])) >= CEILING_SHARE * span:
        return None
    return (f"its worst element goes from {row['worst_ref']:.3g} to {row['worst_cand']:.3g}, the whole range the reference takes, "
            "and the ratio stays there while that element does")


def decision_search(output: str, result) -> tuple[str, Resolution] | None:
    """For an output at its ratio's ceiling (`ratio_ceiling`) whose decision has a figure the run does not
    require yet: what sets the ceiling, and a target to search by instead (objective.tighter_target)."""
    figures = result.decisions.get(output, {})
    if any(name in figures for name in result.require) or (target := tighter_target(figures, result.intervals.get(output, {}))) is None:
        return None
    ceiling = ratio_ceiling(output, result)
    return (ceiling, Resolution(target[0], target[1], figures[target[0]], "missed")) if ceiling else None


def decision_search_lines(aimed: dict[str, tuple[str, Resolution]], result, indent: str = "", named: bool = True) -> list[str]:
    """How to search by the decision for the outputs at their ratio's ceiling (`decision_search`), the command
    last; `named`: each output named (else the lines are under the one output's own heading)."""
    chosen: dict[str, float] = {}  # per figure, the strictest output's target: one --require of it holds every output to it
    for _, t in aimed.values():
        chosen[t.name] = min(chosen.get(t.name, t.target), t.target, key=lambda target: wrong_by(t.name, target))
    said = "; ".join(f"{'the tolerance ratio of ' + repr(output) if named else 'its tolerance ratio'} is at its ceiling: {ceiling}"
                     for output, (ceiling, _) in aimed.items())
    targets = ", ".join(f"a {REQUIREMENTS[t.name][1]} of {figure_text(t.name, chosen[t.name])}, where it is {figure_text(t.name, t.value)}" for _, t in aimed.values())
    command = bisect_command(result, [item for name, target in chosen.items() for item in ("--require", f"{name}={target:g}")]) or f"accudiff bisect precision ({unsaved_inputs_text()})"
    return [f"{indent}{said}. Find the nodes to keep for what it decides instead, at a figure you accept "
            f"(here {targets}: 1/{TIGHTER_BY} or less of what it gets wrong now):", f"{indent}  {command}"]


def keep_option(result, nodes: list[str], python: bool) -> str:
    """Keeping `nodes` in higher precision beside what the run kept already: a keyword argument, or the command."""
    patterns = [re.escape(n) for n in nodes]
    if python:
        given = list(result.settings.keep_fp32) if result.settings is not None else []
        return f"keep_fp32=[{', '.join(repr(p) for p in [*given, *patterns])}]"
    return compare_command(result, [item for p in patterns for item in ("--keep-fp32", p)]) or " ".join(f"--keep-fp32 {shlex.quote(p)}" for p in patterns)


def unsaved_inputs_text() -> str:
    return "its inputs are saved nowhere yet: result.write_report(folder) saves them, and its report holds the command"


def next_step_lines(result, python: bool = False) -> list[str]:
    """The one next thing to do, first among what a run prints: apply the verified repairs (or, where the decision
    meets a requirement, judge by it); where the error accumulates and the decision meets a requirement, judge
    by it (or find the nodes to keep); else find them."""
    if result.verdict != "fail":
        return []
    failures = [f for f in result.output_failures if f.tensor]
    repairs = [f.repair for f in failures if f.repair is not None and f.repair.verified]
    held = [r for f in failures if (r := decision_requirement(f.tensor, result)) is not None]
    judged = None
    if held and len(held) == len(failures):
        texts = requirements_every_output_meets(held)
        said = (f"require={texts!r}" if python else
                compare_command(result, [item for text in texts for item in ("--require", text)]) or " ".join(f"--require {t}" for t in texts))
        # what the decision is shown to meet, not that it "holds": 90% top-1 agreement, or a KL of 0.02, is met by a decision that moves
        judged = (" and ".join(texts), f"  {said}")
    if len(repairs) == len(failures):
        # A repair that holds the tolerance may cost what the decision never needed (an INT4 decoder's lm_head kept
        # in FP32, its KL already met): both are said, the repair first.
        alternative = [f"or, as what it decides meets {judged[0]}, if the decision is what you judge the model by:", judged[1]] if judged else []
        keep = list(dict.fromkeys(n for r in repairs for n in r.keep))
        outputs = f"output{'s' if len(failures) > 1 else ''}"
        by_type = {tuple(r.op_types) for r in repairs}
        if len(by_type) == 1 and repairs[0].op_types and (option := op_types_option(keep, result.quantized_by, repairs[0].op_types)) is not None:
            # every quantized node but the matrix ops kept: a screen of names, where the quantizer has one option for it
            kept = f": {result.report_dir / result.repaired_candidate}" if result.repaired_candidate and result.report_dir else ""
            return [f"next: quantize only its {' and '.join(repairs[0].op_types)} nodes (verified at the {outputs} with every other quantized node "
                    f"kept in higher precision{kept}; see the repair below):", f"  {option}", *alternative]
        return [f"next: keep {len(keep)} node(s) in higher precision (verified at the {outputs}):", f"  {keep_option(result, keep, python)}", *alternative]
    bisect = bisect_command(result) or f"accudiff bisect precision ({unsaved_inputs_text()})"
    if judged:
        return [f"next: out of tolerance, but what it decides meets {judged[0]}; if the decision is what you judge the model by:", judged[1],
                "or, for the tolerance, find the nodes to keep in higher precision:", f"  {bisect}"]
    aimed = {f.tensor: found for f in failures if (found := decision_search(f.tensor, result)) is not None}
    if aimed:
        first, command = decision_search_lines(aimed, result)
        return [f"next: {first}", command, "or, for the tolerance:", f"  {bisect}"]
    return ["next: find the nodes to keep in higher precision:", f"  {bisect}"]
