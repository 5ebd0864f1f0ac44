"""The short console summary: the verdict and the next thing to do, then what was compared and found."""

from __future__ import annotations

import sys
import textwrap
from typing import TextIO

from accudiff.report.content import (cause_lines, decision_first_lines, failure_headline, fused_nodes_text, requirements_met, sample_lines,
                                     tolerance_met_line, worst_tensors)
from accudiff.report.next_steps import next_step_lines
from accudiff.report.decision_text import unresolved_lines
from accudiff.model.decoder import model_name
from accudiff.text import percent


KEPT_SHOWN = 5  # nodes kept in FP32 the console lists
UNBROKEN = ("accudiff ", "keep_fp32=", "require=")  # lines pasted whole: never wrapped


def format_summary(result, width: int | None = None) -> str:
    """The console's summary: the verdict and the one next thing to do first, then what was compared, each
    failing output (what its error does to the decision, the tolerance it meets, its cause and repair), and
    the worst tensors where something fails. `width`: lines are wrapped at it (commands never are)."""
    table = result.table
    indexed = table.set_index("tensor")
    compared, computed = result.coverage
    lines = [f"accudiff compare {model_name(result.model)} [{result.precision}]", f"  {_verdict(result)}"]
    lines += [f"  {line}" for line in next_step_lines(result)]
    lines += [
        f"  candidate: {result.candidate}",
        f"  tensors compared: {compared} of {computed} ({percent(compared / max(computed, 1), 0)}), {'prompts' if result.generations else 'samples'}: "
        f"{len(result.generations) or result.iterations}, "
        f"tolerance: atol={result.tolerances.default.atol:g} rtol={result.tolerances.default.rtol:g} stol={result.tolerances.default.stol:g}",
    ]
    if result.inside:
        lines.append(f"  inside fused nodes, compared at their outputs: {len(result.inside)} more ({fused_nodes_text(result.inside)})")
    lines += [f"  notice: {notice}" for notice in result.notices]
    if result.kept:
        lines.append(f"  kept in FP32: {len(result.kept)} node(s)")
        lines += [f"    {k.node} ({k.op_type}): {k.reason}" for k in result.kept[:KEPT_SHOWN]]
        if len(result.kept) > KEPT_SHOWN:
            lines.append(f"    and {len(result.kept) - KEPT_SHOWN} more (summary.json: kept_fp32)")
    if result.not_observable:
        lines.append(f"  not observable: {len(result.not_observable)} tensor(s), e.g. {next(iter(result.not_observable.items()))[0]}")
    failure = result.first_failure
    if failure is None:
        lines.append("  every tensor is within tolerance")
    else:
        row = indexed.loc[failure.tensor]
        isolated = {"pass": "; fed the reference's values it passes (error carried in)", "fail": "; fed the reference's values it still fails"}
        lines.append(
            f"  first tensor out of tolerance (topological order): '{failure.tensor}' ({failure.op_type} '{failure.node}'), "
            f"{percent(row['outside_share'])} of elements{isolated.get(row.get('isolated_status'), '')}"
        )
    lines += [f"  {line}" for line in requirements_met(result)]
    lines += [f"  {line}" for line in unresolved_lines(result)]
    for out in result.output_failures:
        lines.append(f"  {failure_headline(out.tensor, result)}")
        lines += ["    " + line for line in [*decision_first_lines(out.tensor, result), *tolerance_met_line(out.tensor, result), *cause_lines(out, result)]]
        if out.first_failing_upstream not in (None, out.tensor, out.cause.tensor):
            lines.append(f"    (the first tensor out of tolerance on its way is '{out.first_failing_upstream}')")
        lines += _backend_lines(indexed.loc[out.cause.tensor if out.cause.tensor else out.tensor])
    lines += sample_lines(result, frozenset(f.tensor for f in result.output_failures))
    rows = []  # a table: its rows are never wrapped
    if result.verdict == "fail":
        lines.append("  worst tensors (failing first, then lowest SQNR):")
        shown = worst_tensors(table)
        names, ops = max([32, *shown["tensor"].str.len()]), max([14, *shown["op_type"].str.len()])  # columns stay aligned
        for _, worst in shown.iterrows():
            rows.append(
                f"    {worst['tensor']:<{names}} {worst['op_type']:<{ops}} {worst['status']:<5} max abs err {worst['max_abs_err']:<10.3g} SQNR {worst['sqnr_db']:6.1f} dB"
            )
    elif failure is not None:
        outside = int((table["status"] == "fail").sum())
        lines.append(f"  {outside} tensor(s) are outside their elementwise tolerance, which the verdict does not judge them by (tensors.csv lists them)")
    tail = [f"  report: {result.report_dir}"] if result.report_dir is not None else []
    return "\n".join([*(wrapped(lines, width) if width else lines), *rows, *tail])


