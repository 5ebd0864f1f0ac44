"""Wall time and peak memory of `accudiff compare --fp16` next to polygraphy doing the same job.

    python benchmarks/compare_vs_polygraphy.py [--models resnet18 ppocr_rec_v4 nudenet_320n ppocr_rec_v4_modelopt_int8 ppocr_rec_v4_modelopt_fp8
        minilm_l3_dynamic_int8 minilm_l3_nbits4] [--repeat 3] [--out benchmarks/out]

(every model by default; one whose wheel or quantizer is missing is skipped, saying which)

polygraphy's flow (0.53): `run M --onnxrt --onnx-outputs mark all --save-outputs ref.json`, then `convert
M --fp-to-fp16 -o M16`, then `run M16 --onnxrt --onnx-outputs mark all --load-outputs ref.json`.
accudiff's: `accudiff compare M --fp16 --candidate onnxrt`. For a candidate made by another tool (the
recognizer quantized by ModelOpt, INT8 or FP8; paraphrase-MiniLM-L3-v2 quantized by ONNX Runtime's quantize_dynamic
or MatMulNBitsQuantizer, made before timing starts), polygraphy runs the candidate instead of converting (`run Q --onnxrt --onnx-outputs mark all --load-outputs ref.json`), and accudiff
runs `accudiff compare M --candidate-model Q --candidate onnxrt`. A model whose inputs are not images (MiniLM's
token ids) is fed one realistic sample (two sentences), from polygraphy's own input JSON and from an .npz; the
others are fed generated inputs of the given shape. Both run as fresh processes; peak memory is
the largest sum of resident memory over the whole process tree (sampled every 10 ms from /proc), so
accudiff's worker processes count; both run from byte-compiled modules (`measure.accudiff_command`). The
floor is two marked ONNX Runtime runs plus one pass over the tensors, with sessions already created.
Results print as a table and are saved as JSON in --out.
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
from benchmarks import models, realistic_inputs
from benchmarks.measure import accudiff_command, environment, environment_line, measure, polygraphy_command

SHAPES = {"resnet18": "input:1x3x224x224", "ppocr_rec_v4": "x:1x3x48x320", "nudenet_320n": "images:1x3x320x320"}
FEEDS = {"minilm_l3": realistic_inputs.sentences}  # models fed a realistic sample instead


CANDIDATES = {"ppocr_rec_v4_modelopt_int8": ("ppocr_rec_v4", "int8"), "ppocr_rec_v4_modelopt_fp8": ("ppocr_rec_v4", "fp8"),
              "minilm_l3_dynamic_int8": ("minilm_l3", "quantize_dynamic"), "minilm_l3_nbits4": ("minilm_l3", "MatMulNBitsQuantizer")}


def make_candidate(base: str, mode: str, model: Path, target: Path) -> Path:
    """The candidate another tool makes of `model` (before timing starts)."""
    if mode == "quantize_dynamic":
        return models.onnxruntime_dynamic(model, target)
    if mode == "MatMulNBitsQuantizer":
        return models.onnxruntime_nbits(model, target)
    calibration = np.concatenate([realistic_inputs.ppocr_rec(seed)["x"] for seed in range(100, 132)])
    return models.modelopt_quantized(model, calibration, target, mode)


def input_files(base: str, work: Path) -> tuple[list[str], list[str], dict | None]:
    """The input options of polygraphy and of accudiff for `base`, and the feed they are (None: generated)."""
    if base not in FEEDS:
        name, dims = SHAPES[base].split(":")
        return ["--input-shapes", f"{name}:[{','.join(dims.split('x'))}]"], ["--input-shapes", SHAPES[base]], None
    from polygraphy.json import save_json

    from accudiff.model.inputs import save_feeds

    feed = FEEDS[base](0)
    save_json([feed], str(work / "inputs.json"))
    save_feeds([feed], work / "inputs.npz")
    return ["--load-inputs", str(work / "inputs.json")], ["--load-inputs", str(work / "inputs.npz")], feed


def polygraphy_flow(model: Path, inputs: list[str], work: Path, candidate: Path | None = None) -> dict:
    shape_arg = inputs
    polygraphy = polygraphy_command()
    steps = [polygraphy + ["run", str(model), "--onnxrt", "--onnx-outputs", "mark", "all", "--save-outputs", str(work / "ref.json"), *shape_arg]]
    if candidate is None:
        candidate = work / "model16.onnx"
        steps.append(polygraphy + ["convert", str(model), "--fp-to-fp16", "-o", str(candidate)])
    steps.append(polygraphy + ["run", str(candidate), "--onnxrt", "--onnx-outputs", "mark", "all", "--load-outputs", str(work / "ref.json"), *shape_arg])
    results = [measure(step) for step in steps]
    return {
        "seconds": sum(r["seconds"] for r in results),
        "peak_mb": max(r["peak_mb"] for r in results),
        "exit_codes": [r["exit"] for r in results],
        "last_error": next((r["stderr_tail"] for r in results if r["exit"]), []),
    }


def accudiff_flow(model: Path, inputs: list[str], work: Path, candidate: Path | None = None) -> dict:
    what = ["--fp16"] if candidate is None else ["--candidate-model", str(candidate)]
    result = measure(accudiff_command("compare", str(model), *what, "--candidate", "onnxrt", *inputs, "--report-dir", str(work / "report")))
    summary = json.loads((work / "report" / "summary.json").read_text()) if (work / "report").exists() else {}
    result.update(tensors=summary.get("counts", {}).get("tensors"), phases=summary.get("timings_s"), workers=summary.get("worker_timings_s"))
    return result


def floor(model: Path, shape: str | None, feed: dict | None = None) -> dict:
    """Two marked ONNX Runtime runs (sessions ready) and one max-abs-difference pass over every tensor, on
    `feed` or on generated inputs of `shape`."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(model))
    names = [o for node in proto.graph.node for o in node.output if o and node.op_type != "Constant"]
    existing = {o.name for o in proto.graph.output}
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in existing)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    if feed is None:
        name, dims = shape.split(":")
        feed = {name: np.random.default_rng(0).uniform(0, 1, [int(d) for d in dims.split("x")]).astype(np.float32)}
    session.run(None, feed)  # warm-up
    start = time.perf_counter()
    first, second = session.run(None, feed), session.run(None, feed)
    runs = time.perf_counter() - start
    start = time.perf_counter()
    for a, b in zip(first, second):
        if isinstance(a, np.ndarray) and a.size and np.issubdtype(a.dtype, np.floating):
            float(np.abs(a - b).max())
    stats = time.perf_counter() - start
    megabytes = sum(a.nbytes for a in first if isinstance(a, np.ndarray)) / 1e6
    return {"seconds": runs + stats, "two_runs": runs, "stats_pass": stats, "tensor_mb": megabytes}


