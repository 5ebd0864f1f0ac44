"""The short console summary: first failure, worst tensors, diagnosis, verdict."""

from __future__ import annotations

import re

import sys
from typing import TextIO

from accudiff.report.writer import worst_tensors


def format_summary(result) -> str:
    table = result.table
    indexed = table.set_index("tensor")
    compared, computed = result.coverage
    lines = [
        f"accudiff compare {result.model.name} [{result.precision}]",
        f"  candidate: {result.candidate}",
        f"  tensors compared: {compared} of {computed} ({compared / max(computed, 1):.0%}), samples: {result.iterations}, "
        f"tolerance: atol={result.tolerances.default.atol:g} rtol={result.tolerances.default.rtol:g} stol={result.tolerances.default.stol:g}",
    ]
    lines += [f"  notice: {notice}" for notice in result.notices]
    if result.kept:
        lines.append(f"  kept in FP32: {len(result.kept)} node(s)")
        lines += [f"    {k.node} ({k.op_type}): {k.reason}" for k in result.kept[:5]]
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
            f"{row['outside_share']:.1%} of elements{isolated.get(row.get('isolated_status'), '')}"
        )
    for out in result.output_failures:
        row = indexed.loc[out.tensor]
        lines.append(
            f"  output '{out.tensor}' FAILS: {int(row['outside_count'])} of {int(row['elements'])} elements ({row['outside_share']:.1%}) outside tolerance; "
            f"worst element {element_index(row)}: reference {row['worst_ref']:.6g}, candidate {row['worst_cand']:.6g}"
        )
        lines += ["    " + line for line in cause_lines(out, result)]
        if out.first_failing_upstream not in (None, out.tensor, out.cause.tensor):
            lines.append(f"    (the first tensor out of tolerance on its way is '{out.first_failing_upstream}')")
        lines += _backend_lines(indexed.loc[out.cause.tensor if out.cause.tensor else out.tensor])
    lines += sample_lines(result)
    if failure is not None:
        lines.append("  worst tensors (failing first, then lowest SQNR):")
        shown = worst_tensors(table)
        names, ops = max([32, *shown["tensor"].str.len()]), max([14, *shown["op_type"].str.len()])  # columns stay aligned
        for _, worst in shown.iterrows():
            lines.append(
                f"    {worst['tensor']:<{names}} {worst['op_type']:<{ops}} {worst['status']:<5} max abs err {worst['max_abs_err']:<10.3g} SQNR {worst['sqnr_db']:6.1f} dB"
            )
    outputs = result.outputs
    if result.verdict == "inconclusive":
        lines.append(
            f"  verdict: INCONCLUSIVE (no graph output out of tolerance, but only {compared} of the {computed} tensors the model computes "
            f"({compared / max(computed, 1):.0%}) were compared: see 'not observable')"
        )
    else:
        lines.append(
            f"  verdict: {result.verdict.upper()} ({len(result.output_failures)} of {len(outputs)} graph output(s) out of tolerance)"
        )
    if result.report_dir is not None:
        lines.append(f"  report: {result.report_dir}")
    return "\n".join(lines)


def sample_lines(result) -> list[str]:
    """Per-sample outcome (with several samples) and class-score agreement, per graph output."""
    lines = []
    samples = result.samples
    for output, rows in samples.groupby("tensor", sort=False):
        failing = rows[rows["status"] == "fail"]
        if result.iterations > 1:
            text = f"  samples: output '{output}' fails on {len(failing)} of {len(rows)}"
            if len(failing):
                worst = failing.loc[failing["tol_ratio"].idxmax()]
                text += f" (worst: sample {int(worst['sample'])}, {worst['outside_share']:.1%} of elements outside, {worst['tol_ratio']:.3g}x its tolerance)"
            lines.append(text)
        agreement = result.class_agreement().get(output)
        if agreement is not None:
            lines.append(
                f"  class scores '{output}': top-1 agreement {agreement['top1']:.2%}, top-5 {agreement['top5']:.2%} over {agreement['rows']} score vector(s)"
            )
    if result.report_dir is not None and result.iterations > 1 and len(result.failing_samples):
        lines.append(f"  the worst failing samples are saved for replay: --load-inputs {result.report_dir / 'worst_samples.npz'}")
    return lines


