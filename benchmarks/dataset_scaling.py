"""Dataset-scale comparison of the PP-OCRv4 recognizer: one worker, two, and Ray; and a 1,000-sample run.

    python benchmarks/dataset_scaling.py [--samples 16] [--large 1000] [--per-sample 8 40 [--repeat 3]] [--out benchmarks/out]

The dataset is made here: text lines drawn with PIL (benchmarks/realistic_inputs.py), one .npz file per
sample in a folder, read by accudiff one sample at a time. Each run is `accudiff compare --fp16
--candidate onnxrt --load-inputs FOLDER` as a fresh process (wall time, peak memory of the process tree).
The Ray per-task overhead is measured on a one-CPU local cluster: the same samples as one task and as
eight, the difference spread over the seven extra tasks.

`--per-sample N1 N2`: what each extra sample costs with `--workers 2` (the wall time of N2 samples less
that of N1, over N2 - N1: the fixed costs cancel out), with and without the isolated run, both with
`--no-verify`: verification tries keep-lists on at most 8 failing samples whatever the dataset's size,
and how many it tries depends on which samples fail, which differs between N1 and N2 samples (on the
recognizer's drawn lines, 8 samples took two more rounds than 40, which made each extra sample look
0.015-0.02 s cheaper than it is). Beside it, its floor timed in this process: one marked FP32 run, one
marked run of the lowered FP16 candidate and a numpy max|a - b| over every tensor pair, sessions created
once, halved for two workers. Each is measured --repeat times, in turn; the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import models, realistic_inputs  # noqa: E402
from benchmarks.measure import accudiff_command, measure  # noqa: E402


def make_dataset(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for seed in range(count):
        np.savez(folder / f"line{seed:05d}.npz", **realistic_inputs.ppocr_rec(seed))
    return folder


def compare(model: Path, data: Path, report: Path, *extra: str) -> dict:
    command = accudiff_command("compare", str(model), "--fp16", "--candidate", "onnxrt", "--load-inputs", str(data), "--report-dir", str(report), *extra)
    result = measure(command)
    summary = json.loads((report / "summary.json").read_text()) if (report / "summary.json").exists() else {}
    result["phases"] = summary.get("timings_s")
    result["failing"] = {k: v["failing"] for k, v in summary.get("samples", {}).get("per_output", {}).items()}
    return result


def ray_task_overhead(model: Path, data: Path, tasks: int = 8) -> float:
    """Seconds each extra Ray task costs: the same samples as 1 task and as `tasks` tasks on a one-CPU
    local cluster (so tasks run one after another), the difference spread over the extra tasks."""
    import ray

    import accudiff

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=40)
    try:
        accudiff.compare(model, "fp16", candidate="onnxrt", inputs=data, ray="local", workers=1)  # warm the cluster
        seconds = {}
        for count in (1, tasks):
            start = time.perf_counter()
            accudiff.compare(model, "fp16", candidate="onnxrt", inputs=data, ray="local", workers=count)
            seconds[count] = time.perf_counter() - start
    finally:
        ray.shutdown()
    return (seconds[tasks] - seconds[1]) / (tasks - 1)


def per_sample_floor(model: Path, data: Path, samples: int = 4) -> float:
    """Seconds per sample of the least a two-worker comparison does (see the module's docstring)."""
    import onnx
    import onnxruntime as ort

    from accudiff.model.loading import load_model
    from accudiff.runners.fp16_emulation import lower_fp16
    from accudiff.transforms import to_fp16

    info = load_model(model)
    names = [t.name for t in info.tensors]
    candidate = to_fp16(info.proto).model
    copies = lower_fp16(candidate)
    sessions = []
    for proto, marked in ((info.proto, names), (candidate, [copies.get(n, n) for n in names])):
        del proto.graph.output[:]
        proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in marked)
        sessions.append(ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]))
    feeds = [dict(np.load(path)) for path in sorted(data.glob("*.npz"))[:samples]]
    for session in sessions:
        session.run(None, feeds[0])  # warm-up
    start = time.perf_counter()
    for feed in feeds:
        reference, candidate_values = (session.run(None, feed) for session in sessions)
        for a, b in zip(reference, candidate_values):
            if np.issubdtype(a.dtype, np.floating) and a.size:
                float(np.abs(a - b.astype(np.float32)).max())
    return (time.perf_counter() - start) / len(feeds) / 2


