"""Mutation fuzzing of every file accudiff reads: seeded byte flips, truncation and spliced junk in a
model, a model's external-data file, an .npz of inputs, a polygraphy JSON of inputs, INT8 calibration data, a pytest-plugin
baseline, a decoder's prompts and its GenAI folder's genai_config.json, each fed to the command that reads it; and random, often adversarial command lines. Every case must end with exit 0 or 1, or exit 2 with one
sentence on stderr (never "internal error", never a traceback), and leave no half-written report.

    python benchmarks/fuzz.py --cases 2000            # counts per format and outcome; defects listed
    python benchmarks/fuzz.py --cases 200 --formats npz json

The test suite runs a small seeded share of the same cases (tests/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
SEED_MODELS = ("layernorm_overflow", "if_model", "int8_outlier_channel")
FAST = ["--candidate", "onnxrt", "--no-verify"]  # what is fuzzed is the reading, not the diagnosis


@dataclass(frozen=True)
class Outcome:
    format: str
    case: int
    code: int
    message: str  # the last line on stderr
    defect: str | None  # None: the case ended as promised


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One seeded mutation: flipped bytes, a truncation, junk spliced in, or a span repeated."""
    data = bytearray(data)
    kind = rng.choice(("flip", "flip", "truncate", "splice", "repeat"))
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[rng.randrange(1, len(data)) :]
    elif kind == "splice":
        at = rng.randrange(len(data))
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        start = rng.randrange(len(data))
        data[start:start] = data[start : start + rng.randint(1, 256)]
    return bytes(data)


def mutate_npz_member(data: bytes, rng: random.Random) -> bytes:
    """A whole zip whose one .npy member is mutated (its header or its values): what reaches numpy's
    parser and the input checks, past the zip layer's CRCs."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    victim = rng.choice(sorted(members))
    members[victim] = mutate(members[victim], rng)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def _seed_files(work: Path) -> dict[str, tuple[Path, Path]]:
    """For each format: a valid file of it, and the model it goes with."""
    from accudiff.model.inputs import save_feeds
    from accudiff.model.loading import load_model

    model = FIXTURES / "int8_outlier_channel.onnx"
    info = load_model(model)
    rng = np.random.default_rng(0)
    feeds = [{spec.name: rng.standard_normal(spec.shape).astype(spec.dtype) for spec in info.inputs} for _ in range(2)]
    save_feeds(feeds, work / "inputs.npz")
    save_feeds([{"x": rng.standard_normal((1, 8, 64)).astype(np.float32)} for _ in range(2)], work / "layernorm-inputs.npz")
    _write_polygraphy_json(feeds, work / "inputs.json")
    figures = {"sqnr_db": 61.5, "max_abs_err": 0.00123, "cosine": 0.99999, "outside_share": 0.0}
    baseline = {"schema_version": 1, "model": "m.onnx", "precision": "fp16", "tensors": {name: figures for name in ("logits", "y")}}
    (work / "baseline.json").write_text(json.dumps(baseline, indent=2, sort_keys=True))
    from accudiff.model.run_results import write_run_results

    write_run_results(work / "candidate.json", "trt-runner-N0", [{"squared": np.full((1, 8, 64), 2.0, np.float32), "y": np.ones((1, 8, 16), np.float32)}] * 2)
    decoder = work / "decoder"
    shutil.copytree(FIXTURES / "tiny_decoder", decoder)
    (work / "prompts.jsonl").write_text('"def main(argv=None):"\n{"prompt": "return x", "continuation": [40, 41]}\n[100, 101, 102]\n')
    external = work / "external"
    external.mkdir()
    proto = onnx.load(str(FIXTURES / "layernorm_overflow.onnx"))
    onnx.save_model(proto, str(external / "model.onnx"), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return {
        "external": (external / "model.onnx.data", external / "model.onnx"),
        **{f"onnx:{name}": (FIXTURES / f"{name}.onnx", FIXTURES / f"{name}.onnx") for name in SEED_MODELS},
        "npz": (work / "inputs.npz", model),
        "npz-member": (work / "inputs.npz", model),
        "npz-folder": (work / "inputs.npz", model),
        "json": (work / "inputs.json", model),
        "calibration": (work / "inputs.npz", model),
        "baseline": (work / "baseline.json", model),
        "run-results": (work / "candidate.json", FIXTURES / "layernorm_overflow.onnx"),
        "prompts": (work / "prompts.jsonl", decoder),
        "genai-config": (decoder / "genai_config.json", decoder),
    }


def _write_polygraphy_json(feeds, path: Path) -> None:
    """Inputs as polygraphy's --save-inputs writes them: a list of feeds, each array a base64 .npy."""

    def encoded(value: np.ndarray) -> dict:
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return {"array": base64.b64encode(buffer.getvalue()).decode(), "polygraphy_class": "ndarray"}

    path.write_text(json.dumps([{name: encoded(value) for name, value in feed.items()} for feed in feeds]))


