"""Run a bisector into a report folder (result.json, report.html, and its models), and word its result for the
console."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from accudiff.bisect.precision import KEEP_LIST_FILE, NODES_FILE, PRUNE_LIMIT, RANKING_FILE, PrecisionResult, bisect_precision
from accudiff.bisect.session import BisectSession, stderr_progress
from accudiff.bisect.subgraph import SubgraphResult, bisect_subgraph
from accudiff.findings import CAUSE_KINDS
from accudiff.atomic import new_folder
from accudiff.report.content import HTML_FILE, finite, met_words
from accudiff.model.quantized_ops import op_types_option
from accudiff.report.repair_text import remake_lines
from accudiff.judging.objective import REQUIREMENTS
from accudiff.report.decision_text import decision_lines, said_figure
from accudiff.report.html import bisect_page
from accudiff.report.next_steps import requirements_every_output_meets
from accudiff.settings import RunSettings
from accudiff.text import times_tolerance

RESULT_FILE = "result.json"
MOST = 0.5  # a keep-list holding more than this share of the converted nodes is no small repair,
SMALL_REPAIR = 5  # ... unless it holds this many nodes or fewer
RESULT_SCHEMA = "accudiff.bisect.result"
SHOWN_NODES = 8  # a keep-list's nodes named on the console; past them, the options read the files that list them


def run_bisector(name: str, settings: RunSettings, out_dir: Path, show: Callable[[str], None] | None = None) -> tuple[PrecisionResult | SubgraphResult, str, bool]:
    """Run bisector `name` into the folder `out_dir`, each step told to `show` (default: stderr); returns what
    it found, the console summary, and whether a failure was found (Ctrl-C stops it: `interrupted`, and what
    it found until then is reported). A bad option or model is said before any folder is made; an error
    leaves none behind."""
    steps: list[str] = []
    show = show or stderr_progress()

    def progress(message: str) -> None:
        steps.append(message)
        show(message)

    session = BisectSession(settings, progress)
    model, precision = settings.model, settings.precision
    try:
        with new_folder(Path(out_dir)) as folder:
            if name == "subgraph":
                result = bisect_subgraph(session, folder.path)
                text, found = _subgraph_text(result, folder.final, settings), result.output is not None
            else:
                result = bisect_precision(session, folder.path)
                text, found = _precision_text(result, folder.final, settings), not result.passed_without_changes
            fields = {key: _plain(value) for key, value in vars(result).items() if not isinstance(value, pd.DataFrame)}
            document = {"schema": RESULT_SCHEMA, "schema_version": 2, "bisector": name, "model": str(model), "precision": precision, **fields}
            folder.write_text(RESULT_FILE, json.dumps(finite(document), indent=2) + "\n")
            files = {"keep_list": KEEP_LIST_FILE if name == "precision" and getattr(result, "keep", None) else None}
            unreproducible = unreproduced(result, settings) if name == "subgraph" else None
            folder.write_text(HTML_FILE, bisect_page(name, Path(model).name, precision, result, steps, files, _target(settings), unreproducible))
    finally:
        session.close()
    return result, text, found


def _subgraph_text(result, folder: Path, settings: RunSettings) -> str:
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
        figures = f"'{result.tensor}' at {times_tolerance(result.tol_ratio)}, {_whole_model(result)}"
        lines.append(f"  reproducer {f'confirmed to fail ({figures})' if result.confirmed else f'NOT confirmed: run again on its own, it did not fail as the whole model does ({figures})'}:")
        lines.append(f"    cd {shlex.quote(str(folder))} && {result.command}")
    said = unreproduced(result, settings)
    if said is not None:
        lines += [f"  {said[0]}", f"    {said[1]}"]
    return "\n".join(lines)


def _whole_model(result) -> str:
    """The checked tensor's error in the whole model; a decoder's fed as its cuts are, then as it generated."""
    if result.prefill_tol_ratio is None:
        return f"{times_tolerance(result.whole_tol_ratio, '')} in the whole model"
    return (f"{times_tolerance(result.prefill_tol_ratio, '')} in the whole model fed each prompt's whole sequence as one prefill, as the cut is, "
            f"{times_tolerance(result.whole_tol_ratio, '')} generating step by step")


def unreproduced(result, settings: RunSettings) -> tuple[str, str] | None:
    """Why a decoder's failure has no reproducer (the whole model fed as a cut is does not fail as it did
    generating), and the command to look with instead: bisect precision, whose trials generate. None where a
    cut was saved."""
    if result.nodes or result.prefill_tol_ratio is None:
        return None
    return (f"no subgraph reproduces it: fed each prompt's whole sequence as one prefill, as a cut is (a cut carries no KV cache), the whole "
            f"model leaves '{result.tensor}' at {times_tolerance(result.prefill_tol_ratio)}, where generating step by step it reaches "
            f"{times_tolerance(result.whole_tol_ratio, '')}; to find the nodes to keep in higher precision (its trials generate as compare does):",
            shlex.join(["accudiff", "bisect", "precision", *settings.arguments("bisect")]))


def _target(settings: RunSettings) -> str:
    required = settings.judging.objective.require
    return " and ".join(f"{name}={value:g}" for name, value in required.items()) + " (--require)" if required else "tolerance"


def _where_it_stands(result, settings: RunSettings) -> list[str]:
    """Per failing output, what the candidate's error does to the decision, the tolerance it meets and the
    requirement on its decision it is shown to meet; then the comparison judged by those, as a command."""
    lines = []
    for output, met in result.tolerance_met.items():
        lines += [line[2:] for line in decision_lines(output, result.decisions.get(output, {}), spans=result.intervals.get(output), prompts=result.prompts)]
        lines.append(f"output '{output}' as it is meets {met_words(met, settings.judging.tolerances.for_tensor(output))}")
        held = result.decision_met.get(output)
        if held is not None:
            lines.append(f"judged by its decision, it passes: --require {held.name}={held.target:g} is met "
                         f"({REQUIREMENTS[held.name][1]} {said_figure(held.name, held.value, held.interval, held.target)})")
    return lines + _decision_command(result, settings)


def _decision_command(result, settings: RunSettings) -> list[str]:
    """Where every failing output's decision is shown to hold as it is: the comparison judged by it, as a command."""
    if not result.decision_met or len(result.decision_met) != len(result.tolerance_met):
        return []
    required = [item for text in requirements_every_output_meets(list(result.decision_met.values())) for item in ("--require", text)]
    return ["if the decision is what you judge the model by:", f"  {shlex.join(['accudiff', 'compare', *settings.arguments(), *required])}"]


