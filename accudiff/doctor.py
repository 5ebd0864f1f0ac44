"""`accudiff doctor`: the TensorRT acceptance check a GPU user runs and pastes into a bug report.

It says which TensorRT, CUDA binding and GPU it found; builds the bundled clean fixture with every mark
mode; where TensorRT inference can run, compares the clean fixture (must pass) and the LayerNorm overflow
fixture (must fail, naming 'ln_square') in FP16 with every mark mode, and runs the TensorRT tests of a
source checkout. What it cannot run here it lists with the reason. Exit code 0 only when TensorRT
inference was verified end to end; 1 when a check failed or could not run.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from accudiff.errors import AccudiffError, first_line

CHECKOUT = Path(__file__).resolve().parents[1]  # a source checkout holds fixtures/ and tests/ here
MARK_MODES = ("all", "unfused", "outputs")


@dataclass
class Check:
    name: str
    outcome: str  # "ok" | "FAILED" | "not run"
    detail: str = ""


@dataclass
class DoctorReport:
    facts: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        inference = [c for c in self.checks if c.name.startswith("FP16 compare")]
        return bool(inference) and all(c.outcome == "ok" for c in self.checks)

    def text(self) -> str:
        lines = ["accudiff doctor"]
        lines += [f"  {key:<18} {value}" for key, value in self.facts.items()]
        lines += [f"  [{c.outcome:^7}] {c.name}" + (f": {c.detail}" if c.detail else "") for c in self.checks]
        failed = [c for c in self.checks if c.outcome == "FAILED"]
        if failed:
            verdict = f"FAILED: {len(failed)} check(s) failed (above); please paste this screen into a bug report"
        elif self.verified:
            verdict = "TensorRT inference verified end to end on this machine"
        else:
            skipped = next((c.detail for c in self.checks if c.outcome == "not run"), "")
            verdict = f"TensorRT inference NOT verified here: {skipped}"
        lines.append(f"  verdict: {verdict}")
        return "\n".join(lines)


def run_doctor() -> DoctorReport:
    report = DoctorReport()
    report.facts = _facts()
    fixtures = CHECKOUT / "fixtures"
    if not (fixtures / "clean.onnx").is_file():
        report.checks.append(Check("fixtures", "not run", f"no source checkout at {CHECKOUT}: clone the repository and run accudiff doctor there"))
        return report
    from accudiff.runners.trt_env import import_tensorrt, inference_unavailable_reason

    try:
        trt = import_tensorrt()
    except AccudiffError as exc:
        report.checks.append(Check("TensorRT", "not run", str(exc)))
        return report
    for mark in MARK_MODES:
        report.checks.append(_check(f"build the clean fixture, --trt-mark {mark}", lambda mark=mark: _build(trt, fixtures / "clean.onnx", mark)))
    reason = inference_unavailable_reason()
    if reason is not None:
        report.checks.append(Check("FP16 compare with the TensorRT candidate (every mark mode)", "not run", reason))
        report.checks.append(Check("the GPU-only tests (tests/test_trt.py)", "not run", reason))
        return report
    for mark in MARK_MODES:
        report.checks.append(_check(f"FP16 compare, --trt-mark {mark}", lambda mark=mark: _compare(fixtures, mark)))
    report.checks.append(_check("the TensorRT tests (tests/test_trt.py)", _tests))
    return report


def _facts() -> dict[str, str]:
    from accudiff.version import __version__
    from accudiff.runners.trt_env import MODULES, gpu_compute_capability

    facts = {"accudiff": __version__, "python": platform.python_version(), "platform": platform.platform()}
    for package in ("onnx", "onnxruntime", "polygraphy", "cuda-python", "cuda-bindings", *(m.replace("_", "-") for m in MODULES)):
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            facts[package] = "not installed"
    try:
        major, minor = gpu_compute_capability()
        facts["GPU"] = f"compute capability {major}.{minor}"
    except AccudiffError as exc:
        facts["GPU"] = str(exc)
    return facts


def _check(name: str, run) -> Check:
    try:
        detail = run()
    except Exception as exc:  # every failure, ours or a library's, is reported and the next check runs
        return Check(name, "FAILED", f"{type(exc).__name__}: {first_line(exc)}")
    return Check(name, "ok", detail or "")


def _build(trt, model: Path, mark: str) -> str:
    from accudiff.model.loading import load_model
    from accudiff.runners.trt_build import BuildSettings, build_engine

    info = load_model(model)
    with tempfile.TemporaryDirectory(prefix="accudiff-doctor-") as cache:
        built = build_engine(trt, model, [t.name for t in info.tensors], BuildSettings(mark=mark), Path(cache))
    return f"{len(built.plan) / 1e3:.0f} kB engine, {len(built.outputs)} network output(s), {trt.__name__} {trt.__version__}"


def _compare(fixtures: Path, mark: str) -> str:
    from accudiff.api import compare
    from accudiff.runners import TrtOptions

    options = {"candidate": "trt", "trt": TrtOptions(mark=mark)}
    clean = compare(fixtures / "clean.onnx", "fp16", **options)
    if not clean.passed:
        raise AssertionError(f"the clean fixture fails: {clean.output_failures[0].tensor}")
    broken = compare(fixtures / "layernorm_overflow.onnx", "fp16", **options)
    cause = broken.output_failures[0].cause if broken.output_failures else None
    if cause is None or cause.node != "ln_square":
        raise AssertionError(f"the LayerNorm overflow is not named (cause: {cause})")
    return f"clean passes; overflow caused by Pow 'ln_square' ({clean.candidate})"


def _tests() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(CHECKOUT / "tests" / "test_trt.py")],
        capture_output=True, text=True, cwd=CHECKOUT,
    )
    summary = next((line for line in reversed(done.stdout.splitlines()) if " in " in line and ("passed" in line or "failed" in line)), "no summary")
    if done.returncode != 0:
        raise AssertionError(summary.strip("= "))
    return summary.strip("= ")
