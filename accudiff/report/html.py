"""`report.html`: one self-contained page per report folder (compare, and both bisectors), for a person.

Everything is inline (CSS, the plots as SVG, a few lines of JavaScript that sort and filter the table):
the page opens offline from disk and makes no network request. Every string that comes from the model or
the user (names, attributes, messages, paths) goes through `escape`. Large tables are sampled (failing
rows always kept) so a page stays small enough to attach to a bug report.
"""

from __future__ import annotations

import html
import shlex
from typing import Sequence

import numpy as np
import pandas as pd

from accudiff.report import plots
from accudiff.report.html_blocks import bullet_list, copyable, data_table, escape, facts_table, page, section, structured
from accudiff.report.content import (HTML_FILE, cause_lines, decision_first_lines, failing_outputs_label, failure_headline, fed_text, requirements_met,
                                     sample_lines, tolerance_met_line, worst_tensors)
from accudiff.report.next_steps import next_step_lines
from accudiff.model.prompts import decode_tokens
from accudiff.model.decoder import model_name
from accudiff.report.decision_text import entry_text, generation_lines, interval_note, said_figure, unresolved_lines, with_interval
from accudiff.text import percent, signed
from accudiff.findings import CAUSE_KINDS

MAX_TABLE_ROWS = 2000
RANKING_COLUMNS = ["rank", "node", "op_type", "why", "kept"]
MAIN_COLUMNS = ["tensor", "op_type", "status", "tol_ratio", "sqnr_db", "isolated_status", "max_abs_err"]  # the rest one click away
TABLE_COLUMNS = [
    "tensor", "node", "op_type", "status", "max_abs_err", "tol_ratio", "sqnr_db", "isolated_sqnr_db", "isolated_status",
    "outside_share", "ref_min", "ref_max", "shape", "dtype", "cand_dtype", "samples", "note",
]



def compare_page(result) -> str:
    """The compare report: verdict, causes, the error's path, failing outputs, the cause's neighbourhood,
    kept nodes and notices, samples, the full table, the replay command."""
    sections = [_heading(result), _causes(result), _generation(result), _error_path(result), _failing_outputs(result), _neighbourhoods(result),
                _kept_and_notices(result), _samples(result), _full_table(result), _replay(result)]
    title = f"accudiff compare {model_name(result.model)} [{result.precision}]"
    return page(title, [], sections)


def bisect_page(bisector: str, model: str, precision: str, result, steps: Sequence[str], folder_files: dict[str, str | None], target: str = "tolerance",
                unreproduced: tuple[str, str] | None = None) -> str:
    """A bisector's report: what it found, the steps it took, the reproducer or the keep-list, the ranking.
    `target`: what bisect precision's keep-lists must meet (the tolerance, or the --require in words).
    `unreproduced`: why no subgraph reproduces the failure, and the command to look with instead."""
    title = f"accudiff bisect {bisector} {model} [{precision}]"
    facts = {"candidate runs": f"{result.candidate_runs} (at most {result.bound} on any path the search could take)", "interrupted": "yes" if result.interrupted else "no"}
    sections = []
    if bisector == "subgraph":
        verdict, label = (("pass", "NOTHING FAILS") if result.output is None else ("fail", "NO SUBGRAPH FOUND") if not result.nodes
                          else ("fail", "FAILING SUBGRAPH FOUND") if result.confirmed else ("fail", "SUBGRAPH NOT CONFIRMED"))
        facts.update({"failing output": result.output or "none", "cause": CAUSE_KINDS.get(result.cause_kind, "-"), "checked at": result.tensor or "-"})
        body = [facts_table(facts)]
        if result.nodes:
            body.append(f"<h3>Smallest failing subgraph ({len(result.nodes)} node(s)), "
                        f"{'confirmed to fail on its own' if result.confirmed else 'NOT confirmed when run again'}</h3>")
            body.append(bullet_list(result.nodes))
            body.append("<h3>Run the reproducer (from this folder)</h3>" + copyable(result.command))
        if unreproduced is not None:
            body.append(f"<p>{escape(unreproduced[0])}</p>" + copyable(unreproduced[1]))
        for finding in result.findings:
            body.append(f"<p>{escape(finding.get('kind', ''))}: {escape(finding.get('message', ''))}</p>")
        sections.append(section("Result", "".join(body)))
    else:
        verdict, label = (
            ("pass", "ALREADY PASSES") if result.passed_without_changes else ("pass", "REPAIRED") if result.repaired else ("fail", "NOT REPAIRED")
        )
        facts.update({f"already meets {target}": "yes" if result.passed_without_changes else "no", "repaired": "yes" if result.repaired else "no"})
        if result.repaired:
            facts["each kept node needed"] = "yes: without any one of them (each tried), the rest does not pass" if result.minimal else (f"not shown: {result.untried} of them were never left out on their own" if result.untried else "not shown: not every node was tried without")
        body = [facts_table(facts)]
        if result.keep:
            body.append(f"<h3>Keep in higher precision ({len(result.keep)} node(s))</h3>" + bullet_list(result.keep))
            body.append(f"<p>Keep-list file: <code>{escape(folder_files.get('keep_list') or '')}</code>; repaired model: "
                        f"<code>{escape(result.repaired_model or '-')}</code></p>")
        sections.append(section("Result", "".join(body)))
        if result.ranking is not None:
            ranking = data_table(result.ranking, list(result.ranking.columns), "ranking", main=RANKING_COLUMNS)
            sections.append(section("Ranking (causes first, then by own error)", ranking))
    sections.append(section("Steps taken", bullet_list(steps)))  # not numbered by the page: the steps carry their own numbers
    heading = f'<h1>{escape(title)}</h1><p><span class="verdict {verdict}" id="verdict">{label}</span></p>'
    return page(title, [], [heading, *sections])