def _command(fmt: str, mutated: Path, model: Path, out: Path) -> list[str]:
    if fmt == "onnx":
        return ["compare", str(mutated), "--fp16", *FAST, "-o", str(out)]
    if fmt == "external":  # the damaged data file sits beside a copy of its model
        shutil.copy(model, mutated.parent / model.name)
        return ["compare", str(mutated.parent / model.name), "--fp16", *FAST, "-o", str(out)]
    if fmt == "npz-folder":  # the damaged file sits among intact ones in a folder of samples
        return ["compare", str(model), "--fp16", *FAST, "--load-inputs", str(mutated.parent), "-o", str(out)]
    if fmt == "run-results":  # a candidate captured elsewhere, on the inputs it was made from
        inputs = mutated.parent.parent / "layernorm-inputs.npz"
        return ["compare", str(model), "--fp16", "--no-verify", "--load-inputs", str(inputs), "--load-candidate", str(mutated), "-o", str(out)]
    if fmt == "prompts":  # a decoder's prompts, generated from as deployed
        return ["compare", str(model), "--fp16", *FAST, "--prompts", str(mutated), "--new-tokens", "2", "-o", str(out)]
    if fmt == "genai-config":  # the damaged config sits in a copy of its folder
        folder = mutated.parent / "folder"
        shutil.copytree(model, folder)
        shutil.copy(mutated, folder / "genai_config.json")
        return ["compare", str(folder), "--fp16", *FAST, "--prompts", str(model / "prompts.txt"), "--new-tokens", "2", "-o", str(out)]
    if fmt in ("npz", "npz-member", "json"):
        return ["compare", str(model), "--fp16", *FAST, "--load-inputs", str(mutated), "-o", str(out)]
    return ["compare", str(model), "--int8", *FAST, "--calib-data", str(mutated), "-o", str(out)]


# Each option with values that get past argparse (so that accudiff's own checks are reached), often
# adversarial ones; --ray is left out: a valid address would start or join a cluster.
OPTIONS = {
    "--fp16": (), "--int8": (), "--no-autokeep": (), "--no-isolate": (), "--no-verify": (),
    "--candidate": ("auto", "onnxrt", "trt"),
    "--input-shapes": ("x:1x3x16x16", "x:99999x99999", "x:0", "x:-1", "x:", ":", "y:1", "x:1x3x16x16x1"),
    "--seed": ("0", "-1", "99999999999999999999"),
    "--val-range": ("0,1", "1,0", "x:-5,5", "1e30,1e31", "nan,1", "0,1e39", "y:0,1", "0,0"),
    "--iterations": ("0", "1", "3", "-1", "99999999999"),
    "--load-inputs": ("/dev/null", "/tmp", "/nonexistent/file.npz", "inputs.npz", "."),
    "--calib-data": ("/dev/null", "/tmp", "/nonexistent/file.npz", "."),
    "--keep-fp32": ("Relu", ".*", "[", "nothing_like_it", "MatMul", ""),
    "--atol": ("1e-3", "0", "-1", "nan", "inf", "y:0.5", "nope:0.1", "x", "1e999"),
    "--rtol": ("1e-2", "0", "-1", "nan", "logits:0.1"),
    "--stol": ("2e-3", "0", "-1", "nan", "1e999"),
    "--workers": ("0", "1", "2", "-3", "99999999999"),
    "--max-memory": ("512M", "4G", "1T", "0", "-5M", "16M", "x", "1e999"),
    "--trt-module": ("tensorrt", "tensorrt_rtx"),
    "--trt-mark": ("all", "outputs", "unfused", "auto"),
    "--trt-legacy-precision": ("fp16", "int8"),
    "--trt-workspace": ("0", "-1", "99999999999999"),
    "--engine": ("/dev/null", "/tmp", "/nonexistent/model.plan"),
    "--verify-budget": ("0", "1", "-1", "99999999999"),
    "--also": ("onnxrt", "trt"),
    "--nope": (),
    "-o": (),
}
ANY_VALUE = ("", " ", "1e999", "nan", "-inf", "0x10", "é", "\\x00", "-", "--", "/dev/zero")


def _arguments(rng: random.Random, work: Path) -> list[str]:
    """A random, often adversarial, command line: a command, perhaps a model, options with random values."""
    model = str(FIXTURES / rng.choice(("clean.onnx", "layernorm_overflow.onnx", "if_model.onnx")))
    commands = (["compare"],) * 6 + (["bisect", "subgraph"], ["bisect", "precision"], ["partition"], ["bisect"], [])
    command = rng.choice(commands)
    args = [*command, *([model] if rng.random() < 0.9 else [rng.choice(("/tmp", "/dev/null", "/dev/zero", "missing.onnx", ""))])]
    for _ in range(rng.randint(0, 5)):
        option = rng.choice(sorted(OPTIONS))
        args.append(option)
        if option == "-o":
            args.append(str(work / f"out{rng.randrange(4)}"))
        elif OPTIONS[option] or rng.random() < 0.1:
            args.append(rng.choice(ANY_VALUE) if rng.random() < 0.15 or not OPTIONS[option] else rng.choice(OPTIONS[option]))
    if rng.random() < 0.05:
        rng.shuffle(args)
    return args


