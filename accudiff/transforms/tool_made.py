"""A candidate the user made with another tool (ModelOpt, ONNX Runtime's quantizer, a converter), taken as
it is: checked to be a version of the reference model, its tensors aligned with the reference's.

Alignment is structural, never fuzzy. A reference tensor is compared with the candidate's tensor of the
same name; where the candidate has none, with the output at the same position of the candidate's node of
the same name (a tool that renamed a node's output), renamed in the copy that runs. Where the candidate
only stores a value differently (a Q/DQ pair, a Cast), the value keeps its name on the node's own result,
which is what is compared; graph outputs are compared as the candidate returns them. A reference tensor
left without a partner is listed with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import onnx

from accudiff.deferred import Deferred
from accudiff.errors import AccudiffError
from accudiff.model.formats import GRIDS, REDUCED_FLOATS, QuantRange, grid_type, model_formats, precision_label, quant_ranges
from accudiff.model.constant_rounding import ConstantRounding, overflow_text, underflow_text
from accudiff.model.graph import GraphIndex, cast_target, constant_values, value_types, writers_of
from accudiff.model.decoder import find_decoder, genai_config, model_name
from accudiff.model.inventory import ModelInfo
from accudiff.model.quantized_ops import GENAI_BUILDER, find_quantized_ops, quantized_members
from accudiff.model.quantized_weights import copied, per_tensor_loss, quantized_weight_findings
from accudiff.model.weights import weight_blocks, weight_values
from accudiff.transforms.base import KeptNode, NodeSelector, TransformResult
from accudiff.transforms.fp16 import HALVES
from accudiff.transforms.keep_float import FLOAT_TYPES, STORAGE_OPS, keep_in_float


@dataclass(frozen=True)
class Alignment:
    """How the candidate's tensors answer for the reference's."""

    renamed: dict[str, str]  # the candidate's tensor -> the reference tensor it is compared as
    unmatched: dict[str, str]  # a reference tensor -> why the candidate has no partner for it
    inside: dict[str, str] = field(default_factory=dict)  # an unmatched reference tensor a fused node computes inside -> that node, in words


def adopt(candidate: ModelInfo, reference: ModelInfo, keep_fp32: Iterable[str] = ()) -> TransformResult:
    """The user's candidate as the run compares it: checked against the reference, aligned (renamed in
    place), with the nodes `keep_fp32` selects kept in FP32 (keep_float.py)."""
    require_derived(candidate, reference)
    graph = candidate.proto.graph
    alignment = align(graph, reference)
    _rename(graph, alignment.renamed)
    _rename_nodes(graph, reference_node_names(graph, reference.proto.graph))
    selector = NodeSelector(keep_fp32)
    ours = GraphIndex.of(reference.proto.graph)
    kept = [KeptNode(node.name, node.op_type, f"selected by --keep-fp32 {pattern}")
            for node in keepable_nodes(GraphIndex.of(graph), ours) if (pattern := selector.matches(node)) is not None]
    model = keep_in_float(candidate.proto, reference.proto, [k.node for k in kept]) if kept else candidate.proto
    index = GraphIndex.of(model.graph)
    ops = find_quantized_ops(index, ours)
    built_by_genai = genai_config(candidate.path) is not None  # its quantizer ran inside the builder: exclusions go through the builder
    warnings = []
    if alignment.unmatched:
        warnings.append(f"{len(alignment.unmatched)} of the model's {len(reference.tensors)} tensors have no partner in the candidate "
                        f"({_reasons_in_short(alignment.unmatched)}): they are listed as not observed")
    return TransformResult(
        model=model,
        precision=precision_label(model_formats(candidate.proto.graph)),
        kept=kept,
        converted=reduced_nodes(index) | {name for op in ops for name in op.names},
        quant_ranges={**_by_reference_name(quant_ranges(index), index),
                      **{op.inputs[0]: QuantRange.at_run_time(op.run_time_levels, "UINT8") for op in ops if op.run_time_levels}},
        warnings=warnings,
        unmatched=alignment.unmatched,
        inside=alignment.inside,
        weight_findings=_measured_apart(per_tensor_weights(index, ours), quantized_weight_findings(ops, index, ours)),
        constant_findings=half_constant_findings(index, ours),
        quantized_by={name: GENAI_BUILDER if built_by_genai else op.tool for op in ops for name in op.names},
        reads_constant_weights=constant_weight_readers(reference.proto.graph),
    )


def _measured_apart(*measures: Callable[[], dict[str, tuple[str, str]]]) -> Deferred[str, tuple[str, str]]:
    """The weight findings, measured on a thread (deferred.py): the caller saves the candidate meanwhile, then
    waits for the comparison; only the judge reads them."""
    return Deferred(lambda: {node: said for measure in measures for node, said in measure().items()})


def constant_weight_readers(graph: onnx.GraphProto) -> set[str]:
    """The nodes that read a floating-point weight a Constant node holds (exporters such as paddle2onnx
    write every weight so): onnxconverter-common's node_block_list keeps a blocked node's initializers in
    FP32 but converts such a Constant to FP16 and casts it back, so blocking the node alone repairs
    nothing its weight's rounding causes."""
    held = {node.output[0] for node in graph.node if node.op_type == "Constant" and node.output
            and any(a.name == "value" and a.t.data_type in FLOAT_TYPES for a in node.attribute)}
    return {node.name for node in graph.node if held.intersection(node.input)}


