"""Weights past protobuf's 2 GB: an MLP whose weights travel as external data, compared in FP16 (and INT8),
side by side with its floor (two plain ONNX Runtime sessions, created and run) and polygraphy's flow.

    python benchmarks/big_weights.py --gib 3          # three 16384x16384 MatMuls (the issue's case)
    python benchmarks/big_weights.py --gib 0.75 --int8

The model is written straight to its data file, one seeded weight row block at a time, so building it
costs no more memory than a block. Peak memory is the whole process tree's (accudiff's workers count).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.measure import accudiff_command, measure, polygraphy_command  # noqa: E402

LAYERS = 3
ROWS_PER_BLOCK = 1024


def build(folder: Path, gib: float, seed: int = 0) -> tuple[Path, int]:
    """An MLP of LAYERS square MatMuls (Tanh between) holding `gib` GiB of FP32 weights, as external data."""
    width = int(math.sqrt(gib * 2**30 / 4 / LAYERS)) // 64 * 64
    rng = np.random.default_rng(seed)
    data = folder / "weights.bin"
    initializers, nodes, offset = [], [], 0
    with open(data, "wb") as file:
        for layer in range(LAYERS):
            for start in range(0, width, ROWS_PER_BLOCK):
                rows = min(ROWS_PER_BLOCK, width - start)
                file.write((rng.standard_normal((rows, width), dtype=np.float32) / np.float32(np.sqrt(width))).tobytes())
            weight = TensorProto(name=f"w{layer}", data_type=TensorProto.FLOAT, dims=[width, width])
            weight.data_location = TensorProto.EXTERNAL
            length = width * width * 4
            for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(length))):
                weight.external_data.add(key=key, value=value)
            offset += length
            initializers.append(weight)
            source = "x" if layer == 0 else f"a{layer - 1}"
            nodes.append(helper.make_node("MatMul", [source, f"w{layer}"], [f"m{layer}"], name=f"matmul{layer}"))
            nodes.append(helper.make_node("Tanh", [f"m{layer}"], [f"a{layer}" if layer < LAYERS - 1 else "y"], name=f"tanh{layer}"))
    graph = helper.make_graph(nodes, "big_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "big.onnx"
    path.write_bytes(model.SerializeToString())  # the graph only: the weights are in weights.bin
    return path, width


FLOOR = """
import sys, time, numpy as np, onnxruntime as ort
path, width = sys.argv[1], int(sys.argv[2])
feed = {"x": np.random.default_rng(0).standard_normal((1, width), dtype=np.float32)}
for _ in range(2):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    session.run(None, feed)
    del session
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0, help="FP32 weights, in GiB")
    parser.add_argument("--int8", action="store_true", help="compare in INT8 too")
    parser.add_argument("--polygraphy", action="store_true", help="run polygraphy's flow too (it fails past 2 GB)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="accudiff-big-") as scratch:
        work = Path(scratch)
        model, width = build(work, args.gib)
        weights = (work / "weights.bin").stat().st_size / 2**20
        print(f"MLP of {LAYERS} MatMuls {width}x{width}: {weights:.0f} MB of FP32 weights as external data")
        floor = measure([sys.executable, "-c", FLOOR, str(model), str(width)])
        print(f"  floor (two plain ONNX Runtime sessions, created and run): {floor['seconds']:.1f} s, peak {floor['peak_mb']:.0f} MB")
        for precision in ["fp16"] + ["int8"] * args.int8:
            report = work / f"report-{precision}"
            run = measure(accudiff_command("compare", str(model), f"--{precision}", "--candidate", "onnxrt", "-o", str(report)))
            summary = json.loads((report / "summary.json").read_text()) if (report / "summary.json").exists() else {}
            print(f"  accudiff compare --{precision}: {run['seconds']:.1f} s ({run['seconds'] / floor['seconds']:.2f}x the floor), "
                  f"peak {run['peak_mb']:.0f} MB ({run['peak_mb'] / weights:.2f}x the weights), exit {run['exit']} {run['stderr_tail']}")
            print(f"    stages: {summary.get('timings_s', {})}")
            print(f"    workers: {summary.get('worker_timings_s', {})}")
        if args.polygraphy:
            run = measure([*polygraphy_command(), "run", str(model), "--onnxrt", "--onnx-outputs", "mark", "all", "--save-outputs", str(work / "ref.json")])
            print(f"  polygraphy run --onnxrt --onnx-outputs mark all: {run['seconds']:.1f} s, peak {run['peak_mb']:.0f} MB, exit {run['exit']} {run['stderr_tail']}")


if __name__ == "__main__":
    main()