def summary_markdown(result, html_name: str = HTML_FILE) -> str:
    """A short Markdown summary a CI job can post to a pull request: verdict, causes, worst tensors."""
    compared, computed = result.coverage
    lines = [
        f"### accudiff: `{_md(model_name(result.model))}` [{result.precision}] — **{result.verdict.upper()}**",
        "",
        f"{_md(result.candidate)}; {compared} of {computed} tensors compared over {fed_text(result)}.",
        "",
    ]
    lines += [f"- {_md(line)}" for line in requirements_met(result)]
    for failure in result.output_failures:
        headline, *said = cause_lines(failure, result)
        lines.append(f"- output `{_md(failure.tensor)}` fails: " + _md(headline.removeprefix("cause: ")))
        # nested as the console nests them: two spaces a level
        lines += [f"{'  ' * ((len(line) - len(line.lstrip())) // 2)}- {_md(line.strip())}" for line in said if not line.strip().startswith("to find")]
    worst = worst_tensors(result.table)
    if len(worst) and result.output_failures:
        lines += ["", "| tensor | op | status | max abs err | SQNR (dB) |", "|---|---|---|---|---|"]
        lines += [f"| `{_md(r['tensor'])}` | {_md(r['op_type'])} | {r['status']} | {r['max_abs_err']:.3g} | {r['sqnr_db']:.1f} |" for _, r in worst.iterrows()]
    lines += ["", f"Full report: [{html_name}]({html_name})"]
    return "\n".join(lines) + "\n"


