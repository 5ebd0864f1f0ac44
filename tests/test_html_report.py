"""report.html and summary.md: self-contained, escaped, with the verdict, the cause and the plots, for
compare and both bisectors; and rendered by a real browser (headless Chromium) where one is installed."""

from __future__ import annotations

import html
import re
import shlex
import sys

import onnx
import pytest

import accudiff
from accudiff.bisect.report import run_bisector
from accudiff.report import plots
from accudiff.report.html_blocks import structured
from accudiff.report.svg import MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP
from accudiff.settings import RunSettings
from conftest import ROOT, fixture, run_printed

sys.path.insert(0, str(ROOT))
from benchmarks.report_screenshot import browser, render, screenshot  # noqa: E402

HOSTILE_NODE = '<script>alert("node")</script>'
HOSTILE_TENSOR = "amp'\"<b>lified"


def _hostile_model(path):
    """overflow_activation with a node and a tensor named to break out of HTML if they were not escaped."""
    model = onnx.load(str(fixture("overflow_activation")))
    for node in model.graph.node:
        if node.name == "amplify":
            node.name = HOSTILE_NODE
        node.input[:] = [HOSTILE_TENSOR if n == "amplified" else n for n in node.input]
        node.output[:] = [HOSTILE_TENSOR if n == "amplified" else n for n in node.output]
    model.graph.doc_string = "</style><script>alert('doc')</script>"
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    result = accudiff.compare(_hostile_model(folder / "hostile.onnx"), "fp16", candidate="onnxrt", report_dir=folder / "report")
    return result, (folder / "report" / "report.html").read_text()


def test_every_model_string_is_escaped(hostile_report):
    _, page = hostile_report
    assert page.count("<script") == 1  # ours, at the end
    assert "&lt;script&gt;alert(&quot;node&quot;)&lt;/script&gt;" in page
    assert "amp&#x27;&quot;&lt;b&gt;lified" in page and "<b>lified" not in page


def test_the_page_is_self_contained(hostile_report):
    _, page = hostile_report
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)  # nothing fetched from anywhere
    assert "@import" not in page and not re.search(r"url\((?!#)", page)  # only references within the page
    assert "default-src 'none'" in page  # and the browser is told to refuse any request


def test_compare_page_holds_verdict_cause_plots_table_and_replay(hostile_report, tmp_path):
    result, page = hostile_report
    assert 'id="verdict">FAIL<' in page
    assert "introduces the error" in page and "&lt;script&gt;" in page  # the cause names the (escaped) node
    assert page.count("<svg") >= 3  # the error's path, the error histogram, the scatter
    assert 'id="error-path"' in page and 'id="tensors"' in page
    assert "Around the cause" in page and "consumers" in page
    assert "accudiff compare" in page and "--load-inputs" in page  # the replay command
    summary = (result.report_dir / "summary.md").read_text()
    assert "**FAIL**" in summary and "report.html" in summary and "<script>" not in summary


def test_the_error_path_marks_the_verified_cause_and_the_absorbed_overflow(tmp_path):
    """absorbed_then_overflow: the GELU's cube overflows and Tanh saturates it; the variance sum is the cause."""
    result = accudiff.compare(fixture("absorbed_then_overflow"), "fp16", candidate="onnxrt", report_dir=tmp_path / "r")
    [failure] = result.output_failures
    drop = failure.cause.absorbed[0]
    path = (result.report_dir / "report.html").read_text().split('id="error-path"')[1].split("</svg>")[0]
    assert f"verified cause: {failure.cause.tensor}" in path
    assert f"shrinks across {drop.by_op_type} &#x27;{drop.by}&#x27;" in path and "ruled out: kept alone, the output still fails" in path


def test_a_tensor_without_finite_error_gets_a_sentence_not_empty_axes(tmp_path):
    """nan_midgraph's output and its cause hold NaN/Inf where they fail and no other error: an error
    histogram of them would be empty axes, and the scatter's NaN candidates sit above their references."""
    accudiff.compare(fixture("nan_midgraph"), "fp16", candidate="onnxrt", verify=False, report_dir=tmp_path / "r")
    page = (tmp_path / "r" / "report.html").read_text()
    assert "absolute error (" not in page
    assert page.count("no finite error above 0 to draw") == 2
    output_part, cause_part = page.split("Failing outputs</h2>")[1].split("</section>")[0].split("<h4>its cause, ")
    assert output_part.count("no finite error above 0 to draw") == 1 and cause_part.count("no finite error above 0 to draw") == 1
    for references in ([1.5, 2.5], [1.5, 1.5]):  # a range of one value is widened: the top is not 1.5
        scatter = plots.candidate_vs_reference([[r, c] for r, c in zip(references, [float("nan"), float("inf")])], "y")
        crosses = [(float(x) + 3, float(y) + 3) for x, y in re.findall(r'<path d="M([0-9.-]+),([0-9.-]+)L', scatter)]
        inside = [(x, y) for x, y in crosses if MARGIN_LEFT <= x <= 400 - MARGIN_RIGHT]  # the legend's is not
        assert len(inside) == 2 and all(y == MARGIN_TOP for _, y in inside)


