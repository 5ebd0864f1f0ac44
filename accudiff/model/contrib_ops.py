"""ONNX Runtime's own ops: those of its com.microsoft domain (Attention, SkipLayerNormalization, MatMulNBits,
GroupQueryAttention...) and those it registers in the default domain where ONNX has none of that name
(SimplifiedLayerNormalization, which the GenAI model builder writes). ONNX's checker and its schemas do not
know them; ONNX Runtime loads and runs them, so a model holding them is checked, typed and converted by
what ONNX Runtime knows of them: their schemas come from ONNX Runtime, and whether its CPU provider has a
kernel for a node in a format is asked of ONNX Runtime itself (a session is made, not run, on the node
alone with those types). The answer depends on the ONNX Runtime installed (1.32 has FP16 Attention on the
CPU, earlier releases did not), so it is never written down here."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx
from onnx import helper

ORT_DOMAINS = ("com.microsoft",)
DEFAULT_DOMAINS = ("", "ai.onnx")
CHECKED_AS_DOMAIN = "com.microsoft.accudiff-checked"  # where ONNX's checker is shown ONNX Runtime's default-domain ops (it skips domains it does not know)


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
    """An ONNX Runtime op's schema in the shape of an onnx.defs schema (what fp16.py reads of one)."""

    inputs: tuple[Formal, ...]
    outputs: tuple[Formal, ...]
    type_constraints: tuple[Constraint, ...]


@functools.lru_cache(maxsize=1)
def _schemas() -> dict[tuple[str, str], ContribSchema]:
    """ONNX Runtime's schemas of its own ops, by (domain, op type); the default domain's under ""."""
    from onnxruntime.capi import _pybind_state

    found, newest = {}, {}
    for schema in _pybind_state.get_all_operator_schema():
        domain = "" if schema.domain in DEFAULT_DOMAINS else schema.domain
        if domain not in ORT_DOMAINS and (domain != "" or onnx.defs.has(schema.name)):
            continue
        key = (domain, schema.name)
        if key in newest and newest[key] >= schema.since_version:
            continue
        newest[key] = schema.since_version
        found[key] = ContribSchema(
            tuple(Formal(f.name, f.typeStr) for f in schema.inputs), tuple(Formal(f.name, f.typeStr) for f in schema.outputs),
            tuple(Constraint(c.type_param_str, tuple(c.allowed_type_strs)) for c in schema.type_constraints))
    return found


def _key(node: onnx.NodeProto) -> tuple[str, str]:
    return ("" if node.domain in DEFAULT_DOMAINS else node.domain, node.op_type)


def is_onnxruntime_op(node: onnx.NodeProto) -> bool:
    """`node` is one of ONNX Runtime's own ops (not one of ONNX's): only ONNX Runtime knows and runs it."""
    if node.domain in ORT_DOMAINS:
        return True
    return node.domain in DEFAULT_DOMAINS and not onnx.defs.has(node.op_type) and _key(node) in _schemas()


def contrib_schema(node: onnx.NodeProto) -> ContribSchema | None:
    """The schema ONNX Runtime registers for `node`'s op, or None (not one of its own ops)."""
    return _schemas().get(_key(node)) if is_onnxruntime_op(node) else None


def onnxruntime_default_domain_ops(nodes) -> list[onnx.NodeProto]:
    """The nodes of `nodes` that are ONNX Runtime's ops in the default domain (ONNX's checker rejects them)."""
    return [node for node in nodes if node.domain in DEFAULT_DOMAINS and is_onnxruntime_op(node)]


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
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(node.domain, 1)] if node.domain not in DEFAULT_DOMAINS else [])
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outputs), opset_imports=imports)
    model.ir_version = 8
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's errors are one exception type with a code in the text
        return "NOT_IMPLEMENTED" not in str(exc) and "Type Error" not in str(exc)
    return True
