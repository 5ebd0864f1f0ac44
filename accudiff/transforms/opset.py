"""A model exported at an opset whose schemas lack what a candidate needs: it is converted with ONNX's
version converter (node and tensor names kept), and it is said.

INT8's per-channel DequantizeLinear needs opset 13: the INT8 transform converts its candidate. BF16 forms
of Conv, the pooling ops and most activations come with opset 22 (a model exported at opset 11 has no BF16
Conv at all): there the model itself, reference and candidate alike, is compared at opset 22, so every
variant verification builds (switchboards, keeps, the isolated run) reads one graph. The converter
rewrites some ops (a Softmax-11 becomes Flatten, Softmax, Reshape): the values they add are compared too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import onnx

from accudiff.errors import AccudiffError, first_line
from accudiff.model.formats import formats_of
from accudiff.model.inventory import ModelInfo
from accudiff.model.loading import load_model
from accudiff.model.saving import save_model
from accudiff.model.shapes import shape_inference_copy

FORMS_OPSET = {"bf16": (22, "tensor(bfloat16)")}  # a format -> the opset whose schemas have its forms, and its type


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def with_opset(model: onnx.ModelProto, opset: int, need: str) -> tuple[onnx.ModelProto, list[str]]:
    """`model` at `opset` or later, and the notice saying it was converted (`need`: what for, e.g. "BF16
    forms of its ops"); one sentence when the converter cannot do it."""
    current = default_opset(model)
    if current >= opset:
        return model, []
    try:
        upgraded = onnx.version_converter.convert_version(model, opset)
    except Exception as exc:  # the converter raises bare errors of many kinds
        raise AccudiffError(f"the candidate needs opset {opset} ({need}), and ONNX's version converter cannot convert this opset-{current} model: {first_line(exc)}") from exc
    # The converter keeps the IR version; below 4 every initializer must also be a graph input, which a
    # candidate's new initializers break. The opset's own IR is the floor.
    upgraded.ir_version = max(upgraded.ir_version, ir_floor(upgraded.opset_import))
    return upgraded, [f"the model is at opset {current}; its candidate was converted to opset {opset}, for {need}"]


def ir_floor(opsets: Iterable[onnx.OperatorSetIdProto]) -> int:
    """The lowest IR version the imported opsets need, from the versions onnx knows: real models import
    domains it has never heard of (com.microsoft, com.microsoft.nchwc, ...), which need nothing of it."""
    known = [o for o in opsets if (o.domain or "ai.onnx", o.version) in onnx.helper.OP_SET_ID_VERSION_MAP]
    return onnx.helper.find_min_ir_version_for(known) if known else 3


def at_forms_opset(info: ModelInfo, precision: str, scratch: Path) -> tuple[ModelInfo, list[str]]:
    """The run's model at the opset where its ops have forms in the formats `precision` names, when they gain
    some there (saved in `scratch` under the model's own name, and loaded), and the notice; else `info`."""
    opset = default_opset(info.proto)
    needed = [FORMS_OPSET[fmt] for fmt in formats_of(precision) if fmt in FORMS_OPSET]
    gaining = {target: sorted({n.op_type for n in info.proto.graph.node if _gains(n, opset, target, type_str)}) for target, type_str in needed if opset < target}
    targets = [target for target, ops in gaining.items() if ops]
    if not targets:
        return info, []
    target = max(targets)
    ops = gaining[target]
    formats = "/".join(fmt.upper() for fmt in formats_of(precision) if fmt in FORMS_OPSET)
    copy = shape_inference_copy(info.proto)  # large weights declared as typed inputs: the converter never copies them
    upgraded, _ = with_opset(copy, target, f"{formats} forms of its ops")
    declared, held_apart = {value.name for value in info.proto.graph.input}, {value.name for value in copy.graph.input}
    large_constants = [node for node in info.proto.graph.node if node.op_type == "Constant" and node.output[0] in held_apart - declared]
    nodes = [*large_constants, *upgraded.graph.node]  # Constants read nothing: first
    inputs = [value for value in upgraded.graph.input if value.name in declared]
    weights = {init.name for init in info.proto.graph.initializer}
    added = [init for init in upgraded.graph.initializer if init.name not in weights]  # what the converter made
    del upgraded.graph.node[:], upgraded.graph.input[:], upgraded.graph.initializer[:], upgraded.graph.value_info[:]
    upgraded.graph.node.extend(nodes)
    upgraded.graph.input.extend(inputs)
    upgraded.graph.initializer.extend([*info.proto.graph.initializer, *added])
    target_path = scratch / f"opset{target}" / info.path.name
    target_path.parent.mkdir(parents=True, exist_ok=True)
    save_model(upgraded, target_path)
    named = ", ".join(ops[:4]) + (f" and {len(ops) - 4} other op(s)" if len(ops) > 4 else "")
    return load_model(target_path), [f"the model is at opset {opset}, where {named} have no {formats} form: "
                                      f"it is compared at opset {target} (converted by ONNX's version converter, names kept)"]


def _gains(node: onnx.NodeProto, opset: int, target: int, type_str: str) -> bool:
    """Whether `node`'s op has a form in `type_str` at `target` that it lacks at `opset`."""
    if node.domain not in ("", "ai.onnx") or not onnx.defs.has(node.op_type):
        return False
    try:
        before, after = (onnx.defs.get_schema(node.op_type, version) for version in (opset, target))
    except onnx.defs.SchemaError:
        return False
    return any(type_str in c.allowed_type_strs for c in after.type_constraints) and not any(type_str in c.allowed_type_strs for c in before.type_constraints)
