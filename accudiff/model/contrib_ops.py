"""ONNX Runtime's own ops (domain com.microsoft: Attention, SkipLayerNormalization, MatMulNBits...), as the
FP16/BF16 pass needs to know them: their schemas come from ONNX Runtime (the onnx package has none), and
whether its CPU provider has a kernel for a node in a format is asked of ONNX Runtime itself: a session is
made (not run) on the node alone with those types. The answer depends on the ONNX Runtime installed (1.32
has FP16 Attention on the CPU, earlier releases did not), so it is never written down here."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx
from onnx import helper

ORT_DOMAINS = ("com.microsoft",)


@dataclass(frozen=True)
class Formal:
    name: str
    type_str: str


@dataclass(frozen=True)
class Constraint:
    type_param_str: str
    allowed_type_strs: tuple[str, ...]


@dataclass(frozen=True)
class ContribSchema:
    """A contrib op's schema in the shape of an onnx.defs schema (what fp16.py reads of one)."""

    inputs: tuple[Formal, ...]
    outputs: tuple[Formal, ...]
    type_constraints: tuple[Constraint, ...]


@functools.lru_cache(maxsize=1)
def _schemas() -> dict[tuple[str, str], ContribSchema]:
    from onnxruntime.capi import _pybind_state

    found = {}
    for schema in _pybind_state.get_all_operator_schema():
        if schema.domain in ORT_DOMAINS:
            found[(schema.domain, schema.name)] = ContribSchema(
                tuple(Formal(f.name, f.typeStr) for f in schema.inputs), tuple(Formal(f.name, f.typeStr) for f in schema.outputs),
                tuple(Constraint(c.type_param_str, tuple(c.allowed_type_strs)) for c in schema.type_constraints))
    return found


def contrib_schema(node: onnx.NodeProto) -> ContribSchema | None:
    """The schema ONNX Runtime registers for `node`'s op, or None (not one of its ops)."""
    return _schemas().get((node.domain, node.op_type)) if node.domain in ORT_DOMAINS else None


def has_cpu_kernel(node: onnx.NodeProto, input_types: tuple[int, ...], output_types: tuple[int, ...], opset: int) -> bool:
    """Whether ONNX Runtime's CPU provider has a kernel for `node` reading and writing these element types
    (0: an absent optional input or output)."""
    bare = onnx.NodeProto()
    bare.CopyFrom(node)
    return _probe(bare.SerializeToString(), input_types, output_types, opset)


@functools.lru_cache(maxsize=256)
def _probe(node_bytes: bytes, input_types: tuple[int, ...], output_types: tuple[int, ...], opset: int) -> bool:
    import onnxruntime

    node = onnx.NodeProto.FromString(node_bytes)
    inputs = [helper.make_tensor_value_info(name, kind, None) for name, kind in zip(node.input, input_types) if name and kind]
    outputs = [helper.make_tensor_value_info(name, kind, None) for name, kind in zip(node.output, output_types) if name and kind]
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(node.domain, 1)])
    model.ir_version = 8
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's errors are one exception type with a code in the text
        return "NOT_IMPLEMENTED" not in str(exc) and "Type Error" not in str(exc)
    return True
