"""Run a bisector into a report folder (result.json, report.html, and its models), and word its result for the
console."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pandas as pd

from accudiff.bisect.precision import KEEP_LIST_FILE, RANKING_FILE, bisect_precision
from accudiff.bisect.session import BisectSession, stderr_progress
from accudiff.bisect.subgraph import bisect_subgraph
from accudiff.diagnosis.cause import CAUSE_KINDS
from accudiff.report.folder import ReportFolder
from accudiff.report.content import HTML_FILE, finite, remake_lines
from accudiff.report.decision_text import decision_lines
from accudiff.report.html import bisect_page
from accudiff.settings import RunSettings

RESULT_FILE = "result.json"
RESULT_SCHEMA = "accudiff.bisect.result"


def run_bisector(name: str, settings: RunSettings, out_dir: Path) -> tuple[str, bool]:
    """Run bisector `name`; returns the console summary and whether a failure was found."""
    folder = ReportFolder(Path(out_dir))
    steps: list[str] = []
    show = stderr_progress()

    def progress(message: str) -> None:
        steps.append(message)
        show(message)

    session = BisectSession(settings, progress)
    model, precision = settings.model, settings.precision
    try:
        if name == "subgraph":
            result = bisect_subgraph(session, folder.path)
            text, found = _subgraph_text(result, folder.final), result.output is not None
        else:
            result = bisect_precision(session, folder.path)
            text, found = _precision_text(result, folder.final, settings), not result.passed_without_changes
        fields = {key: value for key, value in vars(result).items() if not isinstance(value, pd.DataFrame)}
        document = {"schema": RESULT_SCHEMA, "schema_version": 2, "bisector": name, "model": str(model), "precision": precision, **fields}
        folder.write_text(RESULT_FILE, json.dumps(finite(document), indent=2) + "\n")
        files = {"keep_list": KEEP_LIST_FILE if name == "precision" and getattr(result, "keep", None) else None}
        folder.write_text(HTML_FILE, bisect_page(name, Path(model).name, precision, result, steps, files))
        folder.commit()
    except BaseException:
        folder.discard()
        raise
    finally:
        session.close()
    return text, found


def _subgraph_text(result, folder: Path) -> str:
    lines = [f"accudiff bisect subgraph: {result.candidate_runs} candidate runs (at most {result.bound} on any path the search could take)"]
    if result.output is None:
        lines.append("  every graph output is within tolerance: nothing to isolate")
        return "\n".join(lines)
    lines.append(f"  failing output: '{result.output}' ({CAUSE_KINDS.get(result.cause_kind, CAUSE_KINDS['unknown'])})")
    if result.interrupted:
        lines.append("  interrupted before a reproducer was confirmed")
    if result.nodes:
        shown = ", ".join(result.nodes[:6]) + (f", ... ({len(result.nodes)} nodes)" if len(result.nodes) > 6 else "")
        lines.append(f"  smallest failing subgraph ({len(result.nodes)} node(s), checked at '{result.tensor}'): {shown}")
        lines.append(f"  reproducer {'confirmed to fail' if result.confirmed else 'did NOT fail when run again (the failure needs more context)'}:")
        lines.append(f"    cd {shlex.quote(str(folder))} && {result.command}")
    return "\n".join(lines)


def _target(settings: RunSettings) -> str:
    required = settings.judged.require
    return " and ".join(f"{name}={value:g}" for name, value in required.items()) + " (--require)" if required else "tolerance"


def _where_it_stands(result) -> list[str]:
    """Per failing output, what the candidate's error does to the decision and the tolerance it meets."""
    lines = []
    for output, met in result.tolerance_met.items():
        decided = decision_lines(output, result.decisions.get(output, {}))
        lines += [line.strip() for line in decided]
        lines.append(f"output '{output}' as it is meets atol {met.get('atol', float('nan')):.3g}, or rtol {met.get('rtol', float('nan')):.3g}")
    return lines


def _precision_text(result, folder: Path, settings: RunSettings) -> str:
    searched = (f"at most {result.bound} on any path the search could take" if result.bound else
                "the comparison and its isolated run: no keep-list was searched")
    lines = [f"accudiff bisect precision: {result.candidate_runs} candidate runs ({searched})"]
    if result.unresolved:
        lines += [f"  {line}" for line in result.unresolved]
        lines.append("  no keep-list is searched for a requirement the data cannot resolve: compare on more data, or judge by another figure")
    elif result.passed_without_changes:
        lines.append("  the model already meets tolerance: nothing to keep in higher precision")
    elif result.trivial:
        lines.append(f"  only keeping every converted node ({len(result.keep)}) in higher precision makes the outputs meet {_target(settings)}: "
                     "no smaller keep-list does, so this format is too coarse for it on this model")
        lines += [f"  {line}" for line in _where_it_stands(result)]
    elif result.repaired:
        lines.append(f"  keeping {len(result.keep)} node(s) in higher precision makes the outputs meet {_target(settings)}: {', '.join(result.keep[:8])}{' ...' if len(result.keep) > 8 else ''}")
        lines.append(f"  keep-list: {folder / KEEP_LIST_FILE} (one --keep-fp32 pattern per line); repaired model: {folder / result.repaired_model}")
        if settings.candidate_model is not None:
            lines += [f"  {line}" for line in remake_lines(result.keep, settings.precision, result.quantized_by)]
    elif result.interrupted:
        lines.append("  interrupted before a passing keep-list was found")
    else:
        lines.append(f"  even keeping every converted node in higher precision does not meet {_target(settings)}")
        lines += [f"  {line}" for line in _where_it_stands(result)]
    if result.ranking is not None:
        lines.append(f"  ranking of the nodes (causes first, then by own error): {folder / RANKING_FILE}")
    return "\n".join(lines)
