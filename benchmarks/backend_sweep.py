"""Robustness sweep: `accudiff compare` in FP32 (self-compare), FP16 and INT8 on the test models the onnx
wheel ships, tabulated by outcome.

    python benchmarks/backend_sweep.py [--suites simple pytorch-converted pytorch-operator light node onnxruntime-datasets]
                                       [--limit N] [--jobs 2] [--timeout 300] [--out benchmarks/out]

Models: `onnx/backend/test/data/<suite>/` of the installed onnx (with their input protobufs; the `light`
models get seeded inputs), the node tests generated from `onnx.backend.test.case.node` (`node`), and the
models in the onnxruntime wheel's `datasets` folder (`onnxruntime-datasets`, seeded inputs).
Each case runs in its own process (a hang is more CPU time than --timeout, or ten times that in wall time; a crash is a crash), which first runs the original
model in ONNX Runtime twice (does it load, run, and run deterministically?), then `accudiff compare`
(candidate onnxrt) for each precision, in-process through the command line's `main`.

Outcomes: `pass` (exit 0), `fail` (exit 1), `inconclusive` (exit 1: most of the model sits in Loop/Scan
bodies and could not be observed), `refused` (exit 2: one sentence), and the defects the sweep
exists to find: `traceback` (also accudiff's "internal error"), `crash`, `hang`, `noisy` (a foreign log line or more than one line on
stderr), `fp32_fail` (the FP32 self-compare fails although ONNX Runtime runs the original
deterministically), `candidate_refused` (exit 2 about the candidate accudiff built, where ONNX Runtime
runs the original). `--before PATH` runs the same cases with the accudiff found at PATH (an older
checkout) for a before/after table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PRECISIONS = ("fp32", "fp16", "int8")  # FP32 is compare's default: no flag
SUITES = ("simple", "pytorch-converted", "pytorch-operator", "light", "node", "onnxruntime-datasets")
DEFECTS = ("traceback", "crash", "hang", "noisy", "fp32_fail", "candidate_refused")
# Messages about the candidate accudiff built (not about the user's model or inputs).
CANDIDATE_WORDS = ("candidate", "quantiz", "fp16", "FP16", "int8", "INT8")
# ... except a refusal of the request itself: a precision that would leave the model unchanged.
VACUOUS_REQUEST = "would compare it with itself"


def collect(suites, limit: int | None, scratch: Path, names: set[str] | None = None) -> list[dict]:
    """Every case (or those named `names`): {"suite", "name", "model", "inputs" (an .npz, or None: seeded inputs)}."""
    import onnx

    data = Path(onnx.__file__).parent / "backend" / "test" / "data"
    cases = []
    for suite in suites:
        found = []
        wanted = lambda name: names is None or name in names  # noqa: E731
        if suite == "node":
            found = _node_cases(scratch / "node", wanted)
        elif suite == "onnxruntime-datasets":  # the models the onnxruntime wheel ships (logreg_iris: the ai.onnx.ml domain)
            import onnxruntime

            folder = Path(onnxruntime.__file__).parent / "datasets"
            found = [{"name": p.stem, "model": str(p), "inputs": None} for p in sorted(folder.glob("*.onnx")) if wanted(p.stem)]
        elif suite == "light":
            found = [{"name": p.stem, "model": str(p), "inputs": None} for p in sorted((data / "light").glob("*.onnx")) if wanted(p.stem)]
        else:
            for folder in sorted((data / suite).iterdir()):
                if (folder / "model.onnx").is_file() and wanted(folder.name):
                    found.append({"name": folder.name, "model": str(folder / "model.onnx"), "inputs": _pb_inputs(folder, scratch / suite)})
        cases += [{"suite": suite, **case} for case in found[:limit]]
    return cases


def _pb_inputs(folder: Path, scratch: Path) -> str | None:
    """The first data set's input protobufs as an .npz keyed by the model's input names."""
    import onnx
    from onnx import numpy_helper

    data_set = folder / "test_data_set_0"
    files = sorted(data_set.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1])) if data_set.is_dir() else []
    if not files:
        return None
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in weights]
    arrays = {}
    for name, file in zip(names, files):
        tensor = onnx.TensorProto()
        try:
            tensor.ParseFromString(file.read_bytes())
            arrays[name] = numpy_helper.to_array(tensor)
        except Exception:  # a sequence or optional input: accudiff takes tensors only, let it say so
            return None
    target = scratch / f"{folder.name}.npz"
    target.parent.mkdir(parents=True, exist_ok=True)
    np.savez(target, **arrays)
    return str(target)


def _node_cases(scratch: Path, wanted) -> list[dict]:
    """onnx's node tests, written out as models with their first data set."""
    import onnx
    from onnx.backend.test.case import node

    cases = []
    with warnings.catch_warnings():  # onnx's case generators compute their expected values noisily
        warnings.simplefilter("ignore")
        generated = node.collect_testcases(None)
    for case in generated:
        if case.model is None or not case.data_sets or not wanted(case.name):
            continue
        folder = scratch / case.name
        folder.mkdir(parents=True, exist_ok=True)
        model_path = folder / "model.onnx"
        onnx.save(case.model, str(model_path))
        weights = {i.name for i in case.model.graph.initializer}
        names = [i.name for i in case.model.graph.input if i.name not in weights]
        inputs, _ = case.data_sets[0]
        arrays = {name: value for name, value in zip(names, inputs) if isinstance(value, np.ndarray)}
        path = None
        if len(arrays) == len(names):
            path = folder / "inputs.npz"
            np.savez(path, **arrays)
        cases.append({"name": case.name, "model": str(model_path), "inputs": str(path) if path else None})
    return cases