def _plain(value):
    """A result's field as JSON takes it: dataclasses (a Resolution, its Interval) as dicts."""
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _precision_text(result, folder: Path, settings: RunSettings) -> str:
    searched = (f"at most {result.bound} on any path the search could take" if result.bound else
                "the comparison and its isolated run: no keep-list was searched")
    lines = [f"accudiff bisect precision: {result.candidate_runs} candidate runs ({searched})"]
    if result.unresolved:
        lines += [f"  {line}" for line in result.unresolved]
        lines.append("  no keep-list is searched for a requirement the data cannot resolve: compare on more data, or judge by another figure")
    elif result.passed_without_changes:
        lines.append(f"  the model already meets {_target(settings)}: nothing to keep in higher precision")
    elif result.trivial:
        lines.append(f"  only keeping every converted node ({len(result.keep)}) in higher precision made the outputs meet {_target(settings)}: "
                     "keeping every node of the ranking did not, so this format looks too coarse for it on this model")
        lines += [f"  {line}" for line in _where_it_stands(result, settings)]
    elif result.repaired:
        lines.append(f"  keeping {len(result.keep)} of the {result.converted} converted node(s) in higher precision makes the outputs meet {_target(settings)}: "
                     f"{', '.join(result.keep[:SHOWN_NODES])}{' ...' if len(result.keep) > SHOWN_NODES else ''}")
        if result.minimal:
            lines.append(f"  each of them is needed: without any one of them (each tried), the rest is not shown to meet {_target(settings)}")
        elif result.untried:
            lines.append(f"  pruned the last added first (a long list in groups first, halving down to single nodes), within {PRUNE_LIMIT} runs: {result.untried} of them "
                         "were never left out on their own, so a shorter list may meet it too")
        # ModelOpt's option is said where it is the user's next tool: a candidate accudiff made, or one of Q/DQ pairs (not another tool's own ops).
        modelopt = settings.candidate_model is None or any(node not in result.quantized_by for node in result.keep)
        also = ", ModelOpt's --nodes_to_exclude takes them too" if modelopt else ""
        lines.append(f"  keep-list: {folder / KEEP_LIST_FILE} (one --keep-fp32 pattern per line{also}; the names: {folder / NODES_FILE}); "
                     f"repaired model: {folder / result.repaired_model}")
        if settings.candidate_model is not None:
            listed = (folder / KEEP_LIST_FILE, folder / NODES_FILE) if len(result.keep) > SHOWN_NODES else None  # past a screen: read from them
            lines += [f"  {line}" for line in remake_lines(result.keep, settings.precision, result.quantized_by, result.reads_constant_weights, listed=listed)]
            if result.op_types and (option := op_types_option(result.keep, result.quantized_by, result.op_types)) is not None:
                lines.append(f"  or, a longer list in one option (verified by compare, every other quantized node kept): quantize only its "
                             f"{' and '.join(result.op_types)} nodes: {option}")
        if len(result.keep) > max(MOST * result.converted, SMALL_REPAIR):
            lines.append(f"  that is most of the model: the search found no small repair (it tries keep-lists in the order of the ranking), and the question is the {_target(settings)} asked of it:")
            lines += [f"  {line}" for line in _where_it_stands(result, settings)]
        else:
            lines += [f"  {line}" for line in _decision_command(result, settings)]
    elif result.interrupted:
        lines.append("  interrupted before a passing keep-list was found")
    elif result.unresolved_kept_all:
        lines.append(f"  even with every converted node kept in higher precision, the data cannot tell whether the outputs meet {_target(settings)}:")
        lines += [f"    {line}" for line in result.unresolved_kept_all]
        lines.append("  no keep-list is given for a requirement the data cannot resolve: compare on more data, or judge by another figure")
    else:
        lines.append(f"  even keeping every converted node in higher precision does not meet {_target(settings)}")
        lines += [f"  {line}" for line in _where_it_stands(result, settings)]
    if result.ranking is not None:
        lines.append(f"  ranking of the nodes (causes first, then by own error): {folder / RANKING_FILE}")
    return "\n".join(lines)
