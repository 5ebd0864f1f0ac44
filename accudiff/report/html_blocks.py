"""The building blocks of the report's pages: the page itself with its inline style and script, sections,
fact tables, lists, sortable data tables with their extra columns one click away, commands with a copy
button, and the indented lines of the console as nested lists.

Every string from the model or the user goes through `escape`.
"""

from __future__ import annotations

import html
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

COMMANDS = ("accudiff ", "keep_fp32=", "require=")  # what a line holding a command to copy starts with
KIND_LENGTH = 24  # "overflow: ..." says a finding's kind before its colon; a longer head is a sentence

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#212121;background:#fafafa}
main{max-width:1200px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}
.verdict{display:inline-block;padding:2px 10px;border-radius:4px;color:#fff;font-weight:600}
.pass{background:#2e7d32}.fail{background:#c62828}.inconclusive{background:#ef6c00}
.facts td{padding:1px 12px 1px 0;vertical-align:top;overflow-wrap:anywhere}.facts td:first-child{color:#616161}
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
ul.said{margin:4px 0 4px 18px;padding:0}ul.said li{margin:2px 0;overflow-wrap:anywhere}li.command{list-style:none;margin-left:-18px}
.copyable{position:relative;margin:4px 0}.copyable pre{margin:0;padding-right:64px}
button.copy{position:absolute;top:4px;right:6px;font-size:12px;padding:1px 8px;cursor:pointer}
.next{background:#fff;border-left:4px solid #1565c0;padding:4px 12px;margin:8px 0}
.cause h3{margin:4px 0}.cause h4{margin:10px 0 2px;font-size:13px;color:#616161}
table.data td.extra,table.data th.extra{display:none}table.data.all td.extra,table.data.all th.extra{display:table-cell}
input.filter{margin:6px 0;padding:4px 8px;width:320px}
"""

# Sorting (click a header; numbers as numbers) and filtering (every cell's text). No library, no network.
SCRIPT = """
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
document.querySelectorAll("button.copy").forEach(function (button) {
  button.addEventListener("click", function () {
    var text = button.parentNode.querySelector("code").textContent;
    function said(word) { button.textContent = word; setTimeout(function () { button.textContent = "copy"; }, 1500); }
    if (navigator.clipboard) { navigator.clipboard.writeText(text).then(function () { said("copied"); }, function () { said("select it"); }); }
    else { said("select it"); }
  });
});
document.querySelectorAll("input.columns").forEach(function (box) {
  box.addEventListener("change", function () { document.getElementById(box.dataset.table).classList.toggle("all", box.checked); });
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


def page(title: str, notices: Iterable[str], sections: Iterable[str]) -> str:
    notice_html = "".join(f'<p class="notice">{escape(n)}</p>' for n in notices)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body><main>"
        f"{notice_html}{''.join(sections)}</main><script>{SCRIPT}</script></body></html>\n"
    )


def structured(lines: list[str]) -> str:
    """Lines indented by meaning (a statement, its findings two spaces in, a repair's steps, a command on a
    line of its own) as nested lists: a command in a block with a copy button, and a finding's kind
    ("overflow: ...") in bold."""
    root: list = []
    stack: list[tuple[int, list]] = [(-1, root)]
    for line in lines:
        text = line.lstrip(" ")
        depth = len(line) - len(text)
        while stack[-1][0] >= depth:
            stack.pop()
        children: list = []
        stack[-1][1].append((text, children))
        stack.append((depth, children))
    return _items(root)


def _items(items: list) -> str:
    if not items:
        return ""
    parts = []
    for text, children in items:
        if text.startswith(COMMANDS):
            parts.append(f'<li class="command">{copyable(text)}</li>')
            continue
        kind, said, rest = text.partition(": ")
        head = f"<b>{escape(kind)}</b>: {escape(rest)}" if said and _is_kind(kind) else escape(text)
        parts.append(f"<li>{head}{_items(children)}</li>")
    return f"<ul class=\"said\">{''.join(parts)}</ul>"


def _is_kind(head: str) -> bool:
    """A finding's kind is a word or two ("overflow", "also repairs it alone"); a head that names or counts
    something ("prefill (192 positions)", "output 'y'") is part of a sentence, as its sibling lines are."""
    return len(head) <= KIND_LENGTH and not any(mark in head for mark in "'(,")


def copyable(command: str) -> str:
    return f'<div class="copyable"><pre><code>{escape(command)}</code></pre><button type="button" class="copy">copy</button></div>'


def data_table(frame: pd.DataFrame, columns: Sequence[str], table_id: str, kept_nodes: set[str] = frozenset(), main: Sequence[str] = ()) -> str:
    """A sortable table; with `main`, only those columns show until its "all columns" box is ticked."""
    extra = {c for c in columns if main and c not in main}
    head = "".join(('<th class="extra">' if c in extra else "<th>") + f"{escape(c)}</th>" for c in columns)
    rows = []
    for record in frame[list(columns)].to_dict("records"):
        classes = "fail" if record.get("status") == "fail" else ("kept" if record.get("node") in kept_nodes else "")
        cells = "".join(_cell(record[c], c in extra) for c in columns)
        rows.append(f'<tr class="{classes}">{cells}</tr>' if classes else f"<tr>{cells}</tr>")
    toggle = (f'<label><input type="checkbox" class="columns" data-table="{escape(table_id)}"> all {len(columns)} columns '
              f"(shown: {', '.join(c for c in columns if c not in extra)})</label>" if extra else "")
    return (f'{toggle}<div class="scroll"><table class="data sortable" id="{escape(table_id)}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def _cell(value, extra: bool = False) -> str:
    td = '<td class="extra"' if extra else "<td"
    if isinstance(value, (float, np.floating)):
        if np.isnan(value):
            return f'{td} data-v="">-</td>'
        sortable = repr(float(value)) if np.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")
        return f'{td} data-v="{sortable}">{value:.4g}</td>'
    if isinstance(value, (bool, np.bool_)):
        return f"{td}>{'yes' if value else 'no'}</td>"
    return f"{td}>{escape(value)}</td>"


def facts_table(facts: dict[str, str]) -> str:
    rows = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in facts.items())
    return f'<table class="facts">{rows}</table>'


def bullet_list(items: Iterable[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in items) + "</ul>"


def section(title: str, body: str) -> str:
    return f"<section><h2>{escape(title)}</h2>{body}</section>" if body else ""
