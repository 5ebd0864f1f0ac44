"""The checker behind the pytest plugin's `accudiff` fixture and marker: run a comparison, judge it against
tolerances, decision targets and a baseline, and fail the test with a message a person can act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import pytest

from accudiff.checks.baselines import baseline_path, compared_name, decision_entries, in_ci, regressions, safe_name, write_baseline
from accudiff.errors import AccudiffError
from accudiff.text import percent

if TYPE_CHECKING:
    from accudiff.model.stores import ReferenceCache

REPORT_ROOT = "reports/pytest"
PROPERTY = "accudiff"  # the key of a check's entry in its test report's user_properties (the terminal summary reads it)
PATH_OPTIONS = frozenset({"inputs", "calib_data", "candidate_model", "prompts", "load_candidate", "load_reference", "save_candidate", "save_reference",
                          "report_dir"})


@dataclass
class CheckSettings:
    """What the pytest session's options and ini keys set for every check."""

    candidate: str
    report_root: Path
    update_baseline: bool
    tolerances: dict[str, dict[str, float]]
    sqnr_margin_db: float
    error_growth: float
    workers: int | None = None
    cache: ReferenceCache | None = None  # made on first use: plugin registration stays light

    @classmethod
    def from_config(cls, config: pytest.Config) -> "CheckSettings":
        return cls(
            candidate=config.getoption("accudiff_candidate") or config.getini("accudiff_candidate"),
            report_root=config.rootpath / (config.getoption("accudiff_report_dir") or config.getini("accudiff_report_dir")),
            update_baseline=bool(config.getoption("accudiff_update_baseline")),
            tolerances=parse_tolerances(config.getini("accudiff_tolerances")),
            sqnr_margin_db=float(config.getini("accudiff_sqnr_margin_db")),
            error_growth=float(config.getini("accudiff_error_growth")),
            # One worker per check unless asked: pytest-xdist already runs checks side by side.
            workers=config.getoption("accudiff_workers") or (int(config.getini("accudiff_workers")) if config.getini("accudiff_workers") else 1),
        )

    def reference_cache(self) -> ReferenceCache:
        if self.cache is None:
            from accudiff.model.stores import ReferenceCache

            self.cache = ReferenceCache()
        return self.cache


class AccuracyChecker:
    """The `accudiff` fixture: `compare(...)` prepares a check; `assert_within(...)` runs and judges it."""

    def __init__(self, settings: CheckSettings, node: pytest.Item):
        self._settings, self._node = settings, node

    def compare(self, model: str | Path, precision: str = "fp32", **options) -> "AccuracyCheck":
        """A relative path (the model, inputs, calibration data...) is read from pytest's rootdir, the folder
        of pyproject.toml or pytest.ini: a suite checks the same files from whichever folder it is run."""
        root = self._node.config.rootpath
        paths = {k: root / v for k, v in options.items() if k in PATH_OPTIONS and isinstance(v, (str, Path))}
        return AccuracyCheck(self._settings, self._node, root / model, precision, {**options, **paths})