def test_the_report_reads_like_a_report(tmp_path):
    """The next step and the repair as commands with a copy button (each runs as printed), the cause as
    headed parts with each finding's kind, tensor names on the error's path (axis and hover), the table
    narrowed to its main columns with the rest one click away."""
    result = accudiff.compare(fixture("layernorm_overflow"), "fp16", candidate="onnxrt", report_dir=tmp_path / "r")
    page = (result.report_dir / "report.html").read_text()
    nexts = page.split('id="next"')[1].split("</div></div>")[0]
    commands = [html.unescape(c) for c in re.findall(r'<div class="copyable"><pre><code>(.*?)</code></pre><button type="button" class="copy">', page)]
    assert 'class="copy"' in nexts and len(commands) >= 3  # the next step, 'apply it', the replay
    replay = shlex.join(result.replay)
    assert commands[-1] == replay and run_printed(replay, tmp_path).returncode == 1  # the same comparison fails again
    for command in dict.fromkeys(commands[:-1]):  # the next step and 'apply it': the verified repair passes
        assert "--keep-fp32" in command and run_printed(command, tmp_path).returncode == 0, command
    cause = page.split('id="cause-y"')[1].split("</section>")[0]
    assert [h for h in re.findall(r"<h4>(.*?)</h4>", cause)] == ["What it does to the decision", "Tolerance", "Cause and repair"]
    assert "<b>overflow</b>: reference absmax" in cause and "<b>verified</b>: keeping it in FP32" in cause
    # A head that counts something is part of its sentence, as its siblings' are ("prefill (192 positions): ...").
    assert structured(["prefill (192 positions): top-1 91%", "decode, each side carrying its own KV cache (96 positions): top-1 94%"]) == (
        '<ul class="said"><li>prefill (192 positions): top-1 91%</li><li>decode, each side carrying its own KV cache (96 positions): top-1 94%</li></ul>')
    path = page.split('id="error-path"')[1].split("</svg>")[0]
    assert re.search(r'rotate\(-35\)" text-anchor="end">squared</text>', path)  # the axis names tensors
    assert "<title>squared (Pow): SQNR -200.0 dB" in path  # and every point names its tensor on hover
    table = page.split('id="tensors"')[1].split("</thead>")[0]
    assert '<th>tensor</th>' in table and '<th>sqnr_db</th>' in table and '<th class="extra">ref_min</th>' in table
    assert 'class="columns" data-table="tensors"' in page


