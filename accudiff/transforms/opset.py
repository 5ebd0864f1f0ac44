"""A candidate whose formats need newer operator schemas than its model was exported with: the model is
converted with ONNX's version converter (node and tensor names kept), and it is said.

INT8's per-channel DequantizeLinear needs opset 13; BF16 forms of Conv, the pooling ops and most
activations come with opset 22 (a model exported at opset 11 has no BF16 Conv at all).
"""

from __future__ import annotations

from typing import Iterable

import onnx

from accudiff.errors import AccudiffError, first_line


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
