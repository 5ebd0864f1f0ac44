"""pytest plugin: assert accuracy tolerances, and catch accuracy regressions, in a team's own test suite.

Registered through the `pytest11` entry point. Two forms:

    def test_fp16(accudiff):
        accudiff.compare("model.onnx", precision="fp16").assert_within(atol=1e-3, min_sqnr_db=40)

    @pytest.mark.accudiff(model="model.onnx", precision="fp16", atol=1e-3, baseline=True)
    def test_fp16_marked():
        pass

Reference runs are cached for the session (per worker under pytest-xdist). Baselines are small JSON files
in `accudiff_baselines/` beside the test file, one per test and precision, holding the options they were
recorded with. A missing baseline fails its test: it is written, and the failure says to commit it (a
regression check that writes its baseline and passes never fires on a fresh checkout); where the
environment variable CI is set, it is not written at all. `--accudiff-update-baseline` rewrites them from
passing runs. A baseline recorded with other options is never compared with: its test fails saying so.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import pytest

from accudiff.errors import AccudiffError
from accudiff.text import percent

if TYPE_CHECKING:
    from accudiff.runners.outputs import ReferenceCache

BASELINE_SCHEMA = "accudiff.baseline"
BASELINE_METRICS = ("sqnr_db", "max_abs_err", "cosine", "outside_share")
DEFAULT_SQNR_MARGIN_DB = 3.0
DEFAULT_ERROR_GROWTH = 2.0
REPORT_ROOT = "reports/pytest"
_PROPERTY = "accudiff"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("accudiff", "accuracy checks with accudiff")
    group.addoption("--accudiff-candidate", help="candidate backend for accuracy checks (auto, onnxrt, trt)")
    group.addoption("--accudiff-report-dir", help=f"folder for the reports of accuracy checks (default {REPORT_ROOT})")
    group.addoption("--accudiff-update-baseline", action="store_true", help="rewrite accuracy baselines from passing runs")
    group.addoption("--accudiff-workers", type=int, help="worker processes per accuracy check (default 1)")
    parser.addini("accudiff_candidate", "candidate backend for accuracy checks", default="auto")
    parser.addini("accudiff_report_dir", "folder for the reports of accuracy checks", default=REPORT_ROOT)
    parser.addini("accudiff_tolerances", "per-precision defaults, one per line: 'fp16 atol=1e-3 rtol=1e-2 stol=2e-3'", type="linelist", default=[])
    parser.addini("accudiff_sqnr_margin_db", "fail when SQNR drops this many dB below the baseline", default=str(DEFAULT_SQNR_MARGIN_DB))
    parser.addini("accudiff_error_growth", "fail when max abs error grows this many times over the baseline", default=str(DEFAULT_ERROR_GROWTH))
    parser.addini("accudiff_workers", "worker processes per accuracy check (samples split over them)", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "accudiff(model, precision='fp32', atol=None, rtol=None, stol=None, min_sqnr_db=None, tensors='outputs', "
        "baseline=False, **compare_options): check the model's accuracy with accudiff",
    )
    config.stash[_SETTINGS] = Settings.from_config(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    settings = config.stash.get(_SETTINGS, None)
    if settings is not None and settings.cache is not None:
        settings.cache.close()


@pytest.fixture
def accudiff(request: pytest.FixtureRequest) -> "AccuracyChecker":
    """Compare models against their FP32 reference and assert accuracy (see the module docstring)."""
    return AccuracyChecker(request.config.stash[_SETTINGS], request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    marker = item.get_closest_marker("accudiff")
    if marker is not None:
        options = dict(marker.kwargs)
        model = options.pop("model", marker.args[0] if marker.args else None)
        if model is None:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.accudiff needs model=...")
        checks = {k: options.pop(k) for k in ("atol", "rtol", "stol", "min_sqnr_db", "tensors", "baseline") if k in options}
        precision = options.pop("precision", "fp32")
        AccuracyChecker(item.config.stash[_SETTINGS], item).compare(model, precision, **options).assert_within(**checks)
    return result


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    entries = [value for report in terminalreporter.getreports("") for key, value in report.user_properties if key == _PROPERTY]
    failures = [e for e in entries if e["failed"]]
    created = [e for e in entries if e.get("baseline_written")]
    if not failures and not created:
        return
    terminalreporter.section("accudiff")
    for entry in failures:
        terminalreporter.write_line(f"FAILED {entry['model']} [{entry['precision']}] ({entry['test']})")
        for cause in entry["causes"]:
            terminalreporter.write_line(f"    {cause}")
        if entry["worst"]:  # where the error is largest: downstream of a cause, or absorbed on the way
            terminalreporter.write_line("    lowest SQNR (where the error is largest, not what causes it):")
        for worst in entry["worst"]:
            terminalreporter.write_line(f"      {worst}")
        if entry.get("report"):
            terminalreporter.write_line(f"    report: {entry['report']}")
    for entry in created:
        terminalreporter.write_line(f"baseline written: {entry['baseline_written']}")


@dataclass
class Settings:
    candidate: str
    report_root: Path
    update_baseline: bool
    tolerances: dict[str, dict[str, float]]
    sqnr_margin_db: float
    error_growth: float
    workers: int | None = None
    cache: ReferenceCache | None = None  # made on first use: plugin registration stays light

    @classmethod
    def from_config(cls, config: pytest.Config) -> "Settings":
        return cls(
            candidate=config.getoption("accudiff_candidate") or config.getini("accudiff_candidate"),
            report_root=config.rootpath / (config.getoption("accudiff_report_dir") or config.getini("accudiff_report_dir")),
            update_baseline=bool(config.getoption("accudiff_update_baseline")),
            tolerances=_parse_tolerances(config.getini("accudiff_tolerances")),
            sqnr_margin_db=float(config.getini("accudiff_sqnr_margin_db")),
            error_growth=float(config.getini("accudiff_error_growth")),
            # One worker per check unless asked: pytest-xdist already runs checks side by side.
            workers=config.getoption("accudiff_workers") or (int(config.getini("accudiff_workers")) if config.getini("accudiff_workers") else 1),
        )

    def reference_cache(self) -> ReferenceCache:
        if self.cache is None:
            from accudiff.runners.outputs import ReferenceCache

            self.cache = ReferenceCache()
        return self.cache


_SETTINGS = pytest.StashKey[Settings]()
PATH_OPTIONS = frozenset({"inputs", "calib_data", "candidate_model", "prompts", "load_candidate", "load_reference", "save_candidate", "save_reference",
                          "report_dir"})


class AccuracyChecker:
    """The `accudiff` fixture: `compare(...)` prepares a check; `assert_within(...)` runs and judges it."""

    def __init__(self, settings: Settings, node: pytest.Item):
        self._settings, self._node = settings, node

    def compare(self, model: str | Path, precision: str = "fp32", **options) -> "AccuracyCheck":
        """A relative path (the model, inputs, calibration data...) is read from pytest's rootdir, the folder
        of pyproject.toml or pytest.ini: a suite checks the same files from whichever folder it is run."""
        root = self._node.config.rootpath
        paths = {k: root / v for k, v in options.items() if k in PATH_OPTIONS and isinstance(v, (str, Path))}
        return AccuracyCheck(self._settings, self._node, root / model, precision, {**options, **paths})


@dataclass
class AccuracyCheck:
    settings: Settings
    node: pytest.Item
    model: Path
    precision: str
    options: dict = field(default_factory=dict)

    def assert_within(
        self,
        atol: float | None = None,
        rtol: float | None = None,
        stol: float | None = None,
        min_sqnr_db: float | None = None,
        tensors: str | Sequence[str] = "outputs",
        baseline: bool = False,
        **decision: float,
    ):
        """Run the comparison and fail the test, with a message a person can act on, if it is out of bounds.

        `tensors`: "outputs" (graph outputs decide), "all", or a list of tensor names. `decision`: targets of
        decision figures (top1=0.99, kl=1e-2, cosine_min=0.99, iou=, flipped_share=1e-3...): a graph output that has the figure is
        judged by it instead of its tolerance, as `--require` does (verification aims at it too). Returns
        the result.
        """
        __tracebackhide__ = True
        from accudiff.report.content import requirement_text

        result = self._run(atol, rtol, stol, [f"{name}={value}" for name, value in decision.items()])
        rows = _select(result.table, tensors)
        failing = {f.tensor for f in result.output_failures}
        problems = []
        for _, row in rows.iterrows():
            required = requirement_text(row["tensor"], result)
            if required is not None:
                problems += [f"output '{row['tensor']}' fails {required}"] if row["tensor"] in failing else []
            elif row["status"] == "fail":
                problems.append(_tolerance_problem(row))
        if min_sqnr_db is not None:
            problems += [
                f"tensor '{row['tensor']}': SQNR {row['sqnr_db']:.1f} dB is below the required {min_sqnr_db:g} dB"
                for _, row in rows.iterrows()
                if row["sqnr_db"] < min_sqnr_db
            ]
        baseline_path = _baseline_path(self.node, self.precision)
        written = None
        recorded_with = self._recorded_with(atol, rtol, stol, decision)
        if baseline and not problems:
            if self.settings.update_baseline:
                _write_baseline(baseline_path, result, rows, recorded_with)
                written = str(baseline_path)
            elif not baseline_path.exists():
                if _in_ci():
                    problems.append(f"no baseline at {baseline_path}: record it where CI is not set (the test writes it), and commit it")
                else:
                    _write_baseline(baseline_path, result, rows, recorded_with)
                    written = str(baseline_path)
                    problems.append(f"baseline created: {baseline_path}: commit it (a check against a baseline written by this run would prove nothing)")
            else:
                try:
                    problems += _regressions(baseline_path, rows, self.settings, recorded_with)
                except AccudiffError as exc:  # an unreadable baseline: said as the test's one problem
                    problems.append(str(exc))
        self._record(result, problems, written)
        if problems:
            pytest.fail(_message(result, problems), pytrace=False)
        return result

    def _recorded_with(self, atol, rtol, stol, decision: dict) -> dict:
        """What a baseline's figures depend on: the model, the precision and every option of the comparison
        (in the order that keeps it comparable)."""
        options = {**self.options, "atol": atol, "rtol": rtol, "stol": stol, **decision}
        return {"model": self.model.name, "precision": self.precision,
                "options": {key: str(value) for key, value in sorted(options.items()) if value is not None and key not in ("report_dir", "workers")}}

    def _run(self, atol, rtol, stol, require: list[str]):
        __tracebackhide__ = True
        from accudiff.api import compare
        from accudiff.report.folder import default_report_dir
        from accudiff.runners import unavailable_reason

        options = {"workers": self.settings.workers, **self.options, **({"require": require} if require else {})}
        candidate = options.pop("candidate", self.settings.candidate)
        reason = unavailable_reason(candidate)
        if reason is not None:
            pytest.skip(f"accudiff: {reason}")
        defaults = self.settings.tolerances.get(self.precision, {})
        tolerances = {
            name: value if value is not None else defaults.get(name)
            for name, value in (("atol", atol), ("rtol", rtol), ("stol", stol))
        }
        self.settings.report_root.mkdir(parents=True, exist_ok=True)
        try:
            return compare(
                self.model,
                self.precision,
                candidate=candidate,
                report_dir=default_report_dir(_safe(self.node.name), self.precision, self.settings.report_root),
                reference_cache=self.settings.reference_cache(),
                **tolerances,
                **options,
            )
        except AccudiffError as exc:
            refused = f"accudiff: {exc}"
        pytest.fail(refused, pytrace=False)  # outside the except: the failure is the one sentence, not a chain

    def _record(self, result, problems, written) -> None:
        from accudiff.report.content import cause_lines

        table = result.table
        worst = table[table["sqnr_db"].notna()].nsmallest(3, "sqnr_db")
        self.node.user_properties.append(
            (
                _PROPERTY,
                {
                    "test": self.node.nodeid,
                    "model": str(self.model),
                    "precision": self.precision,
                    "failed": bool(problems),
                    "causes": [f"output '{f.tensor}': {cause_lines(f, result, python=True)[0]}" for f in result.output_failures if f.cause is not None],
                    "worst": [f"{r['tensor']}: SQNR {r['sqnr_db']:.1f} dB, max abs err {r['max_abs_err']:.3g}" for _, r in worst.iterrows()],
                    "report": str(result.report_dir) if result.report_dir else None,
                    "baseline_written": written,
                },
            )
        )


def _select(table, tensors: str | Sequence[str]):
    if tensors == "outputs":
        return table[table["is_output"]]
    if tensors == "all":
        return table[table["status"] != "not observed"]
    wanted = list(tensors)
    missing = [name for name in wanted if name not in set(table["tensor"])]
    if missing:
        pytest.fail(f"accudiff: no tensor named {', '.join(missing)} in the model", pytrace=False)
    return table[table["tensor"].isin(wanted)]


def _tolerance_problem(row) -> str:
    from accudiff.report.content import element_index

    if row["note"]:
        return f"tensor '{row['tensor']}': {row['note']}"
    return (
        f"tensor '{row['tensor']}': {int(row['outside_count'])} of {int(row['elements'])} elements ({percent(row['outside_share'], 2)}) "
        f"outside atol={row['atol']:g} + rtol={row['rtol']:g}*|ref| + stol={row['stol']:g}*absmax; worst element "
        f"{element_index(row)}: reference {row['worst_ref']:.6g}, candidate {row['worst_cand']:.6g} (max abs err {row['max_abs_err']:.3g})"
    )


def _message(result, problems: list[str]) -> str:
    from accudiff.model.decoder import model_name
    from accudiff.report.content import HTML_FILE, cause_lines, sample_lines

    lines = [f"accudiff: {model_name(result.model)} [{result.precision}] is out of bounds ({result.candidate})"]
    lines += [f"  {problem}" for problem in problems]
    lines += sample_lines(result)
    for failure in result.output_failures:
        lines.append(f"  output '{failure.tensor}':")
        lines += [f"    {line}" for line in cause_lines(failure, result, python=True)]
    if result.first_failure is not None:
        lines.append(f"  first tensor out of tolerance (topological order): '{result.first_failure.tensor}' ({result.first_failure.op_type})")
    if result.report_dir is not None:
        lines.append(f"  full report: {result.report_dir / HTML_FILE} (summary.json, tensors.csv beside it)")
    return "\n".join(lines)


def _baseline_path(node: pytest.Item, precision: str) -> Path:
    return Path(node.path).parent / "accudiff_baselines" / f"{Path(node.path).stem}.{_safe(node.name)}.{_safe(precision)}.json"


def _in_ci() -> bool:
    """Whether CI systems' variable says this is a CI run (GitHub Actions, GitLab, CircleCI, Travis... set CI)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _write_baseline(path: Path, result, rows, recorded_with: dict) -> None:
    document = {
        "schema": BASELINE_SCHEMA,
        "schema_version": 2,
        **recorded_with,
        "tensors": {row["tensor"]: {m: _rounded(row[m]) for m in BASELINE_METRICS} for _, row in rows.iterrows()},
    }
    from accudiff.report.folder import write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())


