"""The short console summary: first failure, worst tensors, diagnosis, verdict."""

from __future__ import annotations

import sys
from typing import TextIO

from accudiff.report.writer import worst_tensors


def format_summary(result) -> str:
    table = result.table
    compared = int((table["status"] != "not observed").sum())
    lines = [
        f"accudiff compare {result.model.name} [{result.precision}]",
        f"  candidate: {result.candidate}",
        f"  tensors compared: {compared} of {len(table)}, iterations: {result.iterations}, "
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
        row = table.set_index("tensor").loc[failure.tensor]
        lines.append(
            f"  first failure: '{failure.tensor}' ({failure.op_type} '{failure.node}'): max abs err {row['max_abs_err']:.3g}, "
            f"{row['outside_share']:.1%} of elements outside tolerance"
        )
        lines += [f"    {f.kind}: {f.message}" for f in failure.findings]
        for backend in ("onnxrt", "trt"):
            if f"{backend}_status" in row.index:
                lines.append(
                    f"    the same model on {backend}: {row[f'{backend}_status']}, SQNR {row[f'{backend}_sqnr_db']:.1f} dB "
                    f"(here {row['sqnr_db']:.1f} dB): {'the model itself' if row[f'{backend}_status'] == 'fail' else 'the build'} causes it"
                )
        lines.append("  worst tensors (lowest SQNR):")
        for _, worst in worst_tensors(table).iterrows():
            lines.append(
                f"    {worst['tensor']:<32} {worst['op_type']:<14} {worst['status']:<5} max abs err {worst['max_abs_err']:<10.3g} SQNR {worst['sqnr_db']:6.1f} dB"
            )
    for out in result.output_failures:
        row = table.set_index("tensor").loc[out.tensor]
        index = element_index(row)
        lines.append(
            f"  output '{out.tensor}' FAILS: {int(row['outside_count'])} of {int(row['elements'])} elements ({row['outside_share']:.1%}) outside tolerance; "
            f"worst element {index}: reference {row['worst_ref']:.6g}, candidate {row['worst_cand']:.6g}"
        )
        lines += [f"    {f.kind}: {f.message}" for f in out.findings]
        if out.origin and out.origin != out.tensor:
            lines.append(f"    the error starts upstream at '{out.origin}'")
    outputs = result.outputs
    lines.append(
        f"  verdict: {'PASS' if result.passed else 'FAIL'} ({len(result.output_failures)} of {len(outputs)} graph output(s) out of tolerance)"
    )
    if result.report_dir is not None:
        lines.append(f"  report: {result.report_dir}")
    return "\n".join(lines)


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
