"""Which parts of a model TensorRT can take: node ranges it converts and those it cannot, each saved as ONNX.

1. The parser's capability query (`supports_model_v2`) names the nodes it cannot convert.
2. The nodes, in topological order, are cut into ranges at those nodes.
3. Each remaining range is extracted as its own ONNX model and parsed for real: only a range TensorRT
   parses on its own counts as convertible (the capability query alone reports ranges next to a failing
   node as unsupported even when they convert fine, and version to version it differs in how).
Files are named `supported_subgraph-nodes-S-E.onnx` / `unsupported_subgraph-nodes-S-E.onnx` (E inclusive).
"""

from __future__ import annotations

import collections
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
import pandas as pd

from accudiff.model.loading import load_model

from accudiff.model.saving import save_model
from accudiff.model.subgraph import extract
from accudiff.errors import AccudiffError
from accudiff.atomic import ReportFolder, new_folder
from accudiff.runners.trt_build import create_network, error_log
from accudiff.runners.trt_env import import_tensorrt

PARTITION_TABLE = "partitions.csv"


@dataclass(frozen=True)
class Partition:
    start: int
    end: int  # inclusive
    supported: bool
    op_types: str  # "Conv x2, Relu"
    reason: str
    path: Path


def partition(model: str | Path, out_dir: str | Path, module: str | None = None) -> list[Partition]:
    """Split `model` into TensorRT-convertible and non-convertible node ranges, saved in the new folder
    `out_dir` (written whole or not at all)."""
    trt = import_tensorrt(module)
    info = load_model(model)
    nodes = list(info.proto.graph.node)
    failing = _failures_inside(trt, info, _capability_errors(trt, info.path))
    with new_folder(Path(out_dir)) as folder:
        partitions = _save_partitions(trt, info, nodes, failing, folder)
    return [replace(p, path=folder.final / p.path.name) for p in partitions]


def _save_partitions(trt, info, nodes, failing: dict[int, str], folder: ReportFolder) -> list[Partition]:
    out_dir = folder.path
    partitions = []
    for start, end in _ranges(len(nodes), set(failing)):
        subgraph = extract(info.proto, range(start, end + 1))
        if start in failing:
            supported, reason = False, failing[start]
        else:
            supported, reason = _parses(trt, subgraph)
        kind = "supported" if supported else "unsupported"
        path = out_dir / f"{kind}_subgraph-nodes-{start}-{end}.onnx"
        save_model(subgraph, path)
        partitions.append(Partition(start, end, supported, _op_summary(nodes[start : end + 1]), reason, path))
    table = pd.DataFrame([{**p.__dict__, "path": p.path.name} for p in partitions])
    table.to_csv(out_dir / PARTITION_TABLE, index=False)
    return partitions


def _capability_errors(trt, path: Path) -> dict[int, str]:
    """Node index -> why TensorRT's parser cannot convert it, from the capability query."""
    logger = error_log(trt)
    network = trt.Builder(logger).create_network(0)
    parser = trt.OnnxParser(network, logger)
    parser.supports_model_v2(path.read_bytes(), str(path))
    failing = {}
    for index in range(parser.num_errors):
        error = parser.get_error(index)
        if error.node() >= 0:
            failing[error.node()] = f"{error.node_operator()} '{error.node_name()}': {error.desc().strip() or 'unsupported'}"
    return failing


def _failures_inside(trt, info, failing: dict[int, str]) -> dict[int, str]:
    """`failing` with the nodes TensorRT's capability query passed over: it may name only the first of several
    nodes it cannot convert (a decoder's GroupQueryAttentions), so each range between failing nodes is asked
    again on its own until none names another (a cut keeps its nodes in order: its node i is the range's start + i)."""
    failing, clean = dict(failing), set()
    count = len(info.proto.graph.node)
    while True:
        for start, end in _ranges(count, set(failing)):
            if start in failing or (start, end) in clean:
                continue
            with tempfile.TemporaryDirectory(prefix="accudiff-partition-") as tmp:
                path = Path(tmp) / "range.onnx"
                save_model(extract(info.proto, range(start, end + 1)), path)
                inside = _capability_errors(trt, path)
            if inside:
                failing.update((start + index, why) for index, why in inside.items())
                break
            clean.add((start, end))
        else:
            return failing


def _parses(trt, subgraph: onnx.ModelProto) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="accudiff-partition-") as tmp:
        path = Path(tmp) / "subgraph.onnx"
        save_model(subgraph, path)
        try:
            create_network(trt, path)
        except AccudiffError as exc:
            return False, str(exc).split(": ", 1)[-1]
    return True, ""


def _ranges(count: int, failing: set[int]) -> list[tuple[int, int]]:
    """Consecutive node ranges, cut wherever support changes (each failing node run forms its own range)."""
    ranges, start = [], 0
    for index in range(1, count + 1):
        if index == count or (index in failing) != (start in failing):
            ranges.append((start, index - 1))
            start = index
    return ranges


def _op_summary(nodes) -> str:
    counts = collections.Counter(node.op_type for node in nodes)
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.items())