def _md(text: object) -> str:
    """Model-provided text in Markdown: no table breaks, no HTML."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("`", "'")


def _heading(result) -> str:
    compared, computed = result.coverage
    tol = result.tolerances.default
    facts = {
        "candidate": result.candidate,
        "compared": f"{compared} of {computed} tensors ({percent(compared / max(computed, 1), 0)}), {fed_text(result)} from {result.inputs or 'generated inputs'}",
        "tolerance": f"atol={tol.atol:g} rtol={tol.rtol:g} stol={tol.stol:g}",
        failing_outputs_label(result): f"{len(result.output_failures)} of {len(result.outputs)}",
    }
    if result.first_failure is not None:
        facts["first tensor out of tolerance"] = f"'{result.first_failure.tensor}' ({result.first_failure.op_type}; a fact, not the cause)"
    steps = next_step_lines(result)
    nexts = f'<div class="next" id="next">{structured(steps)}</div>' if steps else ""
    return (
        f"<h1>accudiff compare {escape(model_name(result.model))} [{escape(result.precision)}]</h1>"
        f'<p><span class="verdict {escape(result.verdict)}" id="verdict">{escape(result.verdict.upper())}</span></p>{nexts}{facts_table(facts)}'
    )


def _causes(result) -> str:
    met = "".join(f"<p>{escape(line)}</p>" for line in [*requirements_met(result), *unresolved_lines(result)])
    if not result.output_failures:
        return section("Cause", met or "<p>Every graph output is within tolerance.</p>")
    blocks = []
    for failure in result.output_failures:
        head = failure_headline(failure.tensor, result, "fails")
        blocks.append(f'<div class="cause" id="cause-{escape(failure.tensor)}"><h3>{escape(head)}</h3>'
                      f'<h4>What it does to the decision</h4>{structured(decision_first_lines(failure.tensor, result) or ["no decision is taken from it"])}'
                      f"<h4>Tolerance</h4>{structured(tolerance_met_line(failure.tensor, result))}"
                      f"<h4>Cause and repair</h4>{structured(cause_lines(failure, result))}</div>")
    return section("Cause", met + "".join(blocks))


def _generation(result) -> str:
    """A decoder's generation: its scores per phase with their intervals, the KL divergence by decode step,
    and each prompt's two greedy continuations where the candidate parts from the reference."""
    if not result.generations:
        return ""
    rows = []
    for output, phases in result.phases.items():
        for phase, found in phases.items():
            figures, spans = found["figures"], found["intervals"]
            cells = [output, phase, str(figures["score_vectors"]), with_interval("top1", figures["top1"], spans.get("top1"), percent, 2),
                     said_figure("kl", figures["kl"], spans.get("kl")), f"{figures['kl_max']:.3g}",
                     with_interval("delta_nll", figures["delta_nll"], spans.get("delta_nll"), signed, 3) if "delta_nll" in figures else "-",
                     f"{figures.get('near_tie_flips', 0)} of {figures.get('flips', 0)}"]
            rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("output", "phase", "positions", "top-1 agreement [95%]", "KL mean [95%]", "KL max", "ΔNLL [95%]", "near-tie flips"))
    table = f'<table class="data" id="phases"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    chart = plots.by_step(result.samples, result.phases)
    parted = [g for g in result.generations if g["diverged_at"] is not None]
    folder = result.model.parent
    turns = []
    for g in parted:
        at = "the prefill" if g["diverged_at"] == 0 else f"decode step {g['diverged_at']}"
        said = "\n".join(f"{side + ':':<10} {_text_of(folder, g[side])}" for side in ("prompt", "reference", "candidate"))
        turns.append(f"<h3>prompt {g['sequence']}: first different token at {escape(at)}</h3><pre>{escape(said)}</pre>")
    entries = [f"'{output}': {entry_text(phases)}" for output, phases in result.phases.items() if {"prefill", "decode"} <= phases.keys()]
    lines = "".join(f"<p>{escape(line.strip())}</p>" for line in [*entries, *generation_lines(result)[:1]])
    # How the intervals were made, in the console's words: whole prompts resampled, or (too few prompts) positions taken as independent.
    note = next((interval_note(result.intervals[output], prompts=True) for output in result.phases if result.intervals.get(output)), "")
    intro = (f"<p>{len(result.generations)} prompt(s), each a prefill then its decode steps, each side carrying its own KV cache; both sides fed "
             f"the same tokens. {escape(note.strip('[]'))}{'.' if note else ''}</p>")
    return section("Generation", intro + table + (f'<div class="plots" id="by-step">{chart}</div>' if chart else "") + lines + "".join(turns))


def _text_of(folder, tokens) -> str:
    text = decode_tokens(folder, tokens)
    return repr(text) if text is not None else str(tokens)


