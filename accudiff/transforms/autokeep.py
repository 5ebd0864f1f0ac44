"""Autokeep, closed over what it keeps: a node left in FP32 because a constant it reads is beyond the half
format may output values beyond the format too (a mask filled with FP32's lowest), which its converted
readers would then read as Inf. Those readers are kept as well, with the values measured: the FP32 model
(only what the marked values need) runs the first MEASURED_SAMPLES samples with the kept nodes' outputs
marked, round after round, until no autokept node outputs a value beyond the format (a reader whose
result is back within it, a Softmax, ends the chain)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from accudiff.model.graph import readers_of, writers_of
from accudiff.model.inputs import Feed
from accudiff.model.inventory import ModelInfo
from accudiff.model.source import ModelSource
from accudiff.runners.onnxrt import OnnxrtRunner
from accudiff.transforms.base import TransformResult
from accudiff.transforms.fp16 import Half, to_fp16

MAX_ROUNDS = 8  # each round follows the chain one node further; a chain this long is a pattern, not a detail
MEASURED_SAMPLES = 16  # a mask's fill appears only in samples that mask something: the first may not


def close_autokeep(info: ModelInfo, result: TransformResult, samples: Sequence[Feed], keep_fp32: tuple[str, ...], half: Half) -> TransformResult:
    """`result` (to_fp16 of `info` with autokeep), with every converted reader of an autokept node's
    too-large output kept in FP32 too."""
    graph = info.proto.graph
    readers, writers = readers_of(graph.node), writers_of(graph.node)
    float_values = {t.name for t in info.tensors if t.dtype == np.float32}
    reasons: dict[str, str] = {}
    checked: set[str] = set()
    measured: list[Feed] = []
    for _ in range(MAX_ROUNDS):
        frontier = [k.node for k in result.kept if k.autokept and k.node not in checked]
        outputs = [out for node in graph.node if node.name in frontier for out in node.output if out in float_values]
        checked.update(frontier)
        if not outputs:
            break
        added = {}
        measured = measured or [samples[i] for i in range(min(len(samples), MEASURED_SAMPLES))]
        for name, largest in _reference_values(info, outputs, measured).items():
            if not np.isinf(half.as_float32(half.values(np.array([largest], np.float32)))).any():
                continue  # within the format, or rounds to its largest finite value
            for reader in readers.get(name, []):
                if reader.name in result.converted and reader.name not in reasons:
                    added[reader.name] = (f"it reads '{name}', which {writers[name].op_type} '{writers[name].name}' (kept in FP32) outputs with values up to "
                                          f"{largest:.5g} on {_samples(len(measured))}, beyond {half.label}'s largest finite value {half.maximum:.5g}: "
                                          f"in {half.label} they would be Inf")
        if not added:
            break
        reasons.update(added)
        result = to_fp16(info.proto, keep_fp32, True, half, reasons)
    return result


def _reference_values(info: ModelInfo, outputs: list[str], samples: list[Feed]) -> dict[str, float]:
    """The largest finite magnitude of each of `outputs` over `samples`, as the FP32 model computes them
    (read from its file: `info.proto` stays as it is)."""
    largest = dict.fromkeys(outputs, 0.0)
    with OnnxrtRunner(ModelSource(info.path), outputs=outputs) as runner:
        for sample in samples:
            for name, values in runner.infer(sample).items():
                finite = values[np.isfinite(values)]
                if name in largest and finite.size:
                    largest[name] = max(largest[name], float(np.abs(finite).max()))
    return largest


def _samples(count: int) -> str:
    return "the first sample" if count == 1 else f"the first {count} samples"