def cause_lines(failure, result) -> list[str]:
    """The cause of one failing output and its repair, as the console, report and pytest plugin show it."""
    cause = failure.cause
    status = "verified at the output" if cause.verified else "not verified (--no-verify): the rules' hypothesis"
    if cause.kind in ("local", "several"):
        what = "introduces the error" if cause.kind == "local" else "is one of several causes"
        lines = [f"cause: {cause.op_type} '{cause.node}' {what} (its output '{cause.tensor}'; {status})"]
        lines += [f"  {f.kind}: {f.message}" for f in cause.findings]
        lines += [f"  also: {c.op_type} '{c.node}' ({_kept_effect(c)})" for c in cause.co_causes]
    elif cause.kind == "accumulated":
        lines = ["cause: accumulated error: no single node breaks this output; small errors grow past the tolerance on the way"]
        lines += [f"  {f.kind}: {f.message}" for f in cause.findings]
    else:
        lines = ["cause: unknown: no range fault found, and without the isolated run (--no-isolate) one node's own error "
                 "cannot be told from error that adds up"]
    for absorbed in cause.absorbed:
        by = f"its error is absorbed downstream by {absorbed.by_op_type} '{absorbed.by}'; " if absorbed.by else ""
        lines.append(f"  ruled out: {absorbed.op_type} '{absorbed.node}' (flagged by the rules): {by}kept in higher precision alone, it leaves the output at {absorbed.tol_ratio_kept:.3g}x its tolerance")
    if cause.kind in ("accumulated", "unknown") and cause.contributors:
        measured = cause.contributors[0].tol_ratio_kept is not None
        lines.append("  contributors, by their effect at the output (the output's tolerance ratio with each kept):" if measured
                     else "  largest own errors upstream (isolated run):")
        for c in cause.contributors:
            lines.append(f"    {c.op_type} '{c.node}': {_kept_effect(c) if measured else _own_error(c)}")
            if not measured:
                lines += [f"      {f.kind}: {f.message}" for f in c.findings]
    lines += repair_lines(failure, result)
    return lines


def repair_lines(failure, result) -> list[str]:
    """The verified repair, one line per step; without one, how to look for it."""
    repair = failure.repair
    flag = {"fp16": " --fp16", "int8": " --int8"}.get(result.precision, "")
    if repair is None or len(repair.steps) < 2:
        return [f"  to find the nodes to keep in higher precision: accudiff bisect precision {result.model}{flag}"]
    samples = f"on {len(repair.samples)} failing sample(s)" if repair.samples else ""
    head = "repair (verified" if repair.verified else "repair (NOT verified: the output still fails"
    lines = [f"  {head} {samples}): keep {len(repair.keep)} node(s) in higher precision: " + ", ".join(f"'{n}'" for n in repair.keep)]
    for number, step in enumerate(repair.steps):
        kept = "nothing kept" if not step.keep else f"keep {len(step.keep)} node(s)"
        lines.append(f"    step {number}: {kept} -> output at {step.tol_ratio:.3g}x its tolerance")
    if repair.verified:
        lines.append("    apply it: " + " ".join(f"--keep-fp32 '{re.escape(n)}'" for n in repair.keep))
    return lines


def _kept_effect(c) -> str:
    return f"kept, the output is at {c.tol_ratio_kept:.3g}x its tolerance" + (f" ({len(c.keep)} nodes kept with what its boundaries need)" if len(c.keep) > 1 else "")


def _own_error(c) -> str:
    return f"SQNR {c.isolated_sqnr_db:.1f} dB, max abs err {c.isolated_max_abs_err:.3g} ({c.isolated_tol_ratio:.2g}x its tolerance)"


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


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30):
        self.stream, self.width = stream, width
        self.enabled = stream.isatty()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        filled = int(self.width * done / max(total, 1))
        self.stream.write(f"\r  {phase} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}")
        if done >= total:
            self.stream.write("\r" + " " * (self.width + 30) + "\r")
        self.stream.flush()