def _verdict(result) -> str:
    compared, computed = result.coverage
    if result.verdict == "inconclusive" and result.unresolved:
        return f"verdict: INCONCLUSIVE ({len(result.unresolved)} output(s) whose requirement the data cannot resolve; no output fails)"
    if result.verdict == "inconclusive":
        return (f"verdict: INCONCLUSIVE (no graph output out of tolerance, but only {compared} of the {computed} tensors the model computes "
                f"({percent(compared / max(computed, 1), 0)}) were compared: see 'not observable')")
    return (f"verdict: {result.verdict.upper()} ({len(result.output_failures)} of {len(result.outputs)} graph output(s) "
            f"{'fail their requirement or tolerance' if result.require else 'out of tolerance'})")


def wrapped(lines: list[str], width: int) -> list[str]:
    """Each line wrapped at `width`, its continuation indented under it; a command (or a keyword argument,
    or a table row) is never broken: it is pasted whole."""
    out = []
    for line in lines:
        text = line.lstrip(" ")
        indent = " " * (len(line) - len(text))
        if len(line) <= width or text.startswith(UNBROKEN):
            out.append(line)
        else:
            out += textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent + "    ", break_long_words=False, break_on_hyphens=False)
    return out


def _backend_lines(row) -> list[str]:
    """With a second candidate (--also), whether the same model fails there too: the model, or the build."""
    lines = []
    for backend in ("onnxrt", "trt"):
        if f"{backend}_status" in row.index:
            lines.append(
                f"    the same model on {backend}: {row[f'{backend}_status']}, SQNR {row[f'{backend}_sqnr_db']:.1f} dB "
                f"(here {row['sqnr_db']:.1f} dB): {'the model itself' if row[f'{backend}_status'] == 'fail' else 'the build'} causes it"
            )
    return lines


def format_timings(result) -> str:
    """Where the time went (`--timings`): this process's stages, then each stage's workers by phase."""
    stages = result.timings
    lines = [f"  time: {sum(stages.values()):.2f} s in this process (stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()) + ")"]
    if result.layout:
        threads = " or ".join(str(t) for t in result.layout["threads"])
        beside = result.layout.get("sessions_at_once", 1)
        lines.append(f"    comparison: {result.layout['workers']} worker(s), {threads} thread(s) each" + (f", up to {beside} sessions at once" if beside > 1 else ""))
    for stage, phases in result.worker_timings.items():
        runs = {k.removeprefix("runs: "): v for k, v in phases.items() if k.startswith("runs: ")}
        shown = [f"{k} {v:.2f} s" for k, v in phases.items() if not k.startswith("runs: ")]
        if runs:
            shown.append(f"runs {sum(runs.values()):.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in runs.items()) + ")")
        lines.append(f"    {stage} workers (seconds added over workers): " + ", ".join(shown))
    return "\n".join(lines)


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, stream: TextIO | None = None, width: int = 30):
        """`stream`: default, sys.stderr as it is now (not as it was when this module was imported: a
        caller may have replaced it since, as pytest's capture does)."""
        self.stream, self.width = stream if stream is not None else sys.stderr, width
        self.enabled = self.stream.isatty()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        filled = int(self.width * done / max(total, 1))
        self.stream.write(f"\r  {phase} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}")
        if done >= total:
            self.stream.write("\r" + " " * (self.width + 30) + "\r")
        self.stream.flush()