def run_case(case: dict, workdir: Path) -> dict:
    """One case, in this process: ONNX Runtime on the original, then compare at every precision."""
    record = {**case, "ort": _original_in_onnxruntime(case), "runs": {}}
    for precision in PRECISIONS:
        args = ["compare", case["model"], *([f"--{precision}"] if precision != "fp32" else []), "--candidate", "onnxrt", "--report-dir", str(workdir / precision)]
        if case["inputs"]:
            args += ["--load-inputs", case["inputs"]]
        record["runs"][precision] = _main(args)
    return record


def _main(args: list[str]) -> dict:
    """accudiff's command line in-process, stdout and stderr captured at the file descriptors (so a foreign
    library's own writes are seen too)."""
    import traceback

    from accudiff.cli import main

    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out_file.fileno(), 1), os.dup2(err_file.fileno(), 2)
        code, trace = None, None
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException as exc:  # the defect this sweep looks for
            trace = "".join(traceback.format_exception(exc))[-2000:]
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out_file.seek(0), err_file.seek(0)
        return {"exit": code, "stdout": out_file.read()[-3000:], "stderr": err_file.read()[-2000:], "traceback": trace}


def _original_in_onnxruntime(case: dict) -> str:
    """"ok", "nondeterministic", or why ONNX Runtime cannot run the original with these inputs."""
    import onnxruntime as ort

    from accudiff.model.inputs import generate_feeds, resolve_shapes
    from accudiff.model.loading import load_model

    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(case["model"], options, providers=["CPUExecutionProvider"])
        if case["inputs"]:
            with np.load(case["inputs"]) as archive:
                feed = {name: archive[name] for name in archive.files}
        else:
            info = load_model(case["model"])
            feed = generate_feeds(info.inputs, resolve_shapes(info.inputs, {}))[0]
        first, second = session.run(None, feed), session.run(None, feed)
    except Exception as exc:
        return f"not run: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__}"
    same = all(np.array_equal(a, b, equal_nan=True) if isinstance(a, np.ndarray) else True for a, b in zip(first, second))
    return "ok" if same else "nondeterministic"