def _error_path(result) -> str:
    table = result.table
    causes, absorbed = [], []
    for failure in result.output_failures:
        cause = failure.cause
        if cause is None:
            continue
        label = ("verified cause" + (f" (on {cause.stand_in})" if cause.stand_in else "")) if cause.verified else "cause (not verified)"
        causes += [(t, label) for t in dict.fromkeys([cause.tensor, *(c.tensor for c in cause.co_causes)]) if t]
        for drop in cause.absorbed:
            by = table.loc[table["node"] == drop.by, "tensor"] if drop.by else ()
            absorbed.append((drop.tensor, by.iloc[0] if len(by) else None, (drop.by_op_type, drop.by) if drop.by else None))
    svg = plots.error_path(table, list(dict.fromkeys(causes)), [k.node for k in result.kept], absorbed)
    isolated = ("and the isolated run (each node fed the reference's values: its own error). A node whose isolated SQNR drops "
                "makes error; a drop only in the normal run is carried in." if "isolated_sqnr_db" in table
                else "(no isolated run here, so a node's own error is not told apart from error carried in).")
    intro = ("<p>SQNR of every compared tensor, in topological order: the normal run (error accumulated from every node upstream) "
             f"{isolated} A drop marked ruled out was tested: keeping that node alone in higher precision left the output failing, "
             "no better than 1.25 times; the node named beside it is where the error its path carries (every node's upstream) shrinks.</p>")
    if svg is None:
        return ""
    return section("The error's path", intro + f'<div class="plots" id="error-path">{svg}</div>')


def _failing_outputs(result) -> str:
    """Per failing output: its error histogram and scatter, then its cause's histogram under the cause's own
    heading, so each figure and each note sits under the tensor it is about."""
    blocks = []
    indexed = result.table.set_index("tensor")
    for failure in result.output_failures:
        parts = []
        cause = failure.cause.tensor if failure.cause and failure.cause.tensor and failure.cause.tensor != failure.tensor else None
        for name in [failure.tensor, *([cause] if cause else [])]:
            figures = [_histogram(name, result, indexed)]
            if name == failure.tensor:
                figures.append(plots.candidate_vs_reference(result.points.get(name, []), name))
            drawn = [f for f in figures if f and f.startswith("<svg")]
            said = "".join(f for f in figures if f and not f.startswith("<svg"))
            if drawn or said:
                heading = f"<h4>its cause, '{escape(name)}'</h4>" if name == cause else ""
                parts.append(heading + said + (f'<div class="plots">{"".join(drawn)}</div>' if drawn else ""))
        if parts:
            blocks.append(f"<h3>{escape(failure.tensor)}</h3>{''.join(parts)}")
    if not blocks:
        return ""
    note = "<p>Error histograms count every element (from the comparison's sketch); the scatter shows sampled elements, the worst first.</p>"
    return section("Failing outputs", note + "".join(blocks))


def _histogram(name: str, result, indexed: pd.DataFrame) -> str | None:
    """A tensor's error histogram, or the sentence saying why there is none to draw."""
    if name not in result.error_sketches:
        return None
    row = indexed.loc[name]
    non_finite = int(row["ref_nan"] + row["ref_inf"] + row["cand_nan"] + row["cand_inf"])
    drawn = plots.error_distribution(result.error_sketches[name], name, non_finite)
    return drawn if drawn is not None else f"<p>'{escape(name)}': no finite error above 0 to draw (NaN/Inf values: {non_finite}).</p>"


def _neighbourhoods(result) -> str:
    blocks = []
    indexed = result.table.set_index("tensor")
    consumers: dict[str, list] = {}
    for node in result.nodes.values():
        for name in node.inputs:
            consumers.setdefault(name, []).append(node)
    for node_name in dict.fromkeys(f.cause.node for f in result.output_failures if f.cause is not None and f.cause.kind == "local"):
        node = result.nodes.get(node_name)
        if node is None:
            continue
        attributes = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in node.attributes) or "<tr><td colspan=2>none</td></tr>"
        inputs = "".join(f"<tr><td>{escape(name)}</td><td>{escape(_describe_value(name, indexed, result.weights))}</td></tr>" for name in node.inputs if name)
        outputs = "".join(f"<tr><td>{escape(name)}</td><td>{escape(_describe_value(name, indexed, result.weights))}</td></tr>" for name in node.outputs if name)
        readers = [c for name in node.outputs for c in consumers.get(name, [])]
        reader_rows = "".join(
            f"<tr><td>{escape(c.op_type)} '{escape(c.name)}'</td><td>{escape(_status_of(c, indexed))}</td></tr>" for c in readers
        ) or "<tr><td colspan=2>graph output only</td></tr>"
        blocks.append(
            f"<h3>{escape(node.op_type)} '{escape(node.name)}'</h3><table class=\"data\"><tr><th colspan=2>attributes</th></tr>{attributes}"
            f"<tr><th colspan=2>inputs</th></tr>{inputs}<tr><th colspan=2>outputs</th></tr>{outputs}"
            f"<tr><th colspan=2>consumers</th></tr>{reader_rows}</table>"
        )
    return section("Around the cause", "".join(blocks)) if blocks else ""


