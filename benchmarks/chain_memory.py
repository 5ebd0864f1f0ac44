"""Bounded memory on models whose tensors do not fit: a chain of elementwise ops on one [1, N] tensor.

    python benchmarks/chain_memory.py [--sizes 2 6 30] [--polygraphy-up-to 2] [--max-memory SIZE] [--out benchmarks/out]

For each size (GB of marked tensors: 100 MB tensors, 10 per GB), `accudiff compare --fp16 --candidate
onnxrt` runs as a fresh process, with the isolated run (the default) and without (`--no-isolate`); wall
time and the peak resident memory of the whole process tree are measured (benchmarks/measure.py).

The floor is what the comparison cannot avoid, measured on this machine in this run:
* the plain, unmarked ONNX Runtime runs it needs: the reference, the candidate (the FP16 model lowered for
  emulation), and for the isolated run the isolated model (every node fed the reference's values), which
  cannot be run whole without holding every tensor: it is timed on a 1 GB chain and scaled by size;
* one statistics pass: a chunked numpy `max|a - b|` over every pair of tensors compared (100 MB
  reference and 50 MB FP16 candidate each), the least any comparison reads, on every core (as
  accudiff's own pass runs).
polygraphy's flow (`run --onnx-outputs mark all --save-outputs`, `convert --fp-to-fp16`, `run
--load-outputs`) runs beside it up to --polygraphy-up-to GB, where it still fits. Results print as a
table and go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import models  # noqa: E402
from benchmarks.measure import accudiff_command, measure, polygraphy_command  # noqa: E402

ELEMENTS = 25_000_000  # 100 MB of float32 per tensor
PER_GB = 10


def accudiff_run(model: Path, work: Path, *extra: str) -> dict:
    report = work / f"report{'-'.join(extra)}"
    result = measure(accudiff_command("compare", str(model), "--fp16", "--candidate", "onnxrt", "--report-dir", str(report), *extra))
    summary = json.loads((report / "summary.json").read_text()) if (report / "summary.json").exists() else {}
    result["phases"] = summary.get("timings_s")
    return result


def polygraphy_run(model: Path, work: Path) -> dict:
    polygraphy = polygraphy_command()
    steps = [
        polygraphy + ["run", str(model), "--onnxrt", "--onnx-outputs", "mark", "all", "--save-outputs", str(work / "ref.json")],
        polygraphy + ["convert", str(model), "--fp-to-fp16", "-o", str(work / "model16.onnx")],
        polygraphy + ["run", str(work / "model16.onnx"), "--onnxrt", "--onnx-outputs", "mark", "all", "--load-outputs", str(work / "ref.json")],
    ]
    results = [measure(step) for step in steps]
    return {"seconds": sum(r["seconds"] for r in results), "peak_mb": max(r["peak_mb"] for r in results), "exits": [r["exit"] for r in results]}


def floor(model: Path, small: Path, length: int, small_length: int) -> dict:
    """Seconds of the unmarked runs and of one plain statistics pass (see the module docstring)."""
    import onnx
    import onnxruntime as ort

    from accudiff.model.loading import load_model
    from accudiff.runners.fp16_emulation import lower_fp16
    from accudiff.transforms import to_fp16
    from accudiff.transforms.isolate import isolate_in_place

    def session(proto):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def timed(sess, feed) -> float:
        sess.run(None, feed)  # warm
        start = time.perf_counter()
        sess.run(None, feed)
        return time.perf_counter() - start

    x = {"x": np.random.default_rng(0).uniform(0, 1, (1, ELEMENTS)).astype(np.float32)}
    info = load_model(model)
    candidate = to_fp16(info.proto)
    lower_fp16(candidate.model)
    reference_s, candidate_s = timed(session(onnx.load(str(model))), x), timed(session(candidate.model), x)
    del candidate
    small_info = load_model(small)
    isolated = to_fp16(small_info.proto)
    fed = isolate_in_place(isolated.model, {t.name: onnx.TensorProto.FLOAT for t in small_info.tensors}, isolated.storage_copies)
    lower_fp16(isolated.model)
    feed = {**x, **{name: x["x"] for name in fed}}
    isolated_s = timed(session(isolated.model), feed) * length / small_length
    a, b = x["x"][0], x["x"][0].astype(np.float16)

    def max_abs_difference(part: slice) -> float:
        buffer, largest = np.empty(1 << 16, np.float32), 0.0
        for lo in range(part.start, part.stop, buffer.size):
            chunk = buffer[: min(buffer.size, part.stop - lo)]
            np.subtract(a[lo : lo + chunk.size], b[lo : lo + chunk.size], out=chunk)
            largest = max(largest, float(np.abs(chunk, out=chunk).max()))
        return largest

    cores = os.cpu_count() or 1
    step = -(-a.size // cores)
    with ThreadPoolExecutor(cores) as pool:  # numpy's ufuncs release the GIL: the pass runs on every core
        start = time.perf_counter()
        max(pool.map(max_abs_difference, [slice(lo, min(lo + step, a.size)) for lo in range(0, a.size, step)]))
        pair_s = time.perf_counter() - start
    return {
        "reference_run": reference_s,
        "candidate_run": candidate_s,
        "isolated_run": isolated_s,
        "stats_pass_per_pair": pair_s,
        "stats_pass_gb_per_s": (a.nbytes + b.nbytes) / pair_s / 1e9,
        "floor_no_isolate": reference_s + candidate_s + length * pair_s,
        "floor": reference_s + candidate_s + isolated_s + 2 * length * pair_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[2, 6, 30], help="GB of marked tensors")
    parser.add_argument("--polygraphy-up-to", type=int, default=2, help="run polygraphy's flow up to this size (GB)")
    parser.add_argument("--max-memory", help="accudiff's --max-memory (default: accudiff's own default)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    budget = ["--max-memory", args.max_memory] if args.max_memory else []
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="accudiff-chain-") as tmp:
        folder = Path(tmp)
        small = models.elementwise_chain(folder, PER_GB, ELEMENTS)
        for size in args.sizes:
            length = size * PER_GB
            model = models.elementwise_chain(folder, length, ELEMENTS)
            work = folder / f"{size}gb"
            work.mkdir()
            row = {"floor": floor(model, small, length, PER_GB), "accudiff": accudiff_run(model, work, *budget),
                   "accudiff_no_isolate": accudiff_run(model, work, "--no-isolate", *budget)}
            if size <= args.polygraphy_up_to:
                (work / "pg").mkdir()
                row["polygraphy"] = polygraphy_run(model, work / "pg")
            rows[f"{size}GB"] = row
            fl, ad, an = row["floor"], row["accudiff"], row["accudiff_no_isolate"]
            line = (
                f"{size:>3} GB: accudiff {ad['seconds']:6.1f} s {ad['peak_mb']:6.0f} MB ({ad['seconds'] / fl['floor']:.2f}x floor {fl['floor']:.1f} s) | "
                f"--no-isolate {an['seconds']:6.1f} s {an['peak_mb']:6.0f} MB ({an['seconds'] / fl['floor_no_isolate']:.2f}x floor {fl['floor_no_isolate']:.1f} s)"
            )
            if "polygraphy" in row:
                pg = row["polygraphy"]
                line += f" | polygraphy {pg['seconds']:6.1f} s {pg['peak_mb']:6.0f} MB (exits {pg['exits']})"
            print(line, flush=True)
            model.unlink()
    (args.out / "chain_memory.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