def classify(record: dict, precision: str) -> str:
    run = record["runs"].get(precision)
    if run is None:
        return record.get("failure", "crash")
    if run["traceback"] or "internal error" in run["stderr"]:
        return "traceback"
    foreign = any(mark in run["stderr"] for mark in ("[W:onnxruntime", "[E:onnxruntime", "\x1b["))
    if foreign or len([line for line in run["stderr"].splitlines() if line.strip()]) > 1:
        return "noisy"
    if run["exit"] == 0:
        return "pass"
    if run["exit"] == 1:
        if "verdict: INCONCLUSIVE" in run["stdout"]:
            return "inconclusive"
        return "fp32_fail" if precision == "fp32" and record["ort"] == "ok" else "fail"
    about_candidate = any(word in run["stderr"] for word in CANDIDATE_WORDS) and "not supported" not in run["stderr"] and VACUOUS_REQUEST not in run["stderr"]
    if record["ort"] == "ok" and about_candidate:
        return "candidate_refused"
    return "refused"


def _child(case_json: str, workdir: str) -> None:
    print("\n@@RESULT@@" + json.dumps(run_case(json.loads(case_json), Path(workdir)), default=str), flush=True)


def sweep(cases: list[dict], jobs: int, timeout: float, accudiff_path: str | None, wall_per_cpu_second: float = 10) -> list[dict]:
    """Every case in its own process, `jobs` at a time. A hang is the case's process using more than
    `timeout` seconds of CPU, which the machine's load does not change (the kernel stops it: RLIMIT_CPU;
    a worker it starts has the same limit, and its end is then the case's crash), or a case not done after
    `wall_per_cpu_second` times that in wall time (a process waiting on nothing)."""
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in [accudiff_path or "", str(root), env.get("PYTHONPATH", "")] if p)

    def limit_cpu() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(timeout), math.ceil(timeout) + 5))

    def one(case: dict) -> dict:
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="accudiff-sweep-") as workdir:  # removed here: a stopped case cannot
                done = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(case), "--workdir", workdir],
                    capture_output=True, text=True, timeout=timeout * wall_per_cpu_second, env=env, preexec_fn=limit_cpu,
                )
        except subprocess.TimeoutExpired:
            return {**case, "ort": "?", "runs": {}, "failure": "hang", "seconds": time.perf_counter() - start}
        if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return {**case, "ort": "?", "runs": {}, "failure": "hang", "seconds": time.perf_counter() - start}
        marker = done.stdout.rfind("@@RESULT@@")
        if marker < 0:
            return {**case, "ort": "?", "runs": {}, "failure": "crash", "seconds": time.perf_counter() - start, "stderr": done.stderr[-1500:]}
        return {**json.loads(done.stdout[marker + len("@@RESULT@@"):]), "seconds": time.perf_counter() - start}

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, cases))


def table(records: list[dict]) -> dict[str, Counter]:
    return {p: Counter(classify(r, p) for r in records) for p in PRECISIONS}


def report(records: list[dict], label: str) -> str:
    counts = table(records)
    outcomes = ["pass", "fail", "inconclusive", "refused", *DEFECTS]
    lines = [f"{label}: {len(records)} models", f"{'':10}" + "".join(f"{o:>13}" for o in outcomes)]
    for precision, counter in counts.items():
        lines.append(f"{precision:10}" + "".join(f"{counter.get(o, 0):>13}" for o in outcomes))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument("--limit", type=int, help="at most this many models per suite")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="CPU seconds per model (all three precisions), whatever the machine's load; ten times that in wall time")
    parser.add_argument("--before", help="path of an older accudiff checkout, run on the same cases first")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.workdir)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    cases = collect(args.suites, args.limit, args.out / "sweep_cases")
    document = {"cases": len(cases)}
    for label, path in ([("before", args.before)] if args.before else []) + [("after", None)]:
        start = time.perf_counter()
        records = sweep(cases, args.jobs, args.timeout, path)
        document[label] = {"seconds": time.perf_counter() - start, "counts": {k: dict(v) for k, v in table(records).items()}, "records": records}
        print(report(records, label), flush=True)
    for record in document["after"]["records"]:
        for precision in PRECISIONS:
            outcome = classify(record, precision)
            if outcome in DEFECTS:
                run = record["runs"].get(precision, {})
                detail = (run.get("traceback") or run.get("stderr") or record.get("stderr") or record.get("failure", "")).strip().splitlines()
                print(f"  {outcome:18} {record['suite']}/{record['name']} {precision}: {detail[-1] if detail else ''}"[:300])
    (args.out / "backend_sweep.json").write_text(json.dumps(document, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