def keepable_nodes(graph: GraphIndex, reference: GraphIndex) -> list[onnx.NodeProto]:
    """The nodes a keep-list can name in a candidate: those that compute (not the ones that only store a
    value), with each quantized op as its float node (its own nodes are not keepable on their own)."""
    ops = find_quantized_ops(graph, reference)
    members = quantized_members(ops)
    nodes = [node for node in graph.graph.node if node.op_type not in STORAGE_OPS and node.name not in members]
    return nodes + [onnx.helper.make_node(op.op_type, [], [], name=name) for op in ops for name in op.names]


def reference_node_names(graph: onnx.GraphProto, reference: onnx.GraphProto) -> dict[str, str]:
    """Nodes a tool renamed: a node the reference lacks, that writes a value the reference's node of the same
    op type writes, answers for that node (MatMulNBitsQuantizer's QDQ form writes `X_matmul_Q4` for `X`).
    The candidate's name -> the reference's."""
    ours = {node.name for node in reference.node}
    theirs = {node.name for node in graph.node}
    writer = writers_of(reference.node)
    renamed = {}
    for node in graph.node:
        if node.name in ours or not node.output or node.output[0] not in writer:
            continue
        original = writer[node.output[0]]
        if original.op_type == node.op_type and original.name not in theirs and original.name not in renamed.values():
            renamed[node.name] = original.name
    return renamed