@dataclass
class AccuracyCheck:
    settings: CheckSettings
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

        `tensors`: "outputs" (the graph outputs the verdict is judged by: all but a decoder's KV cache), "all",
        or a list of tensor names. `decision`: targets of
        decision figures (top1=0.99, kl=1e-2, cosine_min=0.99, iou=, flipped_share=1e-3, detections=0.95...): a graph output that has the figure is
        judged by it instead of its tolerance, as `--require` does (verification aims at it too). Returns
        the result.
        """
        __tracebackhide__ = True
        from accudiff.report.content import held_to, requirement_text

        result = self._run(atol, rtol, stol, [f"{name}={value}" for name, value in decision.items()])
        rows = _select(result, tensors)
        failing = {f.tensor for f in result.output_failures}
        problems = []
        for _, row in rows.iterrows():
            required = requirement_text(row["tensor"], result)
            if required is not None:
                if row["tensor"] in failing:  # and of each figure it misses, the strictest target it does meet: what a team may hold it to
                    held = [f"; it is shown to meet {met.name}={met.target:g}" if met is not None else f"; no {name} target is shown met"
                            for name, met in held_to(row["tensor"], result)]
                    problems.append(f"output '{row['tensor']}' fails {required}" + "".join(held))
            elif row["status"] == "fail":
                problems.append(_tolerance_problem(row))
        if min_sqnr_db is not None:
            problems += [
                f"tensor '{row['tensor']}': SQNR {row['sqnr_db']:.1f} dB is below the required {min_sqnr_db:g} dB"
                for _, row in rows.iterrows()
                if row["sqnr_db"] < min_sqnr_db
            ]
        compared = compared_name(self.precision, self.options.get("candidate_model"), self.node.config.rootpath)
        baseline_file = baseline_path(Path(self.node.path), self.node.name, compared)
        written = None
        recorded_with = self._recorded_with(atol, rtol, stol, decision)
        decided = decision_entries({name: result.decisions[name] for name in rows["tensor"] if name in result.decisions}, result.intervals)
        if baseline and not problems:
            if self.settings.update_baseline:
                write_baseline(baseline_file, rows, recorded_with, decided)
                written = str(baseline_file)
            elif not baseline_file.exists():
                if in_ci():
                    problems.append(f"no baseline at {baseline_file}: record it where CI is not set (the test writes it), and commit it")
                else:
                    write_baseline(baseline_file, rows, recorded_with, decided)
                    written = str(baseline_file)
                    problems.append(f"baseline created: {baseline_file}: commit it (a check against a baseline written by this run would prove nothing)")
            else:
                try:
                    problems += regressions(baseline_file, rows, recorded_with, self.settings.sqnr_margin_db, self.settings.error_growth, decided)
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
        from accudiff.atomic import default_report_dir
        from accudiff.options import python_words
        from accudiff.runners import unavailable_reason
        from accudiff.settings import settings_of

        options = {"workers": self.settings.workers, **self.options, **({"require": require} if require else {})}
        candidate = options.pop("candidate", self.settings.candidate)
        reason = unavailable_reason(candidate)
        if reason is not None:
            pytest.skip(f"accudiff: {reason}")
        try:
            # The precision compared: the one asked for, or a candidate model's own (its label, e.g. int8-dynamic+int4-weight),
            # which names its line of accudiff_tolerances and its report folder.
            precision = settings_of(self.model, self.precision, {**options, "candidate": candidate}).precision
            defaults = self.settings.tolerances.get(precision, {})
            tolerances = {
                name: value if value is not None else defaults.get(name)
                for name, value in (("atol", atol), ("rtol", rtol), ("stol", stol))
            }
            self.settings.report_root.mkdir(parents=True, exist_ok=True)
            return compare(
                self.model,
                self.precision,
                candidate=candidate,
                report_dir=default_report_dir(safe_name(self.node.name), precision, self.settings.report_root),
                reference_cache=self.settings.reference_cache(),
                **tolerances,
                **options,
            )
        except AccudiffError as exc:
            refused = f"accudiff: {python_words(str(exc))}"
        pytest.fail(refused, pytrace=False)  # outside the except: the failure is the one sentence, not a chain

    def _record(self, result, problems, written) -> None:
        from accudiff.report.content import cause_lines

        table = result.table
        worst = table[table["sqnr_db"].notna()].nsmallest(3, "sqnr_db")
        self.node.user_properties.append(
            (
                PROPERTY,
                {
                    "test": self.node.nodeid,
                    "model": str(self.model),
                    "precision": result.precision,
                    "failed": bool(problems),
                    "causes": [f"output '{f.tensor}': {cause_lines(f, result, python=True)[0]}" for f in result.output_failures if f.cause is not None],
                    "worst": [f"{r['tensor']}: SQNR {r['sqnr_db']:.1f} dB, max abs err {r['max_abs_err']:.3g}" for _, r in worst.iterrows()],
                    "report": str(result.report_dir) if result.report_dir else None,
                    "baseline_written": written,
                },
            )
        )


def _select(result, tensors: str | Sequence[str]):
    """The rows `tensors` names: "outputs" are those the verdict is judged by (a decoder's KV cache is its
    state, judged through the logits of later steps, as the command line judges it), "all" every observed one."""
    table = result.table
    if tensors == "outputs":
        return table[table["tensor"].isin(result.deciding_outputs)]
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


def parse_tolerances(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    parsed: dict[str, dict[str, float]] = {}
    for line in lines:
        precision, *pairs = line.split()
        try:
            parsed[precision] = {key: float(value) for key, value in (pair.split("=", 1) for pair in pairs)}
        except ValueError:
            raise pytest.UsageError(f"accudiff_tolerances: cannot read '{line}' (expected 'fp16 atol=1e-3 rtol=1e-2')") from None
    return parsed