def per_sample(model: Path, folder: Path, counts: tuple[int, int], repeat: int) -> dict:
    """Each extra sample's wall time with --workers 2 (--no-verify), with and without the isolated run, and
    its floor, measured `repeat` times (floor and runs in turn, so that a noisy spell of this shared
    machine hits all of them); the medians, and every measurement."""
    small, large = (make_dataset(folder / f"per-sample-{n}", n) for n in counts)
    rows = []
    for k in range(repeat):
        row = {"floor_s": per_sample_floor(model, large)}
        for label, extra in (("isolated", []), ("no_isolate", ["--no-isolate"])):
            seconds = [compare(model, data, folder / f"report-{label}-{n}-{k}", "--workers", "2", "--no-verify", *extra)["seconds"] for data, n in ((small, counts[0]), (large, counts[1]))]
            row[label] = (seconds[1] - seconds[0]) / (counts[1] - counts[0])
        _print_per_sample(f"run {k + 1} of {repeat}", row)
        rows.append(row)
    median = {key: float(np.median([r[key] for r in rows])) for key in rows[0]}
    _print_per_sample("median", median)
    return {**median, "runs": rows}


def _print_per_sample(label: str, row: dict) -> None:
    print(f"{label}: each extra sample, 2 workers: {row['isolated']:.3f} s ({row['isolated'] / row['floor_s']:.2f}x its floor {row['floor_s']:.3f} s); "
          f"--no-isolate {row['no_isolate']:.3f} s ({row['no_isolate'] / row['floor_s']:.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--large", type=int, default=1000, help="samples of the large run (0: skip it)")
    parser.add_argument("--per-sample", type=int, nargs=2, metavar=("N1", "N2"), help="only the cost of each extra sample, between N1 and N2 samples")
    parser.add_argument("--repeat", type=int, default=3, help="with --per-sample: measurements, of which the medians are reported")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = models.ppocr_rec_v4()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="accudiff-dataset-") as tmp:
        folder = Path(tmp)
        if args.per_sample:
            rows["per_sample"] = per_sample(model, folder, tuple(args.per_sample), args.repeat)
            (args.out / "dataset_per_sample.json").write_text(json.dumps(rows, indent=2) + "\n")
            return
        data = make_dataset(folder / "small", args.samples)
        for label, extra in (("1 worker", []), ("2 workers", ["--workers", "2"]), ("ray local", ["--ray", "local"])):
            rows[label] = compare(model, data, folder / f"report-{len(rows)}", *extra)
            r = rows[label]
            print(f"{args.samples} samples, {label:9}: {r['seconds']:6.1f} s, {r['peak_mb']:6.0f} MB, exit {r['exit']}, failing {r['failing']}", flush=True)
        print(f"two workers / one: {rows['2 workers']['seconds'] / rows['1 worker']['seconds']:.2f}x wall time")
        rows["ray_task_overhead_s"] = ray_task_overhead(model, data)
        print(f"Ray per-task overhead: {rows['ray_task_overhead_s']:.2f} s")
        if args.large:
            large = make_dataset(folder / "large", args.large)
            rows["large"] = compare(model, large, folder / "report-large", "--workers", "2")
            r = rows["large"]
            print(f"{args.large} samples, 2 workers: {r['seconds']:6.1f} s, {r['peak_mb']:6.0f} MB, exit {r['exit']}, failing {r['failing']}")
    (args.out / "dataset_scaling.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