def _rename_nodes(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    for node in graph.node:
        node.name = renamed.get(node.name, node.name)


def require_derived(candidate: ModelInfo, reference: ModelInfo) -> None:
    """A candidate is a version of the model: the same graph inputs and outputs, each float where the
    model's is float (any float type) and of the same type otherwise; one sentence if not."""
    theirs, ours = model_name(candidate.path), model_name(reference.path)
    for what, mine, other in (
        ("inputs", {spec.name for spec in reference.inputs}, {spec.name for spec in candidate.inputs} - decoder_position_input(candidate, reference)),
        ("outputs", set(reference.output_names), set(candidate.output_names)),
    ):
        if mine != other:
            raise AccudiffError(
                f"'{theirs}' is not a version of '{ours}': its graph {what} are {_names(other)} where the model's are {_names(mine)} "
                "(--candidate-model takes the model as another tool quantized or converted it, with the same inputs and outputs)"
            )
    kinds = {t.name: t.dtype for t in candidate.tensors} | {spec.name: spec.dtype for spec in candidate.inputs}
    decoder = find_decoder(reference.path, reference.inputs, reference.output_names)
    cache = {name for pair in (decoder.cache if decoder is not None else ()) for name in pair}
    for name, dtype in [*((t.name, t.dtype) for t in reference.tensors if t.is_output), *((s.name, s.dtype) for s in reference.inputs)]:
        if name in kinds and not _same_kind(dtype, kinds[name]):
            if name in cache:  # a quantized KV cache: its codes are no version of the values, and are scaled inside the attention
                raise AccudiffError(f"'{theirs}' stores its KV cache in {kinds[name]} ('{name}', where the model's holds {dtype}: a quantized KV cache, "
                                    "as the GenAI builder's kv_cache_quant_scheme makes one), which accudiff does not compare yet; compare the "
                                    "candidate built without it")
            raise AccudiffError(f"'{theirs}' is not a version of '{ours}': its '{name}' holds {kinds[name]} values where the model's holds {dtype}")


def decoder_position_input(candidate: ModelInfo, reference: ModelInfo) -> set[str]:
    """The positions input a decoder's candidate reads where its reference computes them inside (the GenAI
    builder's fp16 graph reads position_ids, its fp32 one does not): the generation feeds it, so it is no
    difference between the two."""
    theirs, ours = (find_decoder(info.path, info.inputs, info.output_names) for info in (candidate, reference))
    if theirs is None or ours is None or theirs.position_ids is None or ours.position_ids is not None:
        return set()
    return {theirs.position_ids}


def align(graph: onnx.GraphProto, reference: ModelInfo) -> Alignment:
    """The candidate tensor that answers for each reference tensor (see the module's docstring). A value of
    the same name counts when the candidate computes it in the same node, or only stores it (a Cast, a Q/DQ
    pair) or computes it in a node the reference does not have; not when another of the reference's nodes
    writes it: a quantizer that folds a Relu into the Q/DQ pair after a BatchNormalization has that node
    write the Relu's name, and the value is the BatchNormalization's."""
    producer = writers_of(graph.node)
    nodes = {node.name: node for node in graph.node}
    types = value_types(graph)
    ours = {t.name: t for t in reference.tensors}
    folded = _computed_from_weights(reference.proto.graph)

    def same_value(tensor) -> bool:
        node = producer[tensor.name]
        return node.name == tensor.node or node.op_type in STORAGE_OPS | {"Identity"} or node.name not in reference.nodes

    ranks, reference_ranks = _ranks(graph), _ranks(reference.proto.graph)
    exact = {t.name for t in reference.tensors if t.name in producer and same_value(t) and _same_kind(t.dtype, _np(types.get(t.name)))
             and ranks.get(t.name, reference_ranks.get(t.name)) == reference_ranks.get(t.name, ranks.get(t.name))}
    taken = (set(producer) - (set(ours) - exact)) | {vi.name for vi in graph.input} | set(constant_values(graph))
    renamed: dict[str, str] = {}
    unmatched: dict[str, str] = {}
    for tensor in reference.tensors:
        if tensor.name in exact:
            continue
        theirs, summary = nodes.get(tensor.node), reference.nodes.get(tensor.node)
        if theirs is None:
            unmatched[tensor.name] = _why_missing(tensor, folded, producer.get(tensor.name))
            continue
        position = summary.outputs.index(tensor.name) if summary is not None and tensor.name in summary.outputs else -1
        partner = theirs.output[position] if 0 <= position < len(theirs.output) else ""
        if partner and partner not in exact and partner not in renamed and tensor.name not in taken and _same_kind(tensor.dtype, _np(types.get(partner))):
            renamed[partner] = tensor.name
            taken.add(tensor.name)
        else:
            kind = _np(types.get(tensor.name)) if tensor.name in producer else None
            rank, theirs_rank = reference_ranks.get(tensor.name), ranks.get(tensor.name)
            unmatched[tensor.name] = (f"the candidate's value of that name holds {kind} values, the reference's {tensor.dtype}" if kind is not None
                                      and not _same_kind(tensor.dtype, kind) else
                                      f"the candidate's value of that name has {theirs_rank} dimensions, the reference's {rank}: another value"
                                      if None not in (rank, theirs_rank) and rank != theirs_rank and tensor.name in producer else
                                      f"its node '{tensor.node}' in the candidate has no output that can answer for it")
    inside = held_inside(graph, reference, set(unmatched), {*exact, *renamed.values()})
    for name, node in inside.items():
        unmatched[name] = f"computed inside the candidate's fused {node}, whose output is compared"
    return Alignment(renamed, unmatched, inside)


def held_inside(graph: onnx.GraphProto, reference: ModelInfo, unmatched: set[str], matched: set[str]) -> dict[str, str]:
    """The reference tensors a candidate computes inside nodes of its own (a fused Attention,
    SkipLayerNormalization, BiasGelu...), each with the node, in words. A fused node holds the unmatched
    tensors found walking back over the reference's graph from the outputs it answers for, up to the
    tensors the candidate has; one that several fused nodes reach through a value they all read from
    another fused node (the embeddings, the attention mask) is that node's."""
    fused = [node for node in graph.node if node.name not in reference.nodes and node.op_type not in STORAGE_OPS]
    producer = {out: node for node in fused for out in node.output if out}
    reached: dict[str, list[onnx.NodeProto]] = {}
    for node in fused:
        stack = [parent for out in node.output if out in matched for parent in reference.upstream.get(out, [])]
        seen = set()
        while stack:
            name = stack.pop()
            if name in seen or name not in unmatched:
                continue
            seen.add(name)
            reached.setdefault(name, []).append(node)
            stack += reference.upstream.get(name, [])
    held = {}
    for name, owners in reached.items():
        shared = set.intersection(*({producer[i].name for i in owner.input if i in producer} for owner in owners)) if len(owners) > 1 else set()
        owner = next((producer_node for producer_node in fused if producer_node.name in shared), owners[0])
        held[name] = f"{owner.op_type} '{owner.name}'"
    return held


def _why_missing(tensor, folded: set[str], writer: onnx.NodeProto | None) -> str:
    """Why a reference tensor whose node the candidate lacks has no partner."""
    if tensor.name in folded:
        return "computed from weights only: folded into a constant by the tool that made the candidate"
    text = f"its node '{tensor.node}' ({tensor.op_type}) is not in the candidate: removed or fused by the tool that made it"
    if writer is not None:
        text += f"; the candidate's {writer.op_type} '{writer.name}' writes its name, computing another value"
    return text


def per_tensor_weights(index: GraphIndex, reference: GraphIndex) -> Callable[[], dict[str, tuple[str, str]]]:
    """Nodes reading a weight quantized with one scale for all its channels where some channel's values
    all fall below half the grid's smallest step, and so become 0 (per-channel scales would keep them):
    node -> ("per_tensor_scale", what happens, in words). The float weight is the one before the Q/DQ pair, else the reference's
    at the same input of its node of the same name; a weight known only quantized is not judged. Returned as the
    measuring still to do, on copies of the weights' tensors (see quantized_weight_findings)."""
    producer, constants, types = index.producer, index.constants, index.types
    theirs = {node.name: node for node in reference.graph.node}
    reference_weights = reference.constants
    checks = []
    for node in index.graph.node:
        if node.op_type in STORAGE_OPS:
            continue
        for position, name in enumerate(node.input):
            dequantize = producer.get(name)
            if dequantize is None or dequantize.op_type != "DequantizeLinear" or dequantize.input[1] not in constants:
                continue
            scale = weight_values(constants[dequantize.input[1]]).astype(np.float64)
            quantize = producer.get(dequantize.input[0])
            source = quantize.input[0] if quantize is not None and quantize.op_type == "QuantizeLinear" else None
            if scale.size != 1 or (source is None and dequantize.input[0] not in constants):
                continue
            weight = constants.get(source) if source is not None else None
            if weight is None and node.name in theirs and position < len(theirs[node.name].input):
                weight = reference_weights.get(theirs[node.name].input[position])
            grid = GRIDS.get(grid_type(dequantize, types) or (grid_type(quantize, types) if quantize is not None else None))
            if weight is None or grid is None:
                continue
            held = producer.get(source) if source is not None else None
            checks.append((node.name, copied(weight), node.op_type, grid.smallest * float(scale.reshape(())), grid.name, held is not None and held.op_type == "Constant"))

    def measure() -> dict[str, tuple[str, str]]:
        found = {}
        for node, weight, op_type, step, grid, in_constant in checks:
            said = per_tensor_loss(weight, op_type, step, grid, weight.name)
            if said and in_constant:
                said += ("; the weight is held by a Constant node, which ModelOpt's and ONNX Runtime's quantizers quantize as they do an "
                         "activation, with one scale, even where they give a weight held as an initializer a scale per channel (ModelOpt's "
                         "default, quantize_static's per_channel=True)")
            if said:
                found[node] = ("per_tensor_scale", said)
        return found

    return measure


def half_constant_findings(index: GraphIndex, reference: GraphIndex) -> dict[str, list[tuple[str, str]]]:
    """What the candidate's FP16/BF16 constants hold where the float ones are finite and nonzero (as
    to_fp16 reports its own: constant_rounding.py), by the node reading them: a constant stored in the
    format (its float values: the reference's constant of the same name; read as it is or cast to FP32),
    or cast to it as the model runs."""
    halves = {half.elem_type: half for half in HALVES.values()}
    constants, theirs, producer = index.constants, reference.constants, index.producer
    widened = index.widened_constants(halves)
    found: dict[str, list[tuple[str, str]]] = {}
    for node in index.graph.node:
        if node.op_type in STORAGE_OPS:
            continue
        for name in dict.fromkeys(node.input):
            cast = producer.get(name)
            name = widened.get(name, name)
            if name in constants and name in theirs and constants[name].data_type in halves and theirs[name].data_type == onnx.TensorProto.FLOAT:
                half, rounding = halves[constants[name].data_type], ConstantRounding()
                for wide, narrow in zip(weight_blocks(theirs[name], ROUNDING_BLOCK * 4), weight_blocks(constants[name], ROUNDING_BLOCK * 2)):
                    rounding.add(wide, narrow.astype(np.float32))
            elif cast is not None and cast.op_type == "Cast" and cast_target(cast) in halves and constants.get(cast.input[0], onnx.TensorProto()).data_type == onnx.TensorProto.FLOAT:
                half, rounding, name = halves[cast_target(cast)], ConstantRounding(), cast.input[0]
                for wide in weight_blocks(constants[name]):
                    rounding.add(wide, half.as_float32(half.values(wide)))
            else:
                continue
            if rounding.to_inf:
                found.setdefault(node.name, []).append(("constant_overflow", overflow_text(name, rounding, node.op_type, half.label, half.maximum, happened=True)))
            if rounding.underflow_matters:
                found.setdefault(node.name, []).append(("constant_underflow", underflow_text(name, rounding, half.label, half.smallest)))
    return found


ROUNDING_BLOCK = 1 << 20  # values read at a time from each side of a constant


def reduced_nodes(index: GraphIndex) -> set[str]:
    """The candidate's nodes that compute in reduced precision: those reading a dequantized value (TensorRT
    runs them quantized) or an FP16/BF16 one (a weight stored so, even cast to FP32 as the model runs), or
    writing FP16/BF16 (Casts, Q/DQ and Constants only store), or a graph output a Q/DQ pair quantizes (ONNX
    Runtime's quantizer writes those; a decoder's KV cache stored in INT8). Kept, each is undone
    (keep_float.py)."""
    types = index.types
    dequantized = {out for node in index.graph.node if node.op_type == "DequantizeLinear" for out in node.output} | set(index.widened_constants(REDUCED_FLOATS))
    reduced = {
        node.name for node in index.graph.node
        if node.op_type not in STORAGE_OPS and any(types.get(out) in FLOAT_TYPES for out in node.output)
        and any(name in dequantized or types.get(name) in REDUCED_FLOATS for name in [*node.input, *node.output] if name)
    }
    for output in index.outputs:
        dequantize = index.made_by(output, "DequantizeLinear")
        quantize = dequantize and index.made_by(dequantize.input[0], "QuantizeLinear")
        writer = quantize and index.producer.get(quantize.input[0])
        if writer is not None and writer.op_type not in STORAGE_OPS:
            reduced.add(writer.name)
    return reduced


def _by_reference_name(ranges: dict, index: GraphIndex) -> dict:
    """Quantization ranges keyed by the value the reference knows: a Q reading a Cast of a tensor (ModelOpt
    casts the graph input to FP16 before quantizing it) quantizes that tensor; a Q/DQ pair writing a graph
    output (a KV cache stored in INT8) quantizes that output."""
    producer = index.producer
    resolved = {}
    for name, grid in ranges.items():
        node = producer.get(name)
        written = [dq.output[0] for q in index.readers.get(name, []) if q.op_type == "QuantizeLinear"
                   for dq in index.readers.get(q.output[0], []) if dq.op_type == "DequantizeLinear" and dq.output[0] in index.outputs]
        resolved[node.input[0] if node is not None and node.op_type == "Cast" else written[0] if written else name] = grid
    return resolved


def _computed_from_weights(graph: onnx.GraphProto) -> set[str]:
    """The values a graph computes from its weights alone (a tool folds them into constants)."""
    known = set(constant_values(graph))
    found = set()
    for node in graph.node:
        if node.op_type != "Constant" and node.input and all(not name or name in known for name in node.input):
            known.update(node.output)
            found.update(node.output)
    return found


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """The number of dimensions of each value whose shape the graph declares."""
    return {vi.name: len(vi.type.tensor_type.shape.dim) for vi in [*graph.input, *graph.value_info, *graph.output]
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}


def _rename(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    if not renamed:
        return
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
    for vi in [*graph.value_info, *graph.output]:
        vi.name = renamed.get(vi.name, vi.name)


def _same_kind(ours, theirs) -> bool:
    """Comparable values: both floating point (of any width), or of the same type."""
    if ours is None or theirs is None:
        return True
    ours, theirs = np.dtype(ours), np.dtype(theirs)
    floating = lambda kind: np.issubdtype(kind, np.floating) or kind.name in ("bfloat16",)  # noqa: E731
    return (floating(ours) and floating(theirs)) or ours == theirs


def _np(elem_type: int | None):
    return None if not elem_type else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def _names(names: set[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in sorted(names)[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "") if names else "none"


def _reasons_in_short(unmatched: dict[str, str]) -> str:
    folded = sum(1 for why in unmatched.values() if why.startswith("computed from weights"))
    removed = sum(1 for why in unmatched.values() if "removed or fused" in why)
    inside = sum(1 for why in unmatched.values() if why.startswith("computed inside"))
    other = len(unmatched) - folded - removed - inside
    parts = [f"{folded} folded into constants" if folded else "", f"{removed} whose nodes the tool removed or fused" if removed else "",
             f"{inside} computed inside fused nodes, compared at their outputs" if inside else "",
             f"{other} that no output of their node answers for" if other else ""]
    return ", ".join(p for p in parts if p)
