"""The report folder's contents: summary.json (versioned schema, see README), tensors.csv, samples.csv,
report.html and summary.md (report/html.py).

The caller has already put the inputs and the candidate model into the staging folder; everything
becomes visible at once when the folder is committed.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict

from accudiff import __version__
from accudiff.model.inputs import save_feeds
from accudiff.report.folder import ReportFolder

SUMMARY_SCHEMA = "accudiff.compare.summary"
SUMMARY_SCHEMA_VERSION = 4
SUMMARY_FILE = "summary.json"
TENSORS_FILE = "tensors.csv"
SAMPLES_FILE = "samples.csv"
MARKDOWN_FILE = "summary.md"
WORST_SAMPLES_FILE = "worst_samples.npz"
INPUTS_FILE = "inputs.npz"
WORST_SAMPLE_COUNT = 5
WORST_COUNT = 5
OUTPUT_COLUMNS = ["tensor", "status", "max_abs_err", "max_rel_err", "tol_ratio", "outside_share", "cosine", "sqnr_db"]


def summary(result) -> dict:
    """The summary document of a CompareResult (non-finite numbers are written as "inf"/"-inf"/"nan")."""
    table = result.table
    outputs = []
    failures = {f.tensor: f for f in result.output_failures}
    for _, row in result.outputs.iterrows():
        entry = {column: row[column] for column in OUTPUT_COLUMNS}
        if row["tensor"] in failures:
            failure = failures[row["tensor"]]
            entry["findings"] = [asdict(f) for f in failure.findings]
            entry["cause"] = asdict(failure.cause)
            entry["repair"] = asdict(failure.repair) if failure.repair is not None else None
            entry["first_failing_upstream"] = failure.first_failing_upstream
        outputs.append(entry)
    document = {
        "schema": SUMMARY_SCHEMA,
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "accudiff_version": __version__,
        "model": str(result.model),
        "precision": result.precision,
        "candidate": result.candidate,
        "verdict": result.verdict,
        "tolerances": result.tolerances.as_dict(),
        "iterations": result.iterations,
        "seed": result.seed,
        "coverage": {"compared": result.coverage[0], "computed": result.coverage[1], "share": result.coverage[0] / max(result.coverage[1], 1)},
        "branches": result.branches,
        "counts": {
            "tensors": len(table),
            "failing": int((table["status"] == "fail").sum()),
            "not_observed": int((table["status"] == "not observed").sum()) + len(result.not_observable),
        },
        "first_failure": asdict(result.first_failure) if result.first_failure else None,
        "outputs": outputs,
        "worst_tensors": worst_tensors(table).to_dict("records"),
        "kept_fp32": [asdict(k) for k in result.kept],
        "not_observable": result.not_observable,
        "notices": result.notices,
        "timings_s": result.timings,
        "inputs": result.inputs,
        "samples": _samples_summary(result),
        "files": {"tensors": TENSORS_FILE, "samples": SAMPLES_FILE, "inputs": INPUTS_FILE, "candidate_models": result.candidate_models,
                  "html": "report.html", "markdown": MARKDOWN_FILE},
        "replay": shlex.join(result.replay) if result.replay else None,
    }
    return finite(document)


def _samples_summary(result) -> dict:
    """How many samples were compared, which fail per graph output, and class-score agreement."""
    per_output = {}
    for output, rows in result.samples.groupby("tensor", sort=False):
        failing = rows[rows["status"] == "fail"]
        per_output[output] = {"failing": int(len(failing)), "failing_samples": [int(s) for s in failing["sample"][:100]]}
    return {"compared": result.iterations, "per_output": per_output, "class_agreement": result.class_agreement()}


def worst_tensors(table, count: int = WORST_COUNT):
    """The worst compared float tensors: failing ones first, then by SQNR. A tensor whose reference is all
    within its absolute tolerance of zero has an SQNR that means nothing (any rounding is loud next to
    no signal): it ranks after the others of its group."""
    compared = table[table["sqnr_db"].notna()]
    order = compared.assign(
        _passes=compared["status"] != "fail",
        _near_zero=compared["ref_absmax"] <= compared["atol"],
    ).sort_values(["_passes", "_near_zero", "sqnr_db"], kind="stable")
    return order.head(count)[["tensor", "op_type", "status", "max_abs_err", "sqnr_db", "outside_share"]]


def write_report(result, folder: ReportFolder, samples) -> None:
    """tensors.csv, samples.csv, worst_samples.npz (the inputs of the worst samples, to replay them with
    --load-inputs) and summary.json, beside the inputs and the candidate model already there."""
    result.table.to_csv(folder.path / TENSORS_FILE, index=False)
    result.samples.to_csv(folder.path / SAMPLES_FILE, index=False)
    worst = worst_samples(result)
    if worst:
        save_feeds([samples[i] for i in worst], folder.path / WORST_SAMPLES_FILE)
    document = summary(result)
    document["worst_samples"] = {"file": WORST_SAMPLES_FILE if worst else None, "samples": worst}
    if not (folder.path / INPUTS_FILE).exists():  # a dataset is not copied: the summary says where it is
        document["files"]["inputs"] = None
    folder.write_text(SUMMARY_FILE, json.dumps(finite(document), indent=2) + "\n")
    from accudiff.report.html import HTML_FILE, compare_page, summary_markdown

    folder.write_text(HTML_FILE, compare_page(result))
    folder.write_text(MARKDOWN_FILE, summary_markdown(result))


def worst_samples(result, count: int = WORST_SAMPLE_COUNT) -> list[int]:
    """The failing samples reaching the most tolerances on some graph output, worst first (none to pick
    out of a single sample: inputs.npz replays it)."""
    if result.iterations < 2:
        return []
    failing = result.failing_samples
    return list(dict.fromkeys(int(s) for s in failing["sample"]))[:count]


def finite(value):
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
