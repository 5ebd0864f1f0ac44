"""`report.html`: one self-contained page per report folder (compare, and both bisectors), for a person.

Everything is inline (CSS, the plots as SVG, a few lines of JavaScript that sort and filter the table):
the page opens offline from disk and makes no network request. Every string that comes from the model or
the user (names, attributes, messages, paths) goes through `escape`. Large tables are sampled (failing
rows always kept) so a page stays small enough to attach to a bug report.
"""

from __future__ import annotations

import html
import shlex
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from accudiff.report import plots
from accudiff.report.content import (HTML_FILE, cause_lines, failing_outputs_label, failure_headline, requirements_met, sample_lines,
                                     tolerance_met_line, worst_tensors)
from accudiff.model.prompts import decode_tokens
from accudiff.model.decoder import model_name
from accudiff.report.decision_text import decision_lines, generation_lines, interval_text
from accudiff.text import percent
from accudiff.diagnosis.cause import CAUSE_KINDS

MAX_TABLE_ROWS = 2000
TABLE_COLUMNS = [
    "tensor", "node", "op_type", "status", "max_abs_err", "tol_ratio", "sqnr_db", "isolated_sqnr_db", "isolated_status",
    "outside_share", "ref_min", "ref_max", "shape", "dtype", "cand_dtype", "samples", "note",
]

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#212121;background:#fafafa}
main{max-width:1200px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}
.verdict{display:inline-block;padding:2px 10px;border-radius:4px;color:#fff;font-weight:600}
.pass{background:#2e7d32}.fail{background:#c62828}.inconclusive{background:#ef6c00}
.facts td{padding:1px 12px 1px 0;vertical-align:top}.facts td:first-child{color:#616161}
pre,code{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:#f1f3f4;padding:8px 10px;border-radius:4px;overflow-x:auto;white-space:pre-wrap}
.cause{background:#fff;border-left:4px solid #ef6c00;padding:6px 12px;margin:8px 0}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plots svg{max-width:100%;height:auto;background:#fff}
table.data{border-collapse:collapse;font-size:12.5px;background:#fff}
table.data th,table.data td{border:1px solid #e0e0e0;padding:2px 6px;text-align:left;white-space:nowrap}
table.data th{background:#eceff1;cursor:pointer;position:sticky;top:0}
tr.fail td{background:#ffebee}tr.kept td{background:#f3e5f5}
.scroll{max-height:600px;overflow:auto;border:1px solid #e0e0e0}
.notice{color:#5d4037}
input.filter{margin:6px 0;padding:4px 8px;width:320px}
"""

# Sorting (click a header; numbers as numbers) and filtering (every cell's text). No library, no network.
_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  var body = table.tBodies[0];
  table.querySelectorAll("th").forEach(function (th, column) {
    th.addEventListener("click", function () {
      var up = th.dataset.order !== "asc";
      th.dataset.order = up ? "asc" : "desc";
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = a.cells[column].dataset.v !== undefined ? a.cells[column].dataset.v : a.cells[column].textContent;
        var y = b.cells[column].dataset.v !== undefined ? b.cells[column].dataset.v : b.cells[column].textContent;
        var nx = parseFloat(x), ny = parseFloat(y);
        var order = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : String(x).localeCompare(String(y));
        return up ? order : -order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
document.querySelectorAll("input.filter").forEach(function (input) {
  var table = document.getElementById(input.dataset.table);
  input.addEventListener("input", function () {
    var wanted = input.value.toLowerCase();
    Array.prototype.forEach.call(table.tBodies[0].rows, function (row) {
      row.style.display = row.textContent.toLowerCase().indexOf(wanted) >= 0 ? "" : "none";
    });
  });
});
"""


def escape(value: object) -> str:
    return html.escape(str(value), quote=True)


def compare_page(result) -> str:
    """The compare report: verdict, causes, the error's path, failing outputs, the cause's neighbourhood,
    kept nodes and notices, samples, the full table, the replay command."""
    sections = [_heading(result), _causes(result), _generation(result), _error_path(result), _failing_outputs(result), _neighbourhoods(result),
                _kept_and_notices(result), _samples(result), _full_table(result), _replay(result)]
    title = f"accudiff compare {model_name(result.model)} [{result.precision}]"
    return _page(title, [], sections)


def bisect_page(bisector: str, model: str, precision: str, result, steps: Sequence[str], folder_files: dict[str, str | None]) -> str:
    """A bisector's report: what it found, the steps it took, the reproducer or the keep-list, the ranking."""
    title = f"accudiff bisect {bisector} {model} [{precision}]"
    facts = {"candidate runs": f"{result.candidate_runs} (at most {result.bound} on any path the search could take)", "interrupted": "yes" if result.interrupted else "no"}
    sections = []
    if bisector == "subgraph":
        verdict, label = ("fail", "FAILING SUBGRAPH FOUND") if result.output is not None else ("pass", "NOTHING FAILS")
        facts.update({"failing output": result.output or "none", "cause": CAUSE_KINDS.get(result.cause_kind, "-"), "checked at": result.tensor or "-"})
        body = [_facts(facts)]
        if result.nodes:
            body.append(f"<h3>Smallest failing subgraph ({len(result.nodes)} node(s)), "
                        f"{'confirmed to fail on its own' if result.confirmed else 'NOT confirmed when run again'}</h3>")
            body.append(_list(result.nodes))
            body.append("<h3>Run the reproducer (from this folder)</h3>" + _code(result.command))
        for finding in result.findings:
            body.append(f"<p>{escape(finding.get('kind', ''))}: {escape(finding.get('message', ''))}</p>")
        sections.append(_section("Result", "".join(body)))
    else:
        verdict, label = (
            ("pass", "ALREADY WITHIN TOLERANCE") if result.passed_without_changes else ("pass", "REPAIRED") if result.repaired else ("fail", "NOT REPAIRED")
        )
        facts.update({"already within tolerance": "yes" if result.passed_without_changes else "no", "repaired": "yes" if result.repaired else "no"})
        body = [_facts(facts)]
        if result.keep:
            body.append(f"<h3>Keep in higher precision ({len(result.keep)} node(s))</h3>" + _list(result.keep))
            body.append(f"<p>Keep-list file: <code>{escape(folder_files.get('keep_list') or '')}</code>; repaired model: "
                        f"<code>{escape(result.repaired_model or '-')}</code></p>")
        sections.append(_section("Result", "".join(body)))
        if result.ranking is not None:
            sections.append(_section("Ranking (causes first, then by own error)", _data_table(result.ranking, list(result.ranking.columns), "ranking")))
    sections.append(_section("Steps taken", _list(steps, ordered=True)))
    heading = f'<h1>{escape(title)}</h1><p><span class="verdict {verdict}" id="verdict">{label}</span></p>'
    return _page(title, [], [heading, *sections])


def summary_markdown(result, html_name: str = HTML_FILE) -> str:
    """A short Markdown summary a CI job can post to a pull request: verdict, causes, worst tensors."""
    compared, computed = result.coverage
    lines = [
        f"### accudiff: `{_md(model_name(result.model))}` [{result.precision}] — **{result.verdict.upper()}**",
        "",
        f"{_md(result.candidate)}; {compared} of {computed} tensors compared over {result.iterations} sample(s).",
        "",
    ]
    lines += [f"- {_md(line)}" for line in requirements_met(result)]
    for failure in result.output_failures:
        lines.append(f"- output `{_md(failure.tensor)}` fails: " + _md(cause_lines(failure, result)[0].removeprefix("cause: ")))
        lines += [f"  - {_md(line.strip())}" for line in cause_lines(failure, result)[1:] if not line.strip().startswith("to find")]
    worst = worst_tensors(result.table)
    if len(worst) and result.output_failures:
        lines += ["", "| tensor | op | status | max abs err | SQNR (dB) |", "|---|---|---|---|---|"]
        lines += [f"| `{_md(r['tensor'])}` | {_md(r['op_type'])} | {r['status']} | {r['max_abs_err']:.3g} | {r['sqnr_db']:.1f} |" for _, r in worst.iterrows()]
    lines += ["", f"Full report: [{html_name}]({html_name})"]
    return "\n".join(lines) + "\n"


def _md(text: object) -> str:
    """Model-provided text in Markdown: no table breaks, no HTML."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("`", "'")


def _page(title: str, notices: Iterable[str], sections: Iterable[str]) -> str:
    notice_html = "".join(f'<p class="notice">{escape(n)}</p>' for n in notices)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body><main>"
        f"{notice_html}{''.join(sections)}</main><script>{_SCRIPT}</script></body></html>\n"
    )


def _heading(result) -> str:
    compared, computed = result.coverage
    tol = result.tolerances.default
    facts = {
        "candidate": result.candidate,
        "compared": f"{compared} of {computed} tensors ({percent(compared / max(computed, 1), 0)}), {result.iterations} sample(s) from {result.inputs or 'generated inputs'}",
        "tolerance": f"atol={tol.atol:g} rtol={tol.rtol:g} stol={tol.stol:g}",
        failing_outputs_label(result): f"{len(result.output_failures)} of {len(result.outputs)}",
    }
    if result.first_failure is not None:
        facts["first tensor out of tolerance"] = f"'{result.first_failure.tensor}' ({result.first_failure.op_type}; a fact, not the cause)"
    return (
        f"<h1>accudiff compare {escape(model_name(result.model))} [{escape(result.precision)}]</h1>"
        f'<p><span class="verdict {escape(result.verdict)}" id="verdict">{escape(result.verdict.upper())}</span></p>{_facts(facts)}'
    )


def _causes(result) -> str:
    met = "".join(f"<p>{escape(line)}</p>" for line in requirements_met(result))
    if not result.output_failures:
        return _section("Cause", met or "<p>Every graph output is within tolerance.</p>")
    blocks = []
    for failure in result.output_failures:
        head = failure_headline(failure.tensor, result, "fails")
        said = [*tolerance_met_line(failure.tensor, result),
                *(line.strip() for line in decision_lines(failure.tensor, result.decisions.get(failure.tensor, {}), result.output_kinds.get(failure.tensor))),
                *cause_lines(failure, result)]
        blocks.append(f'<div class="cause" id="cause-{escape(failure.tensor)}"><strong>{escape(head)}</strong>'
                      f"<pre>{escape(chr(10).join(said))}</pre></div>")
    return _section("Cause", met + "".join(blocks))


def _generation(result) -> str:
    """A decoder's generation: its scores per phase with their intervals, the KL divergence by decode step,
    and each prompt's two greedy continuations where the candidate parts from the reference."""
    if not result.generations:
        return ""
    rows = []
    for output, phases in result.phases.items():
        for phase, found in phases.items():
            figures, spans = found["figures"], found["intervals"]
            cells = [output, phase, str(figures["score_vectors"]), f"{percent(figures['top1'], 2)}{interval_text('top1', spans.get('top1'))}",
                     f"{figures['kl']:.3g}{interval_text('kl', spans.get('kl'))}", f"{figures['kl_max']:.3g}",
                     f"{figures['delta_nll']:+.3g}{interval_text('delta_nll', spans.get('delta_nll'))}" if "delta_nll" in figures else "-",
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
    lines = "".join(f"<p>{escape(line.strip())}</p>" for line in generation_lines(result)[:1])
    intro = (f"<p>{len(result.generations)} prompt(s), each a prefill then its decode steps, each side carrying its own KV cache; both sides fed "
             "the same tokens. Intervals resample whole prompts (positions of one prompt are not independent).</p>")
    return _section("Generation", intro + table + (f'<div class="plots" id="by-step">{chart}</div>' if chart else "") + lines + "".join(turns))


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
            absorbed.append((drop.tensor, by.iloc[0] if len(by) else None, f"absorbed by {drop.by_op_type} '{drop.by}'" if drop.by else "absorbed"))
    svg = plots.error_path(table, list(dict.fromkeys(causes)), [k.node for k in result.kept], absorbed)
    isolated = ("and the isolated run (each node fed the reference's values: its own error). A node whose isolated SQNR drops "
                "makes error; a drop only in the normal run is carried in." if "isolated_sqnr_db" in table
                else "(no isolated run here, so a node's own error is not told apart from error carried in).")
    intro = ("<p>SQNR of every compared tensor, in topological order: the normal run (error accumulated from every node upstream) "
             f"{isolated} A drop marked absorbed was tested: keeping that node in higher precision left the output as it was.</p>")
    if svg is None:
        return ""
    return _section("The error's path", intro + f'<div class="plots" id="error-path">{svg}</div>')


def _failing_outputs(result) -> str:
    blocks = []
    indexed = result.table.set_index("tensor")
    for failure in result.output_failures:
        figures, undrawn = [], []
        for name in dict.fromkeys([failure.tensor, failure.cause.tensor] if failure.cause and failure.cause.tensor else [failure.tensor]):
            if name in result.error_sketches:
                row = indexed.loc[name]
                non_finite = int(row["ref_nan"] + row["ref_inf"] + row["cand_nan"] + row["cand_inf"])
                histogram = plots.error_distribution(result.error_sketches[name], name, non_finite)
                figures.append(histogram)
                if histogram is None:
                    undrawn.append(f"<p>'{escape(name)}': no finite error above 0 to draw (NaN/Inf values: {non_finite}).</p>")
        figures.append(plots.candidate_vs_reference(result.points.get(failure.tensor, []), failure.tensor))
        shown = [f for f in figures if f is not None]
        if shown or undrawn:
            blocks.append(f"<h3>{escape(failure.tensor)}</h3>{''.join(undrawn)}<div class=\"plots\">{''.join(shown)}</div>")
    if not blocks:
        return ""
    note = "<p>Error histograms count every element (from the comparison's sketch); the scatter shows sampled elements, the worst first.</p>"
    return _section("Failing outputs", note + "".join(blocks))


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
    return _section("Around the cause", "".join(blocks)) if blocks else ""


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
        parts.append(f"<h3>Kept in FP32 ({len(kept)})</h3>" + _data_table(kept, list(kept.columns), "kept"))
    if result.notices:
        parts.append("<h3>Notices</h3>" + _list(result.notices))
    if result.not_observable:
        shown = list(result.not_observable.items())[:200]
        rows = pd.DataFrame(shown, columns=["tensor", "why it is not observable"])
        more = f"<p>... and {len(result.not_observable) - len(shown)} more (summary.json)</p>" if len(result.not_observable) > len(shown) else ""
        parts.append(f"<h3>Not observable ({len(result.not_observable)})</h3>" + _data_table(rows, list(rows.columns), "not-observable") + more)
    return _section("Kept nodes and notices", "".join(parts)) if parts else ""


def _samples(result) -> str:
    lines = [line.strip() for line in sample_lines(result)]
    if result.iterations <= 1 and not lines:
        return ""
    return _section("Samples", _list(lines) if lines else "<p>One sample.</p>")


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
    return _section(f"All tensors ({len(table)})", note + filter_box + _data_table(shown, columns, "tensors", kept_nodes))


def _replay(result) -> str:
    if not result.replay:
        return ""
    return _section("Replay", "<p>The same comparison, on the same inputs:</p>" + _code(shlex.join(result.replay)))


def _data_table(frame: pd.DataFrame, columns: Sequence[str], table_id: str, kept_nodes: set[str] = frozenset()) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    rows = []
    for record in frame[list(columns)].to_dict("records"):
        classes = "fail" if record.get("status") == "fail" else ("kept" if record.get("node") in kept_nodes else "")
        cells = "".join(_cell(record[c]) for c in columns)
        rows.append(f'<tr class="{classes}">{cells}</tr>' if classes else f"<tr>{cells}</tr>")
    return f'<div class="scroll"><table class="data sortable" id="{escape(table_id)}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def _cell(value) -> str:
    if isinstance(value, (float, np.floating)):
        if np.isnan(value):
            return '<td data-v="">-</td>'
        sortable = repr(float(value)) if np.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")
        return f'<td data-v="{sortable}">{value:.4g}</td>'
    if isinstance(value, (bool, np.bool_)):
        return f"<td>{'yes' if value else 'no'}</td>"
    return f"<td>{escape(value)}</td>"


def _facts(facts: dict[str, str]) -> str:
    rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in facts.items())
    return f'<table class="facts">{rows}</table>'


def _list(items: Iterable[str], ordered: bool = False) -> str:
    tag = "ol" if ordered else "ul"
    return f"<{tag}>" + "".join(f"<li>{escape(item)}</li>" for item in items) + f"</{tag}>"


def _code(text: str) -> str:
    return f"<pre><code>{escape(text)}</code></pre>"


def _section(title: str, body: str) -> str:
    return f"<section><h2>{escape(title)}</h2>{body}</section>" if body else ""
