"""Baseline files of accuracy checks: per-tensor figures, and each output's decision figures with their 95%
intervals, that a test is held to from one commit to the next.

One small JSON file per test and precision (or candidate model), in `accudiff_baselines/` beside the test file, with the model,
the precision and the options it was recorded with. A check against a baseline recorded with other
options says so rather than comparing; a damaged file is one sentence.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from accudiff.errors import AccudiffError
from accudiff.atomic import write_atomically
from accudiff.judging.objective import REQUIREMENTS, figure_text

BASELINE_SCHEMA = "accudiff.baseline"
BASELINE_METRICS = ("sqnr_db", "max_abs_err", "cosine", "outside_share")
# The decision figures a baseline keeps, with their 95% intervals: a later run whose figure falls outside the
# baseline's interval, on the worse side, regressed (the same inputs on the same runtime give the same figure).
BASELINE_DECISIONS = ("top1", "kl", "cosine_min", "flipped_share", "detections")
DEFAULT_SQNR_MARGIN_DB = 3.0
DEFAULT_ERROR_GROWTH = 2.0


def baseline_path(test_file: Path, test_name: str, compared: str) -> Path:
    """`compared`: the precision accudiff converts to, or `candidate-<path>` for a candidate model (see
    `compared_name`): each candidate of a test keeps its own baseline."""
    return test_file.parent / "accudiff_baselines" / f"{test_file.stem}.{safe_name(test_name)}.{safe_name(compared)}.json"


def compared_name(precision: str, candidate_model: Path | None, root: Path) -> str:
    """What a baseline's name says was compared: the precision, or the candidate model's path from `root`
    (a candidate's precision label repeats across candidates, and GenAI folders all hold a model.onnx)."""
    if candidate_model is None:
        return precision
    path = Path(candidate_model)
    return "candidate-" + (str(path.relative_to(root)) if path.is_relative_to(root) else path.name)


def safe_name(name: str) -> str:
    """A test's or a precision's name as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:120]


def in_ci() -> bool:
    """Whether CI systems' variable says this is a CI run (GitHub Actions, GitLab, CircleCI, Travis... set CI)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def decision_entries(decisions: dict[str, dict], intervals: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """Each output's decision figures that have a 95% interval (BASELINE_DECISIONS), as a baseline keeps them."""
    entries = {}
    for output, figures in decisions.items():
        spans = intervals.get(output, {})
        kept = {name: {"value": _rounded(figures[name]), "low": _rounded(spans[name].low), "high": _rounded(spans[name].high)}
                for name in BASELINE_DECISIONS if name in figures and spans.get(name) is not None}
        if kept:
            entries[output] = kept
    return entries


def write_baseline(path: Path, rows, recorded_with: dict, decisions: dict[str, dict[str, dict]] | None = None) -> None:
    """The figures of the checked tensors (`rows` of a comparison's table) and of their decisions
    (`decision_entries`), with what they were recorded with."""
    document = {
        "schema": BASELINE_SCHEMA,
        "schema_version": 2,
        **recorded_with,
        "tensors": {row["tensor"]: {m: _rounded(row[m]) for m in BASELINE_METRICS} for _, row in rows.iterrows()},
        **({"decisions": decisions} if decisions else {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())


def read_baseline(path: Path) -> tuple[dict[str, dict], dict, dict[str, dict[str, dict]]]:
    """The per-tensor figures of a baseline file, what it was recorded with, and its outputs' decision
    figures (none in a file written before they were kept); a damaged one is one sentence, not a traceback."""
    try:
        document = json.loads(path.read_bytes())
        tensors = document["tensors"]
        recorded_with = {key: document.get(key) for key in ("model", "precision", "options")}
        for figures in tensors.values():
            for metric in ("sqnr_db", "max_abs_err"):  # what a regression is judged on
                if figures[metric] is not None and not isinstance(figures[metric], (int, float)):
                    raise ValueError(f"{metric} is not a number")
        decisions = document.get("decisions", {})
        for figures in decisions.values():
            for name, entry in figures.items():
                if name not in BASELINE_DECISIONS or not all(isinstance(entry[k], (int, float)) for k in ("value", "low", "high")):
                    raise ValueError(f"decision figure {name!r} is not one with a value and a 95% interval")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
        raise AccudiffError(
            f"baseline '{path}' cannot be read ({reason}): delete it, or run with --accudiff-update-baseline to write it again"
        ) from None
    return tensors, recorded_with, decisions


def regressions(path: Path, rows, recorded_with: dict, sqnr_margin_db: float, error_growth: float,
                decisions: dict[str, dict[str, dict]] | None = None) -> list[str]:
    """What got worse against the baseline at `path`: SQNR down by more than the margin, max abs error up by
    more than the growth, a decision figure (`decision_entries`) outside the baseline's 95% interval on the
    worse side; or, recorded with other settings, that it cannot be compared."""
    baseline, theirs, decided = read_baseline(path)
    if theirs != recorded_with:
        changed = sorted(key for key in {*recorded_with["options"], *(theirs.get("options") or {})}
                         if recorded_with["options"].get(key) != (theirs.get("options") or {}).get(key))
        changed += [key for key in ("model", "precision") if theirs.get(key) != recorded_with[key]]
        return [f"baseline {path} was recorded with other settings ({', '.join(changed) or 'its format'} differ): its figures say nothing of "
                "this run; rerun with --accudiff-update-baseline to record this one"]
    problems = []
    for _, row in rows.iterrows():
        before = baseline.get(row["tensor"])
        if before is None:
            continue
        if before["sqnr_db"] is not None and row["sqnr_db"] < before["sqnr_db"] - sqnr_margin_db:
            problems.append(
                f"tensor '{row['tensor']}': SQNR fell from {before['sqnr_db']:.1f} dB (baseline) to {row['sqnr_db']:.1f} dB, "
                f"more than the allowed {sqnr_margin_db:g} dB"
            )
        if before["max_abs_err"] and row["max_abs_err"] > before["max_abs_err"] * error_growth:
            problems.append(
                f"tensor '{row['tensor']}': max abs error grew from {before['max_abs_err']:.3g} (baseline) to "
                f"{row['max_abs_err']:.3g}, more than {error_growth:g}x"
            )
    for output, figures in (decisions or {}).items():
        for name, now in figures.items():
            before = decided.get(output, {}).get(name)
            if before is None:
                continue
            higher_is_better = REQUIREMENTS[name][0] == "min"
            if (now["value"] < before["low"]) if higher_is_better else (now["value"] > before["high"]):
                problems.append(
                    f"output '{output}': {REQUIREMENTS[name][1]} {'fell' if higher_is_better else 'rose'} from {figure_text(name, before['value'])} "
                    f"[{figure_text(name, before['low'])}, {figure_text(name, before['high'])}] (baseline) to {figure_text(name, now['value'])}, "
                    f"outside the baseline's 95% interval")
    if problems:
        problems.append(f"baseline: {path} (rerun with --accudiff-update-baseline to accept the new figures)")
    return problems


def _rounded(value) -> float | None:
    value = float(value)
    if not math.isfinite(value):
        return None
    return float(f"{value:.4g}")
