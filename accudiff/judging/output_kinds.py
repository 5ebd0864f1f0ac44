"""What each graph output is, read from the graph: what the error does to a decision depends on it (a
classifier's or a language model's scores decide by their top entry and their distribution, an embedding by
its direction, a probability map by its threshold). `--output-kind NAME=KIND` overrides a guess; every
output's kind is said with the reason, so a wrong guess shows.

| kind          | read from                                                                   | figures (decisions.py) |
|---------------|-----------------------------------------------------------------------------|------------------------|
| logits        | a MatMul/Gemm head (a constant scale or bias after it), a LogSoftmax, a name with "logit" | top-1/top-5, KL divergence of the softmax, Δp of the reference's top entry, per position along the last axis |
| probabilities | a Softmax (over its axis), a softmax written out (Exp divided by its sum), a name with "prob" | the same, on the distributions themselves |
| embedding     | a LayerNormalization (hidden states), a mean pooling, a name with "embed", "hidden", "pool" | cosine per vector, nearest neighbour kept within the batch |
| map           | a Sigmoid, a mean of a Sigmoid's outputs                                    | the share of elements crossing the threshold, IoU |
| detections    | a Concat of box coordinates and a Sigmoid's class scores (YOLOv8's head)    | the detections both sides make (score above the threshold, after NMS, same class, IoU ≥ 0.5) |
| state         | a decoder's KV cache out (a present output its next step reads as past: model/decoder.py) | error percentiles; judged through the logits of later steps, never diagnosed as a failing output |
| values        | anything else (integers are compared exactly)                               | error percentiles (a map where every value lies in [0, 1]) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import onnx

from accudiff.errors import AccudiffError
from accudiff.model.graph import writers_of
from accudiff.model.decoder import find_decoder
from accudiff.model.inventory import ModelInfo

KINDS = ("logits", "probabilities", "embedding", "map", "detections", "state", "values")
DECIDING = frozenset(KINDS) - {"state"}  # the kinds whose outputs a failure is diagnosed at
MOVE_VALUES = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Cast", "Dropout"})
HEADS = frozenset({"MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "FusedMatMul"})
NORMALIZATIONS = frozenset({"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                            "RMSNormalization", "LpNormalization", "EmbedLayerNormalization"})
POOLINGS = frozenset({"ReduceMean", "ReduceSum"})
NAME_HINTS = (("logit", "logits"), ("prob", "probabilities"), ("embed", "embedding"), ("hidden", "embedding"), ("pool", "embedding"))


@dataclass(frozen=True)
class OutputKind:
    """An output's kind, why it was given, and the axis its entries run along (logits and probabilities)."""

    kind: str
    why: str
    axis: int = -1

    def as_json(self) -> list:
        """What a worker job carries of it: [kind, axis]."""
        return [self.kind, self.axis]


UNKNOWN = OutputKind("values", "nothing in the graph says what it decides")


def parse_output_kinds(texts: Iterable[str]) -> dict[str, str]:
    """`["logits=logits", "461=embedding"]` -> {name: kind}; one sentence if malformed."""
    found = {}
    for text in texts:
        name, sep, kind = str(text).rpartition("=")
        if not sep or not name or kind not in KINDS:
            raise AccudiffError(f"--output-kind '{text}' is not NAME=KIND, KIND one of {', '.join(KINDS)}")
        found[name] = kind
    return found


def deciding(outputs: Iterable[str], kinds: Mapping[str, OutputKind]) -> list[str]:
    """The outputs a verdict is judged by: all but a decoder's state (its KV cache, judged through the logits
    of later steps); an output of no known kind decides."""
    return [name for name in outputs if kinds.get(name, UNKNOWN).kind in DECIDING]


def kinds_of(info: ModelInfo, overrides: Mapping[str, str]) -> dict[str, OutputKind]:
    """Each graph output's kind in the model `info` describes (its proto loaded), `overrides` first; a
    decoder's KV-cache outputs are its state."""
    floating = {t.name: t.dtype is None or np.issubdtype(t.dtype, np.floating) for t in info.tensors if t.is_output}
    floating.update((spec.name, np.issubdtype(spec.dtype, np.floating)) for spec in info.inputs)
    decoder = find_decoder(info.path, info.inputs, info.output_names)
    state = {present: OutputKind("state", f"the next step reads it as '{past}' ({decoder.source}): the model's KV cache, judged through the logits of later steps")
             for present, past in (decoder.state.items() if decoder is not None else ())}
    found = output_kinds(info.proto.graph, info.output_names, floating, overrides)
    return {name: state[name] if name in state and not (overrides and name in overrides) else kind for name, kind in found.items()}


