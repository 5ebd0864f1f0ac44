"""pytest plugin: assert accuracy tolerances, and catch accuracy regressions, in a team's own test suite.

Registered through the `pytest11` entry point. Two forms:

    def test_fp16(accudiff):
        accudiff.compare("model.onnx", precision="fp16").assert_within(atol=1e-3, min_sqnr_db=40)

    @pytest.mark.accudiff(model="model.onnx", precision="fp16", atol=1e-3, baseline=True)
    def test_fp16_marked():
        pass

Reference runs are cached for the session (per worker under pytest-xdist). Baselines are small JSON files
in `accudiff_baselines/` beside the test file, one per test and precision (or candidate model), holding the options they were
recorded with. A missing baseline fails its test: it is written, and the failure says to commit it (a
regression check that writes its baseline and passes never fires on a fresh checkout); where the
environment variable CI is set, it is not written at all. `--accudiff-update-baseline` rewrites them from
passing runs. A baseline recorded with other options is never compared with: its test fails saying so.
"""

from __future__ import annotations

import pytest

from accudiff.checks.baselines import DEFAULT_ERROR_GROWTH, DEFAULT_SQNR_MARGIN_DB
from accudiff.checks.checker import PROPERTY, REPORT_ROOT, AccuracyChecker, CheckSettings

_SETTINGS = pytest.StashKey[CheckSettings]()


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
    config.stash[_SETTINGS] = CheckSettings.from_config(config)


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
        from accudiff.judging.objective import REQUIREMENTS  # here: registering the plugin stays light

        options = dict(marker.kwargs)
        model = options.pop("model", marker.args[0] if marker.args else None)
        if model is None:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.accudiff needs model=...")
        checks = {k: options.pop(k) for k in ("atol", "rtol", "stol", "min_sqnr_db", "tensors", "baseline", *REQUIREMENTS) if k in options}
        precision = options.pop("precision", "fp32")
        AccuracyChecker(item.config.stash[_SETTINGS], item).compare(model, precision, **options).assert_within(**checks)
    return result


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    entries = [value for report in terminalreporter.getreports("") for key, value in report.user_properties if key == PROPERTY]
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
