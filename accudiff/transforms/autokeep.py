"""Autokeep, closed over what it keeps: a node left in FP32 because a constant it reads is beyond the half
format may output values beyond the format too (a mask filled with FP32's lowest), which its converted
readers would then read as Inf. Those readers are kept as well, with the values measured: the FP32 model
(only what the marked values need) runs the first MEASURED_SAMPLES samples with the kept nodes' outputs
marked, round after round, until no autokept node outputs a value beyond the format (a reader whose
result is back within it, a Softmax, ends the chain). The runs are the caller's `measure` (a worker process
runs them: execution/probes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from accudiff.model.graph import readers_of, writers_of
from accudiff.model.inventory import ModelInfo
from accudiff.model.samples import Samples
from accudiff.transforms.base import TransformResult
from accudiff.transforms.fp16 import Half, to_fp16

MAX_ROUNDS = 8  # each round follows the chain one node further; a chain this long is a pattern, not a detail
MEASURED_SAMPLES = 16  # a mask's fill appears only in samples that mask something: the first may not
# The largest finite magnitude of each named output of the FP32 model file over the samples.
Measure = Callable[[Path, list[str], Samples], dict[str, float]]


def close_autokeep(info: ModelInfo, result: TransformResult, samples: Samples, keep_fp32: tuple[str, ...], half: Half, measure: Measure) -> TransformResult:
    """`result` (to_fp16 of `info` with autokeep), with every converted reader of an autokept node's
    too-large output kept in FP32 too (`measure`: how large its values grow, measured on the model's file)."""
    graph = info.proto.graph
    readers, writers = readers_of(graph.node), writers_of(graph.node)
    float_values = {t.name for t in info.tensors if t.dtype == np.float32}
    reasons: dict[str, str] = {}
    checked: set[str] = set()
    measured: Samples | None = None
    for _ in range(MAX_ROUNDS):
        frontier = [k.node for k in result.kept if k.autokept and k.node not in checked]
        outputs = [out for node in graph.node if node.name in frontier for out in node.output if out in float_values]
        checked.update(frontier)
        if not outputs:
            break
        added = {}
        measured = measured or samples.subset(range(min(len(samples), MEASURED_SAMPLES)))
        for name, largest in measure(info.path, outputs, measured).items():
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


def _samples(count: int) -> str:
    return "the first sample" if count == 1 else f"the first {count} samples"

