"""The report folder's contents: summary.json (versioned schema, see README), tensors.csv, samples.csv,
report.html and summary.md (report/html.py).

The caller has already put the inputs and the candidate model into the staging folder; everything
becomes visible at once when the folder is committed.
"""

from __future__ import annotations

import json

from accudiff.model.inputs import save_feeds
from accudiff.report.content import (
    HTML_FILE, INPUTS_FILE, MARKDOWN_FILE, SAMPLES_FILE, SUMMARY_FILE, TENSORS_FILE, WORST_SAMPLES_FILE, finite, summary, worst_samples,
)
from accudiff.atomic import ReportFolder
from accudiff.report.html import compare_page, summary_markdown

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
    folder.write_text(HTML_FILE, compare_page(result))
    folder.write_text(MARKDOWN_FILE, summary_markdown(result))