def output_kinds(graph: onnx.GraphProto, outputs: Iterable[str], floating: Mapping[str, bool], overrides: Mapping[str, str] | None = None) -> dict[str, OutputKind]:
    """Each graph output's kind: `overrides` (name -> kind) first, then what computes it (see the module's
    docstring); `floating`: whether each output holds floats."""
    producer = writers_of(graph.node)
    constants = {init.name for init in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    kinds = {}
    for name in outputs:
        if overrides and name in overrides:
            kinds[name] = OutputKind(overrides[name], "given by --output-kind")
        elif not floating.get(name, True):
            kinds[name] = OutputKind("values", "it holds integers, compared exactly")
        else:
            kinds[name] = _read(name, producer, constants)
    return kinds


def _read(name: str, producer: Mapping[str, onnx.NodeProto], constants: set[str]) -> OutputKind:
    node = _computing(name, producer)
    op = node.op_type if node is not None else ""
    if op == "Softmax":
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        return OutputKind("probabilities", "a Softmax computes it" + (f" over axis {axis}" if axis != -1 else ""), axis)
    if op == "LogSoftmax":
        return OutputKind("logits", "a LogSoftmax computes it: log-probabilities")
    if op == "Sigmoid":
        return OutputKind("map", "a Sigmoid computes it: a probability per element")
    if op == "Concat" and len(node.input) == 2 and _reads(node.input[1], {"Sigmoid"}, producer, constants):
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        return OutputKind("detections", f"YOLOv8's head computes it: a Concat, along axis {axis}, of 4 box coordinates (centre, width, height) "
                                        "and a Sigmoid's score per class", axis)
    if op == "Div" and _reads(node.input[0], {"Exp"}, producer, constants):
        return OutputKind("probabilities", "an Exp divided by its sum computes it: a softmax")
    if op in NORMALIZATIONS:
        return OutputKind("embedding", f"a {op} computes it: hidden states")
    if op == "ReduceMean" and (pooled := _computing(node.input[0], producer)) is not None and pooled.op_type == "Sigmoid":
        # (silero VAD's speech probability: the mean over time of its decoder's Sigmoid, one value a chunk)
        return OutputKind("map", "a mean of a Sigmoid's probabilities computes it: a probability per element")
    if op in POOLINGS or (op == "Div" and _reads(node.input[0], POOLINGS, producer, constants)):
        return OutputKind("embedding", "a pooling over tokens computes it")
    head = node if op in HEADS else _scaled(node, producer, constants)
    if head is not None:
        return OutputKind("logits", f"a {head.op_type} head computes it: scores over its last axis")
    for hint, kind in NAME_HINTS:
        if hint in name.lower():
            return OutputKind(kind, f"its name says so ('{hint}')")
    return UNKNOWN


def _computing(name: str, producer: Mapping[str, onnx.NodeProto]) -> onnx.NodeProto | None:
    """The node that computes `name`, past the ones that only move or store its values (a one-input Concat too)."""
    node = producer.get(name)
    while node is not None and (node.op_type in MOVE_VALUES or (node.op_type == "Concat" and len(node.input) == 1)):
        node = producer.get(node.input[0])
    return node


def _reads(name: str, ops: Iterable[str], producer: Mapping[str, onnx.NodeProto], constants: set[str]) -> bool:
    """`name` is computed by one of `ops` (past value movers and a constant scale or bias)."""
    node = _computing(name, producer)
    while node is not None and node.op_type in ("Mul", "Add", "Sub", "Div") and any(i in constants for i in node.input):
        node = _computing(next(i for i in node.input if i not in constants), producer)
    return node is not None and node.op_type in ops


def _scaled(node: onnx.NodeProto | None, producer: Mapping[str, onnx.NodeProto], constants: set[str]) -> onnx.NodeProto | None:
    """The head a constant scale or bias follows (Add(MatMul(x, W), b), Mul(MatMul(...), s)), or None."""
    while node is not None and node.op_type in ("Mul", "Add") and any(i in constants for i in node.input):
        node = _computing(next(i for i in node.input if i not in constants), producer)
    return node if node is not None and node.op_type in HEADS else None