def read_baseline(path: Path) -> tuple[dict[str, dict], dict]:
    """The per-tensor figures of a baseline file and what it was recorded with; a damaged one is one
    sentence, not a traceback."""
    try:
        document = json.loads(path.read_bytes())
        tensors = document["tensors"]
        recorded_with = {key: document.get(key) for key in ("model", "precision", "options")}
        for figures in tensors.values():
            for metric in ("sqnr_db", "max_abs_err"):  # what a regression is judged on
                if figures[metric] is not None and not isinstance(figures[metric], (int, float)):
                    raise ValueError(f"{metric} is not a number")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
        raise AccudiffError(
            f"baseline '{path}' cannot be read ({reason}): delete it, or run with --accudiff-update-baseline to write it again"
        ) from None
    return tensors, recorded_with


def _regressions(path: Path, rows, settings: Settings, recorded_with: dict) -> list[str]:
    baseline, theirs = read_baseline(path)
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
        if before["sqnr_db"] is not None and row["sqnr_db"] < before["sqnr_db"] - settings.sqnr_margin_db:
            problems.append(
                f"tensor '{row['tensor']}': SQNR fell from {before['sqnr_db']:.1f} dB (baseline) to {row['sqnr_db']:.1f} dB, "
                f"more than the allowed {settings.sqnr_margin_db:g} dB"
            )
        if before["max_abs_err"] and row["max_abs_err"] > before["max_abs_err"] * settings.error_growth:
            problems.append(
                f"tensor '{row['tensor']}': max abs error grew from {before['max_abs_err']:.3g} (baseline) to "
                f"{row['max_abs_err']:.3g}, more than {settings.error_growth:g}x"
            )
    if problems:
        problems.append(f"baseline: {path} (rerun with --accudiff-update-baseline to accept the new figures)")
    return problems


def _rounded(value) -> float | None:
    value = float(value)
    if not math.isfinite(value):
        return None
    return float(f"{value:.4g}")


def _parse_tolerances(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    parsed: dict[str, dict[str, float]] = {}
    for line in lines:
        precision, *pairs = line.split()
        try:
            parsed[precision] = {key: float(value) for key, value in (pair.split("=", 1) for pair in pairs)}
        except ValueError:
            raise pytest.UsageError(f"accudiff_tolerances: cannot read '{line}' (expected 'fp16 atol=1e-3 rtol=1e-2')") from None
    return parsed


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:120]
