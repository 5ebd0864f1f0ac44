"""What each extra sample of a dataset costs with 1, 2, ... workers: the PP-OCRv4 recognizer on drawn text lines.

    python benchmarks/dataset_scaling.py [--counts 8 40] [--workers 1 2 all] [--repeat 3] [--large 0] [--ray-overhead] [--out benchmarks/out]

The datasets are made here: text lines drawn with PIL (benchmarks/realistic_inputs.py), one .npz file per
sample in a folder, read by accudiff one sample at a time. Each run is `accudiff compare --fp16
--candidate onnxrt --load-inputs FOLDER --workers W --no-verify` as a fresh process (wall time, peak memory
of the process tree; the workers and the threads each used, from summary.json's `layout`).

The marginal cost of a sample is (wall time of N2 samples - wall time of N1) / (N2 - N1): the fixed costs
(starting, loading, the isolated run's first 8 samples) cancel out. `--no-verify`: verification tries
keep-lists on at most 8 failing samples whatever the dataset's size, and how many rounds it runs depends on
which samples fail, which differs between N1 and N2. Beside it, the floor: the inferences the job cannot
avoid, one marked FP32 run and one marked run of the lowered FP16 candidate, on one thread, sessions made
once, divided by the number of workers (what is above it is the statistics of every tensor, the isolated
run past the first samples being none, and the workers' bookkeeping). Every (W, N) pair is measured --repeat times, in turn, so a
noisy spell of a shared machine hits all of them; the medians are reported.

On a machine with C cores, `all` is C workers: with one thread per session, W workers should cost about
1/W of one worker's marginal time per sample while W <= C (the statistics and both runs are per worker),
less whatever the workers contend for (memory bandwidth, the driver's merge).
"""

from __future__ import annotations

import argparse
import json
import os
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


def compare(model: Path, data: Path, report: Path, workers: int) -> dict:
    command = accudiff_command("compare", str(model), "--fp16", "--candidate", "onnxrt", "--load-inputs", str(data), "--report-dir", str(report),
                               "--workers", str(workers), "--no-verify")
    result = measure(command)
    summary = json.loads((report / "summary.json").read_text()) if (report / "summary.json").exists() else {}
    result["layout"] = summary.get("layout")
    return result


def ray_task_overhead(model: Path, data: Path, tasks: int = 8) -> float:
    """Seconds each extra Ray task costs: the same samples as 1 task and as `tasks` tasks on a one-CPU
    local cluster (so tasks run one after another), the difference spread over the extra tasks."""
    import ray

    import accudiff

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=40)
    try:
        accudiff.compare(model, "fp16", candidate="onnxrt", inputs=data, ray="local", workers=1, verify=False)  # warm the cluster
        seconds = {}
        for count in (1, tasks):
            start = time.perf_counter()
            accudiff.compare(model, "fp16", candidate="onnxrt", inputs=data, ray="local", workers=count, verify=False)
            seconds[count] = time.perf_counter() - start
    finally:
        ray.shutdown()
    return (seconds[tasks] - seconds[1]) / (tasks - 1)


def per_sample_floor(model: Path, data: Path, samples: int = 4) -> float:
    """Seconds per sample of the inferences one worker cannot avoid (see the module's docstring), on one thread."""
    import onnx
    import onnxruntime as ort

    from accudiff.model.loading import load_model
    from accudiff.runners.fp16_emulation import lower_fp16
    from accudiff.transforms import to_fp16

    info = load_model(model)
    names = [t.name for t in info.tensors]
    candidate = to_fp16(info.proto).model
    copies = lower_fp16(candidate)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = []
    for proto, marked in ((info.proto, names), (candidate, [copies.get(n, n) for n in names])):
        del proto.graph.output[:]
        proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in marked)
        sessions.append(ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]))
    feeds = [dict(np.load(path)) for path in sorted(data.glob("*.npz"))[:samples]]
    for session in sessions:
        session.run(None, feeds[0])  # warm-up
    start = time.perf_counter()
    for feed in feeds:
        for session in sessions:
            session.run(None, feed)
    return (time.perf_counter() - start) / len(feeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs=2, default=[8, 40], metavar=("N1", "N2"))
    parser.add_argument("--workers", nargs="+", default=["1", "2", "all"], help="worker counts ('all': one per core)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--large", type=int, default=0, help="also one run of this many samples with one worker per core (0: skip)")
    parser.add_argument("--ray-overhead", action="store_true", help="also the cost of each extra Ray task, on a one-CPU local cluster")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    workers = sorted({cores if w == "all" else int(w) for w in args.workers})
    args.out.mkdir(parents=True, exist_ok=True)
    model = models.ppocr_rec_v4()
    small, large = args.counts
    measured: dict[int, list[dict]] = {w: [] for w in workers}
    with tempfile.TemporaryDirectory(prefix="accudiff-dataset-") as tmp:
        folder = Path(tmp)
        data = {n: make_dataset(folder / f"data-{n}", n) for n in (small, large)}
        floors = []
        for k in range(args.repeat):
            floors.append(per_sample_floor(model, data[large]))
            for w in workers:
                runs = {n: compare(model, data[n], folder / f"report-{w}-{n}-{k}", w) for n in (small, large)}
                measured[w].append({"marginal_s": (runs[large]["seconds"] - runs[small]["seconds"]) / (large - small),
                                    "peak_mb": max(r["peak_mb"] for r in runs.values()), "layout": runs[large]["layout"],
                                    "seconds": {n: r["seconds"] for n, r in runs.items()}})
                print(f"run {k + 1}/{args.repeat}, {w} worker(s): {measured[w][-1]['marginal_s']:.3f} s per extra sample", flush=True)
        floor = float(np.median(floors))
        one = float(np.median([m["marginal_s"] for m in measured[workers[0]]]))
        rows = {}
        print(f"\n{cores} cores, recognizer, {small} -> {large} samples, medians of {args.repeat}; floor {floor:.3f} s per sample on one core")
        print("| workers | threads each | each extra sample | vs the first row | vs its floor (floor / workers) | peak memory |")
        print("|---|---|---|---|---|---|")
        for w in workers:
            marginal = float(np.median([m["marginal_s"] for m in measured[w]]))
            layout = measured[w][-1]["layout"] or {}
            peak = max(m["peak_mb"] for m in measured[w])
            rows[w] = {"marginal_s": marginal, "ratio_to_first": marginal / one, "floor_s": floor / w, "peak_mb": peak, "layout": layout, "runs": measured[w]}
            print(f"| {layout.get('workers', w)} | {layout.get('threads')} | {marginal:.3f} s | {marginal / one:.2f}x | {marginal / (floor / w):.2f}x | {peak:.0f} MB |")
        if args.large:
            big = compare(model, make_dataset(folder / "large", args.large), folder / "report-large", cores)
            rows["large"] = big
            print(f"{args.large} samples, {cores} workers: {big['seconds']:.1f} s, {big['peak_mb']:.0f} MB, exit {big['exit']}")
        if args.ray_overhead:
            rows["ray_task_overhead_s"] = ray_task_overhead(model, data[small])
            print(f"Ray, each extra task: {rows['ray_task_overhead_s']:.2f} s")
    (args.out / "dataset_scaling.json").write_text(json.dumps({"cores": cores, "counts": args.counts, "floor_s": floor, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