def test_plots_are_drawn_without_a_plotting_library(hostile_report):
    """The plots are SVG text written directly: matplotlib (0.7 s of a recognizer's compare) never loads."""
    import subprocess

    code = ("import sys, accudiff.report.html, accudiff.report.plots as p, numpy as n; "
            "p.candidate_vs_reference([[0.0, 0.1], [1.0, float('inf')]], 'x'); print('matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("bisector", ["subgraph", "precision"])
def test_bisect_folders_get_a_page(bisector, tmp_path):
    run_bisector(bisector, RunSettings(fixture("overflow_activation"), "fp16", candidate="onnxrt"), tmp_path / "b")
    page = (tmp_path / "b" / "report.html").read_text()
    # A list the page does not number: the steps number themselves, and a keep answered by an earlier run has no
    # step number (an ordered list numbered it, and every line after it read two numbers apart).
    assert "Steps taken" in page and "<ul><li>step 1" in page and "<ol>" not in page
    if bisector == "subgraph":
        assert "FAILING SUBGRAPH FOUND" in page and "Run the reproducer" in page and "accudiff compare subgraph.onnx" in page
    else:
        assert "REPAIRED" in page and "Keep in higher precision" in page and 'id="ranking"' in page


needs_browser = pytest.mark.skipif(browser() is None, reason="no headless Chromium here (Debian: apt-get install chromium)")


@needs_browser
def test_the_page_renders_in_chromium_without_script_errors(hostile_report, tmp_path):
    result, _ = hostile_report
    done = render(result.report_dir / "report.html", "--dump-dom", "--virtual-time-budget=3000")
    dom = done.stdout
    assert 'id="verdict">FAIL<' in dom
    assert "introduces the error" in dom and "<svg" in dom
    assert "Uncaught" not in done.stderr and "alert(" not in done.stderr
    shot = screenshot(result.report_dir / "report.html", tmp_path / "page.png", 1280, 1600)
    assert shot.stat().st_size > 20_000  # a real picture of a real page


_MEASURE = """<script>
const svg = document.querySelector('svg'), frame = svg.getBoundingClientRect();
document.getElementById('boxes').textContent = JSON.stringify([...svg.querySelectorAll('text')].map(t => {
  const b = t.getBoundingClientRect();
  return {text: t.textContent, fill: t.getAttribute('fill'), left: b.left - frame.left, top: b.top - frame.top, right: b.right - frame.left, bottom: b.bottom - frame.top};
}));
</script>"""


@needs_browser
def test_the_error_paths_labels_neither_overlap_nor_leave_the_plot_in_chromium(tmp_path):
    """Seen on the trained Magika quantized by quantize_static: the labels of ruled-out nodes of one block were
    drawn over each other and past the plot's right edge, and the first tensor name on the x axis was cut at the
    left. Each text's box as Chromium lays it out: labels apart from one another, every text inside the picture."""
    import json

    import numpy as np
    import pandas as pd

    count, block = 120, "jax2tf_get_logits_/pjit_get_logits_/MagikaV2/LayerNorm_1/"
    names = [f"{block}tensor_number_{k}:0" for k in range(count)]
    sqnr = np.where(np.arange(count) < 60, 40.0, 5.0) + np.sin(np.arange(count))
    table = pd.DataFrame({"tensor": names, "node": [n[:-2] for n in names], "op_type": "Mul", "status": ["fail" if k >= 60 else "pass" for k in range(count)],
                          "sqnr_db": sqnr, "isolated_sqnr_db": sqnr + 20})
    absorbed = [(names[k], names[k + 8], ("Tanh", f"{block}ApplyActivation_{k}/Tanh")) for k in [*range(60, 67), count - 9]]
    svg = plots.error_path(table, [(names[63], "verified cause")], [], absorbed)
    width, height = (float(re.search(f'{side}="([0-9.]+)"', svg).group(1)) for side in ("width", "height"))
    page = tmp_path / "plot.html"
    page.write_text(f"<html><body style='margin:0'>{svg}<pre id='boxes'></pre>{_MEASURE}</body></html>")
    dom = render(page, "--dump-dom", "--virtual-time-budget=2000").stdout
    boxes = json.loads(html.unescape(re.search(r"<pre id=\"boxes\">(.*?)</pre>", dom, re.S).group(1)))
    labels = [b for b in boxes if b["fill"] in (plots.ABSORBED_COLOUR, plots.CAUSE_COLOUR)]
    assert len(labels) == 9, [b["text"] for b in labels]  # eight absorbers, one cause
    for k, a in enumerate(labels):
        for b in labels[k + 1 :]:
            assert a["right"] <= b["left"] or b["right"] <= a["left"] or a["bottom"] <= b["top"] or b["bottom"] <= a["top"], (a, b)
    outside = [b for b in boxes if b["left"] < -0.5 or b["top"] < -0.5 or b["right"] > width + 0.5 or b["bottom"] > height + 0.5]
    assert not outside, outside


@needs_browser
def test_a_long_unbroken_line_wraps_inside_the_page_in_chromium(tmp_path):
    """Seen on a decoder built by the GenAI builder: its own option, `nodes_to_exclude=` and the node names joined
    by commas without a space, ran 900 px past the page's right edge as one word. Lines of the cause's lists and
    facts wrap inside the page, as Chromium lays them out at 1280 px."""
    from accudiff.report.html_blocks import facts_table, page, section, structured

    names = ",".join(f"/model/layers.{k}/attn/qkv_proj/MatMul" for k in range(12))
    lines = ["cause: accumulated error", "  repair: keep 12 node(s)",
             f"    or quantize again without them: python -m onnxruntime_genai.models.builder -i <hf> -o <out> -p int4 -e cpu --extra_options nodes_to_exclude={names}"]
    body = facts_table({"first tensor out of tolerance": names.replace(",", "_")}) + structured(lines)
    path = tmp_path / "report.html"
    path.write_text(page("wraps", [], [section("Cause", body)]).replace("</body>", "<pre id='widths'></pre><script>document.getElementById('widths')"
                                                                       ".textContent = document.documentElement.scrollWidth + ' ' + window.innerWidth;</script></body>"))
    dom = render(path, "--dump-dom", "--virtual-time-budget=2000", "--window-size=1280,900").stdout
    scrolled, viewport = map(int, re.search(r"<pre id=\"widths\">(\d+) (\d+)</pre>", dom).group(1, 2))
    assert scrolled <= viewport, (scrolled, viewport)