def _run_arguments(case: int, folder: Path) -> tuple[int, str]:
    """Run one random command line in this process, with a 120 s alarm (a hang is a defect too)."""
    from accudiff.cli import main

    def hang(*_):
        raise TimeoutError("no result in 120 s")

    previous, working = signal.signal(signal.SIGALRM, hang), os.getcwd()
    signal.alarm(120)
    os.chdir(folder)  # a command without -o writes reports/ here, where the leftover check looks
    try:
        return main(_arguments(random.Random(f"arguments-{case}"), folder)), ""
    finally:
        os.chdir(working)
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_case(fmt: str, case: int, seeds: dict[str, tuple[Path, Path]], work: Path) -> Outcome:
    """Mutate `fmt`'s seed file with seed `case`, run the command that reads it in this process, and judge."""
    from accudiff.cli import main

    folder = work / f"{fmt}-{case}"
    folder.mkdir()
    out = folder / "report"
    if fmt != "arguments":
        source, model = seeds[fmt if fmt != "onnx" else f"onnx:{SEED_MODELS[case % len(SEED_MODELS)]}"]
        rng = random.Random(f"{fmt}-{case}")
        mutated = folder / (source.name if fmt in ("external", "genai-config") else f"mutated{source.suffix}")
        mutated.write_bytes((mutate_npz_member if fmt == "npz-member" else mutate)(source.read_bytes(), rng))
        if fmt == "npz-folder":
            for k in range(2):
                shutil.copy(source, folder / f"intact{k}.npz")
    stderr = io.StringIO()
    around = set(Path.cwd().iterdir())
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            if fmt == "arguments":
                code, _ = _run_arguments(case, folder)
            elif fmt == "baseline":
                code = _read_baseline(mutated)
            else:
                code = main(_command(fmt, mutated, model, out))
        except BaseException as exc:  # noqa: BLE001 - anything escaping is a defect
            code = -1
            print(f"escaped: {type(exc).__name__}: {exc}", file=stderr)
    lines = [line for line in stderr.getvalue().splitlines() if line.strip() and not line.startswith("  ")]  # a bisector's steps are indented
    message = lines[-1] if lines else ""
    defect = None
    if code not in (0, 1, 2):
        defect = f"exit {code}"
    elif code == 0 and fmt == "arguments" and lines and "usage:" in lines[0]:
        pass  # --help
    elif code == 2 and (len(lines) != 1 or not message.startswith("accudiff: error: ")):
        defect = "not one sentence" if "internal error" not in message else "internal error"
    elif code == 2 and (out.exists() or any(p.name == "reports" or p.name.startswith("out") for p in folder.iterdir())):
        defect = "report left behind after an error"
    elif any(".partial" in p.name for p in folder.rglob("*")):
        defect = "half-written report left behind"
    elif {p.name for p in set(Path.cwd().iterdir()) - around} - {".pytest_cache"}:
        defect = f"left in the working folder: {sorted(p.name for p in set(Path.cwd().iterdir()) - around)}"
    shutil.rmtree(folder, ignore_errors=True)
    return Outcome(fmt, case, code, message, defect)


def _read_baseline(path: Path) -> int:
    """The pytest plugin's baseline reader, as the plugin calls it: 0 when read, 2 and one sentence when not."""
    from accudiff.errors import AccudiffError
    from accudiff.checks.baselines import read_baseline

    try:
        read_baseline(path)
    except AccudiffError as exc:
        print(f"accudiff: error: {exc}", file=sys.stderr)
        return 2
    return 0


FORMATS = ("onnx", "external", "npz", "npz-member", "npz-folder", "json", "calibration", "baseline", "run-results", "prompts", "genai-config", "arguments")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="cases per format")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--first", type=int, default=0, help="first case number (to continue a run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="accudiff-fuzz-") as scratch:
        work = Path(scratch)
        seeds = _seed_files(work)
        counts: Counter = Counter()
        defects: list[Outcome] = []
        started = time.perf_counter()
        for fmt in args.formats:
            for case in range(args.first, args.first + args.cases):
                outcome = run_case(fmt, case, seeds, work)
                counts[(fmt, "defect" if outcome.defect else f"exit {outcome.code}")] += 1
                if outcome.defect:
                    defects.append(outcome)
                    print(f"DEFECT {fmt} case {case}: {outcome.defect}: {outcome.message}", flush=True)
        elapsed = time.perf_counter() - started
    print(f"{sum(counts.values())} cases in {elapsed:.0f} s")
    for fmt in args.formats:
        row = {key[1]: n for key, n in counts.items() if key[0] == fmt}
        print(f"  {fmt:12s} " + ", ".join(f"{k}: {v}" for k, v in sorted(row.items())))
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