def _describe_value(name: str, indexed: pd.DataFrame, weights: dict[str, str]) -> str:
    if name in weights:
        return f"weight {weights[name]}"
    if name in indexed.index:
        row = indexed.loc[name]
        if pd.isna(row["ref_min"]):
            return f"{row['status']}"
        return (f"{row['status']}: reference range [{row['ref_min']:.4g}, {row['ref_max']:.4g}], max abs err {row['max_abs_err']:.3g}, "
                f"SQNR {row['sqnr_db']:.1f} dB" + (f" (isolated {row['isolated_sqnr_db']:.1f} dB)" if "isolated_sqnr_db" in row and pd.notna(row["isolated_sqnr_db"]) else ""))
    return "graph input" if name else ""


def _status_of(node, indexed: pd.DataFrame) -> str:
    statuses = [f"{o}: {indexed.loc[o, 'status']}" for o in node.outputs if o in indexed.index]
    return "; ".join(statuses) or "not compared"


def _kept_and_notices(result) -> str:
    parts = []
    if result.kept:
        kept = pd.DataFrame([{"node": k.node, "op_type": k.op_type, "reason": k.reason} for k in result.kept])
        parts.append(f"<h3>Kept in FP32 ({len(kept)})</h3>" + data_table(kept, list(kept.columns), "kept"))
    if result.notices:
        parts.append("<h3>Notices</h3>" + bullet_list(result.notices))
    if result.not_observable:
        shown = list(result.not_observable.items())[:200]
        rows = pd.DataFrame(shown, columns=["tensor", "why it is not observable"])
        more = f"<p>... and {len(result.not_observable) - len(shown)} more (summary.json)</p>" if len(result.not_observable) > len(shown) else ""
        parts.append(f"<h3>Not observable ({len(result.not_observable)})</h3>" + data_table(rows, list(rows.columns), "not-observable") + more)
    return section("Kept nodes and notices", "".join(parts)) if parts else ""


def _samples(result) -> str:
    lines = [line.strip() for line in sample_lines(result, generation=False)]  # a decoder's phases and generation: its own section
    if result.iterations <= 1 and not lines:
        return ""
    return section("Samples", bullet_list(lines) if lines else "<p>One sample.</p>")


def _full_table(result) -> str:
    table = result.table
    columns = [c for c in TABLE_COLUMNS if c in table.columns]
    shown, note = table, ""
    if len(table) > MAX_TABLE_ROWS:
        failing = table["status"] == "fail"
        rest = table[~failing]
        keep = rest.iloc[np.linspace(0, len(rest) - 1, max(MAX_TABLE_ROWS - int(failing.sum()), 0)).astype(int)] if len(rest) else rest
        shown = table[failing | table.index.isin(keep.index)]
        note = f"<p class=\"notice\">{len(shown)} of {len(table)} rows shown (every failing one, the rest sampled evenly); tensors.csv has them all.</p>"
    kept_nodes = {k.node for k in result.kept}
    filter_box = '<input class="filter" data-table="tensors" placeholder="filter rows (any text)">'
    return section(f"All tensors ({len(table)})", note + filter_box + data_table(shown, columns, "tensors", kept_nodes, MAIN_COLUMNS))


def _replay(result) -> str:
    if not result.replay:
        return ""
    return section("Replay", "<p>The same comparison, on the same inputs:</p>" + copyable(shlex.join(result.replay)))