def _median_run(results: list[dict]) -> dict:
    """The run of median wall time, with the largest peak memory of all runs and every run's time."""
    chosen = dict(sorted(results, key=lambda r: r["seconds"])[len(results) // 2])
    chosen.update(peak_mb=max(r["peak_mb"] for r in results), all_seconds=[round(r["seconds"], 2) for r in results])
    return chosen


def _breakdown(run: dict) -> str:
    """The median run's stages (wall seconds) and its workers' phases (seconds added over workers)."""
    text = ", ".join(f"{k} {v:.2f}" for k, v in (run.get("phases") or {}).items() if v >= 0.005)
    for stage, phases in (run.get("workers") or {}).items():
        text += f"; {stage} workers: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*SHAPES, *CANDIDATES], choices=[*SHAPES, *CANDIDATES, *FEEDS])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each flow; the median time and the largest peak are reported")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {"environment": environment()}
    print(f"this machine: {environment_line(rows['environment'])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            base, mode = CANDIDATES.get(name, (name, None))
            try:
                model = models.MODELS[base](Path(tmp))
                candidate = make_candidate(base, mode, model, Path(tmp) / f"{name}.onnx") if mode is not None else None
            except ModuleNotFoundError as exc:  # a wheel or a quantizer this machine lacks
                print(f"{name:14} skipped: {exc}", flush=True)
                continue
            polygraphy_inputs, accudiff_inputs, feed = input_files(base, Path(tmp))
            runs = {"polygraphy": [], "accudiff": []}
            for repeat in range(args.repeat):  # alternated, so a noisy spell on this shared machine hits both
                work = Path(tmp) / name / str(repeat)
                (work / "pg").mkdir(parents=True)
                (work / "ad").mkdir()
                runs["polygraphy"].append(polygraphy_flow(model, polygraphy_inputs, work / "pg", candidate))
                runs["accudiff"].append(accudiff_flow(model, accudiff_inputs, work / "ad", candidate))
            rows[name] = {tool: _median_run(results) for tool, results in runs.items()}
            rows[name]["floor"] = floor(model, SHAPES.get(base), feed)
            row = rows[name]
            pg, ad, fl = row["polygraphy"], row["accudiff"], row["floor"]
            print(
                f"{name:<14} accudiff {ad['seconds']:6.2f} s {ad['peak_mb']:7.0f} MB | polygraphy {pg['seconds']:6.2f} s "
                f"{pg['peak_mb']:7.0f} MB (exit {pg['exit_codes']}) | time ratio {ad['seconds'] / pg['seconds']:.2f}, "
                f"memory ratio {ad['peak_mb'] / pg['peak_mb']:.2f} | floor {fl['seconds']:.2f} s ({fl['tensor_mb']:.0f} MB of tensors)",
                flush=True,
            )
            print(f"{'':<14} where accudiff's time went: {_breakdown(ad)}; floor: two runs {fl['two_runs']:.2f} s, statistics {fl['stats_pass']:.2f} s", flush=True)
    (args.out / "compare_vs_polygraphy.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
