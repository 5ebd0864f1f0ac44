"""A brute-force attribution oracle, written independently of accudiff's isolation and diagnosis code.

For every node of the original model, one node at a time: run that node alone in ONNX Runtime (FP32), fed
the FP32 reference values of its inputs as the candidate would see them when only this node runs in
reduced precision, and judge its output against the reference:

* FP16: a converted node reads its floating-point inputs stored in FP16 (numpy rounding: overflow to Inf,
  subnormals), computes, and stores its output in FP16;
* INT8: a quantized node reads each input through the Q/DQ pair the candidate model puts in front of it
  (fake-quantised here with numpy from the candidate's scales), and its weights as the candidate
  dequantises them.

The cause of a failing output is then the first node, in topological order, among that output's ancestors
whose output leaves tolerance when it alone runs in reduced precision. Nothing here imports accudiff: the
tolerance is the README's, the failing outputs are the oracle's own; only the facts of the candidate
(which nodes FP16 converts, the INT8 Q/DQ model) come from accudiff's report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

FLOAT = onnx.TensorProto.FLOAT
README = Path(__file__).resolve().parents[1] / "README.md"


def documented_tolerance(precision: str) -> tuple[float, float, float]:
    """(atol, rtol, stol) of `precision`, read from the README's table of default tolerances: what a user is
    told, not what accudiff's result says it used."""
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and precision in [p.strip() for p in cells[0].split(",")]:
            return tuple(float(c) for c in cells[1:])
    raise LookupError(f"the README has no default tolerance for {precision}")


def graph_outputs(model: Path | onnx.ModelProto) -> list[str]:
    return [o.name for o in _loaded(model).graph.output]


def float_path_around(model: Path | onnx.ModelProto, start: str, node_name: str, output: str, values: dict[str, np.ndarray]) -> bool:
    """Whether `start`'s values reach `output` through float values only (`values`: the reference's) by a path
    that avoids every output of the node `node_name`: an error it undoes would still reach the output."""
    graph = _loaded(model).graph
    avoided = {out for node in graph.node if node.name == node_name for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    seen, stack = {start}, [start]
    while stack:
        for node in readers.get(stack.pop(), []):
            for out in node.output:
                if out in seen or out in avoided or not np.issubdtype(np.asarray(values.get(out, 0.0)).dtype, np.floating):
                    continue
                if out == output:
                    return True
                seen.add(out)
                stack.append(out)
    return False


@dataclass
class NodeVerdict:
    node: str
    op_type: str
    tensor: str
    fails_alone: bool
    max_error: float


def reference_values(model_path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value of the main graph (graph inputs, weights, Constant outputs and node outputs) in FP32."""
    model = onnx.load(str(model_path))
    model = onnx.shape_inference.infer_shapes(model)
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    values.update(feed)
    known = {o.name for o in model.graph.output}
    for node in model.graph.node:
        model.graph.output.extend(onnx.ValueInfoProto(name=o) for o in node.output if o and o not in known)
    names = [o.name for o in model.graph.output]
    session = _session(model)
    values.update(zip(names, session.run(names, feed)))
    return values


def node_verdicts(
    model_path: Path,
    values: dict[str, np.ndarray],
    precision: str,
    tolerance: tuple[float, float, float],
    kept: set[str] = frozenset(),
    candidate_path: Path | None = None,
) -> list[NodeVerdict]:
    """For each node (topological order), whether its output fails when only it runs in reduced precision."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path)))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    quantized = _quantized_inputs(candidate_path) if precision == "int8" else {}
    verdicts = []
    for index, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        if node.op_type == "Constant" or not node.output or not node.output[0]:
            continue
        reduced = name not in kept
        inputs = {}
        for position, value_name in enumerate(node.input):
            if not value_name:
                continue
            value = values[value_name]
            if reduced and precision == "fp16" and value.dtype == np.float32 and _allows(node, position, opset, "inputs"):
                with np.errstate(over="ignore"):
                    value = value.astype(np.float16).astype(np.float32)
            if reduced and precision == "int8" and (name, position) in quantized:
                value = quantized[(name, position)](value)
            inputs[value_name] = value
        outputs = _run_alone(node, inputs, opset)
        worst, failing, tensor = 0.0, False, node.output[0]
        for position, out in enumerate(node.output):
            if not out or out not in values or not np.issubdtype(values[out].dtype, np.floating):
                continue
            produced = outputs[out]
            if reduced and precision == "fp16" and _allows(node, position, opset, "outputs"):
                with np.errstate(over="ignore"):
                    produced = produced.astype(np.float16).astype(np.float32)
            error, out_of_tolerance = _judge(values[out], produced, tolerance)
            if out_of_tolerance and not failing:
                tensor = out
            failing |= out_of_tolerance
            worst = max(worst, error)
        verdicts.append(NodeVerdict(name, node.op_type, tensor, failing, worst))
    return verdicts


def cause(model_path: Path, output: str, verdicts: list[NodeVerdict]) -> NodeVerdict | None:
    """The first node (topological order) upstream of `output` that fails when it alone runs in reduced precision."""
    model = onnx.load(str(model_path))
    producer = {o: (n.name or f"{n.op_type}_{i}", n) for i, n in enumerate(model.graph.node) for o in n.output}
    ancestors, stack = set(), [output]
    while stack:
        name = stack.pop()
        if name in producer and producer[name][0] not in ancestors:
            node_name, node = producer[name]
            ancestors.add(node_name)
            stack.extend(node.input)
    return next((v for v in verdicts if v.node in ancestors and v.fails_alone), None)


def _judge(ref: np.ndarray, cand: np.ndarray, tolerance: tuple[float, float, float]) -> tuple[float, bool]:
    """(worst absolute error, whether any element is out of tolerance)."""
    error, allowed = _errors(ref, cand, tolerance)
    return float(error.max(initial=0.0)), bool((error > allowed).any())


def _errors(ref: np.ndarray, cand: np.ndarray, tolerance: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """|cand - ref| per element (0 where both hold the same NaN/Inf, Inf where only one is NaN) and the
    tolerance each element is allowed: atol + rtol·|ref| + stol·absmax(ref)."""
    atol, rtol, stol = tolerance
    ref, cand = ref.astype(np.float64), cand.astype(np.float64)
    finite = np.isfinite(ref)
    absmax = float(np.abs(ref[finite]).max()) if finite.any() else 0.0
    with np.errstate(invalid="ignore"):
        error = np.abs(cand - ref)
    same_non_finite = (np.isnan(ref) & np.isnan(cand)) | (np.isinf(ref) & (ref == cand))
    error = np.where(same_non_finite, 0.0, np.nan_to_num(error, nan=np.inf))
    return error, atol + rtol * np.abs(ref) + stol * absmax


def _run_alone(node: onnx.NodeProto, inputs: dict[str, np.ndarray], opset: int) -> dict[str, np.ndarray]:
    graph = helper.make_graph(
        [node],
        "alone",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape) for name, value in inputs.items()],
        [onnx.ValueInfoProto(name=o) for o in node.output if o],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    outputs = [o for o in node.output if o]
    return dict(zip(outputs, _session(model).run(outputs, inputs)))


def _session(model: onnx.ModelProto, optimized: bool = False) -> ort.InferenceSession:
    """A plain session of `model`, unoptimized (FP16 emulated by Cast pairs stays as written), or
    `optimized` as ONNX Runtime runs a model by default, but for its Q/DQ pairs, computed as written (not
    fused into ONNX Runtime's integer kernels, whose numbers differ between CPUs)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def integer_kernels_saturate() -> bool:
    """Whether this CPU's ONNX Runtime adds UINT8 x INT8 products in 16 bits, which saturates (x86 without
    VNNI): a MatMulInteger of 64 products of 255 x 127, against their exact sum."""
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe", [helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [1, 1])], [numpy_helper.from_array(np.full((64, 1), 127, np.int8), "b")])
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8))
    return int(session.run(None, {"a": np.full((1, 64), 255, np.uint8)})[0].reshape(())) != 64 * 255 * 127


def _allows(node: onnx.NodeProto, position: int, opset: int, side: str, half_type: str = "tensor(float16)") -> bool:
    """Whether `node`'s schema lets the value at `position` (of its inputs or outputs) take `half_type`; an op
    ONNX has no schema for never does."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return False
    formals = getattr(schema, side)
    type_str = formals[min(position, len(formals) - 1)].type_str
    allowed = next((c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == type_str), [])
    return half_type in allowed


def _quantized_inputs(candidate_path: Path) -> dict[tuple[str, int], callable]:
    """(node, input position) -> the fake-quantisation the INT8 candidate applies to that input."""
    model = onnx.load(str(candidate_path))
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    result = {}
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for position, name in enumerate(node.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            source = dq.input[0]
            if source in initializers:  # a quantized weight: the candidate's dequantised values
                result[(node.name, position)] = _constant(_dequantize(dq, initializers))
                continue
            q = producer.get(source)
            if q is not None and q.op_type == "QuantizeLinear":
                result[(node.name, position)] = _fake_quant(q, initializers)
    return result


def _constant(value: np.ndarray):
    return lambda _: value


def _dequantize(dq: onnx.NodeProto, initializers) -> np.ndarray:
    q, scale = initializers[dq.input[0]].astype(np.float32), initializers[dq.input[1]]
    zero = initializers[dq.input[2]].astype(np.float32) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale)
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    if scale.size > 1:
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return ((q - zero) * scale).astype(np.float32)


def _fake_quant(q: onnx.NodeProto, initializers):
    scale = float(initializers[q.input[1]].reshape(()))
    zero_point = initializers[q.input[2]] if len(q.input) > 2 and q.input[2] else np.int8(0)
    info = np.iinfo(zero_point.dtype)
    zero = float(zero_point.reshape(()))

    def apply(value: np.ndarray) -> np.ndarray:
        levels = np.clip(np.rint(value / scale) + zero, info.min, info.max)
        return ((levels - zero) * scale).astype(np.float32)

    return apply


# --- Keep-one-node oracle: every converted node stores in FP16 but one (and what its boundaries need) ---

FP16 = onnx.TensorProto.FLOAT16
FP16_LARGEST = 65504.0
FP16_TINY = 6.1e-5
UNDERFLOW_SHARE = 0.01  # docs/causes.md: a kept node's output with >=1% of its values nonzero but below FP16_TINY keeps its readers


HALF = {"fp16": (FP16, "tensor(float16)"), "bf16": (onnx.TensorProto.BFLOAT16, "tensor(bfloat16)")}


def output_ratios(model: Path | onnx.ModelProto, values: dict[str, np.ndarray], feed: dict[str, np.ndarray], reduced: set[str], keep: set[str],
                  tolerance: tuple[float, float, float], outputs: list[str], half: str = "fp16") -> dict[str, float]:
    """Each graph output's worst |cand - ref| / tolerance when the nodes `reduced - keep` read and write
    their float values rounded to FP16 or BF16 (`half`: Cast to it and back on every such edge; arithmetic
    in FP32, as ONNX Runtime's CPU provider does) and every other node runs in FP32. `model`: a file, or a
    loaded model (left unchanged)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(_loaded(model))
    model = _rounded_model(copy, values, reduced - keep, half)
    names = list(outputs)
    produced = dict(zip(names, _session(model).run(names, feed)))
    return {name: _ratio(values[name], produced[name], tolerance) for name in names}


def converted_nodes(model: Path | onnx.ModelProto, values: dict[str, np.ndarray], half: str = "fp16", keep_fp32: tuple[str, ...] = (),
                    autokeep: bool = True) -> set[str]:
    """The nodes `--fp16`/`--bf16` converts, as docs/compare.md states the rule (read there, not from
    accudiff): every node (not a Constant, not an If/Loop/Scan: their bodies are) that reads an FP32 value
    at an input its op's schema lets take the format, but those `keep_fp32` names, and with autokeep those that read a constant the format holds as ±Inf, then,
    round after round, the readers of a kept node's output whose values (`values`: the FP32 model's on the
    samples) the format holds as ±Inf."""
    model = _loaded(model)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    _, type_str = HALF[half]
    nodes = {(n.name or f"{n.op_type}_{i}"): n for i, n in enumerate(model.graph.node)}
    floats = {name for name, value in values.items() if value.dtype == np.float32}
    has_form = {name for name, node in nodes.items() if node.op_type != "Constant" and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
                and any(i in floats and _allows(node, p, opset, "inputs", type_str) for p, i in enumerate(node.input))}
    reduced = has_form - set(keep_fp32)
    if not autokeep:
        return reduced
    constants = {init.name for init in model.graph.initializer} | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    beyond = {name for name, value in values.items() if np.issubdtype(value.dtype, np.floating) and _beyond(value, half)}
    kept = {name for name in reduced if any(i in constants and i in beyond for i in nodes[name].input)}
    while True:
        readers = {name for name in reduced - kept
                   if any(i in beyond and i not in constants and any(i in nodes[k].output for k in kept) for i in nodes[name].input)}
        if not readers:
            return reduced - kept
        kept |= readers


def _beyond(value: np.ndarray, half: str) -> bool:
    """Whether a finite value of `value` becomes ±Inf in `half` (FP16: numpy's rounding; BF16: the upper 16
    bits of FP32, rounded to nearest even)."""
    finite = value[np.isfinite(value)].astype(np.float32)
    if not finite.size:
        return False
    if half == "fp16":
        with np.errstate(over="ignore"):
            return bool(np.isinf(finite.astype(np.float16)).any())
    bits = finite.view(np.uint32).astype(np.uint64)
    rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return bool(np.isinf(rounded).any())


def closed_keep(model: Path | onnx.ModelProto, values: dict[str, np.ndarray], reduced: set[str], keep: set[str], half: str = "fp16") -> set[str]:
    """`keep` plus the reduced nodes that read a kept node's output FP16 cannot hold (beyond 65504, or
    1% or more of its nonzero values below FP16's normal range), transitively. BF16 holds FP32's range."""
    if half == "bf16":
        return set(keep)
    model = _loaded(model)
    nodes = {(n.name or f"{n.op_type}_{i}"): n for i, n in enumerate(model.graph.node)}
    closed, queue = set(keep), list(keep)
    while queue:
        node = nodes[queue.pop()]
        for out in node.output:
            value = values.get(out)
            if value is None or not np.issubdtype(value.dtype, np.floating) or not _unfit(value):
                continue
            for name, reader in nodes.items():
                if name in reduced and name not in closed and out in reader.input:
                    closed.add(name)
                    queue.append(name)
    return closed


def single_keep_ranking(model_path: Path, values, feed, reduced: set[str], tolerance, output: str, half: str = "fp16") -> list[tuple[float, str]]:
    """(the output's ratio, node) for each reduced node kept alone (closed over boundaries), best first."""
    model = onnx.load(str(model_path))
    ranking = []
    for node in sorted(reduced):
        keep = closed_keep(model, values, reduced, {node}, half)
        ranking.append((output_ratios(model, values, feed, reduced, keep, tolerance, [output], half)[output], node))
    return sorted(ranking)


def _loaded(model: Path | onnx.ModelProto) -> onnx.ModelProto:
    return model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))


def _unfit(value: np.ndarray) -> bool:
    finite = np.abs(value[np.isfinite(value)])
    if not finite.size:
        return False
    return bool(finite.max() > FP16_LARGEST or ((finite > 0) & (finite < FP16_TINY)).mean() >= UNDERFLOW_SHARE)


def _rounded_model(model: onnx.ModelProto, values: dict[str, np.ndarray], rounded: set[str], half: str = "fp16") -> onnx.ModelProto:
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if half == "bf16" and opset < 13:
        raise ValueError(f"Cast to BF16 needs opset 13; this model is at opset {opset}: give the oracle the model at the opset it was compared at")
    kind, type_str = HALF[half]
    nodes = []
    for index, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        if name not in rounded:
            nodes.append(node)
            continue
        for position, value_name in enumerate(node.input):
            value = values.get(value_name)
            if value_name and value is not None and value.dtype == np.float32 and _allows(node, position, opset, "inputs", type_str):
                stored = f"{value_name}__{half}_for_{name}_{position}"
                nodes += _round_trip(value_name, stored, kind)
                node.input[position] = stored
        outs = []
        for position, out in enumerate(node.output):
            value = values.get(out)
            if out and value is not None and value.dtype == np.float32 and _allows(node, position, opset, "outputs", type_str):
                raw = f"{out}__fp32_raw"
                node.output[position] = raw
                outs += _round_trip(raw, out, kind)
        nodes += [node, *outs]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _round_trip(source: str, target: str, kind: int = FP16) -> list[onnx.NodeProto]:
    middle = f"{target}__as_half"
    return [helper.make_node("Cast", [source], [middle], to=kind), helper.make_node("Cast", [middle], [target], to=FLOAT)]


def _ratio(ref: np.ndarray, cand: np.ndarray, tolerance: tuple[float, float, float]) -> float:
    error, allowed = _errors(ref, cand, tolerance)
    with np.errstate(over="ignore"):  # an Inf error over a tiny tolerance is an infinite ratio, as meant
        return float((error / allowed).max(initial=0.0))


# --- Keep-one-node oracle, INT8: the candidate's Q/DQ model with one quantized node reading FP32 again ---


def int8_candidate(model_path: Path, calibration: list[dict[str, np.ndarray]], target: Path, as_initializers: bool = True) -> Path:
    """The INT8 candidate `--int8` builds, as docs/compare.md states it, made here with ONNX Runtime's
    quantize_static (not by accudiff): Q/DQ, symmetric INT8 activations and weights, per-channel weights,
    the inputs of Conv/ConvTranspose/MatMul/Gemm quantized and not their outputs, no other op reading the
    quantized copy, biases left in FP32, calibrated (min/max) on `calibration`; a model below opset 13
    (per-channel Q/DQ) upgraded to it. Weights Constant nodes hold are made initializers first (the
    quantizer quantizes any other weight as an activation, per tensor); `as_initializers=False` leaves them,
    as a user running the quantizer on such a model (paddle2onnx's) gets it."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(calibration)

        def get_next(self):
            return next(self.feeds, None)

    model = _loaded(model_path)
    if next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) < 13:
        model = onnx.version_converter.convert_version(model, 13)
    ops = ["Conv", "ConvTranspose", "MatMul", "Gemm"]
    weights = {node.input[1] for node in model.graph.node if node.op_type in ops and len(node.input) > 1}
    for node in [n for n in model.graph.node if as_initializers and n.op_type == "Constant" and n.output[0] in weights and n.attribute[0].name == "value"]:
        weight = numpy_helper.from_array(numpy_helper.to_array(node.attribute[0].t), node.output[0])
        model.graph.node.remove(node)
        model.graph.initializer.append(weight)
    source = target.with_suffix(".fp32.onnx")
    onnx.save(model, str(source))
    quantize_static(str(source), str(target), Feeds(), quant_format=QuantFormat.QDQ, op_types_to_quantize=ops, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False, "OpTypesToExcludeOutputQuantization": ops})
    quantized = onnx.load(str(target))
    graph = quantized.graph
    producer = {o: n for n in graph.node for o in n.output}
    float_of = {n.output[0]: producer[n.input[0]].input[0] for n in graph.node
                if n.op_type == "DequantizeLinear" and n.input[0] in producer and producer[n.input[0]].op_type == "QuantizeLinear"}
    for node in graph.node:  # the quantizer shares one pair among a tensor's readers: only the quantized ops read it
        if node.op_type not in (*ops, "QuantizeLinear", "DequantizeLinear"):
            node.input[:] = [float_of.get(name, name) for name in node.input]
    for output in graph.output:  # a graph output is the node's own result, not its quantized copy
        if output.name in float_of:
            renamed = {output.name: output.name + "__quantized_copy", float_of[output.name]: output.name}
            for node in graph.node:
                node.input[:] = [renamed.get(name, name) for name in node.input]
                node.output[:] = [renamed.get(name, name) for name in node.output]
    onnx.save(quantized, str(target))
    return target


def int8_single_keep_ranking(model_path: Path, candidate_path: Path, values, feed, tolerance, output: str) -> list[tuple[float, str]]:
    """(the output's ratio, node) for each node of the INT8 candidate that reads a DequantizeLinear, kept
    alone (`int8_output_ratio`), best first."""
    model, candidate = onnx.load(str(model_path)), onnx.load(str(candidate_path))
    dequantized = {o for n in candidate.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    quantized = [n.name for n in candidate.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear") and any(i in dequantized for i in n.input)]
    return sorted((int8_output_ratio(model, candidate, values, feed, tolerance, output, {name}), name) for name in quantized)


def int8_output_ratio(model: Path | onnx.ModelProto, candidate: Path | onnx.ModelProto, values, feed, tolerance, output: str, keep: set[str]) -> float:
    """`output`'s worst |cand - ref| / tolerance when the INT8 candidate runs in ONNX Runtime with the nodes
    `keep` reading the FP32 model's inputs again (activations unquantized, FP32 weights). Only the
    candidate's facts come from accudiff: its Q/DQ model."""
    original_model = _loaded(model)
    original = {(n.name or f"{n.op_type}_{i}"): n for i, n in enumerate(original_model.graph.node)}
    weights = {init.name: init for init in original_model.graph.initializer}
    weights |= {n.output[0]: numpy_helper.from_array(numpy_helper.to_array(n.attribute[0].t), n.output[0]) for n in original_model.graph.node
                if n.op_type == "Constant" and n.attribute[0].name == "value"}  # a weight the candidate holds as an initializer now
    variant = onnx.ModelProto()
    variant.CopyFrom(_loaded(candidate))
    present = {init.name for init in variant.graph.initializer}
    for node in variant.graph.node:
        if node.name in keep:
            node.input[:] = list(original[node.name].input)
            variant.graph.initializer.extend(weights[i] for i in node.input if i in weights and i not in present)
            present |= set(node.input)
    produced = _session(variant, optimized=True).run([output], feed)[0]  # optimized as ONNX Runtime runs a model
    return _ratio(values[output], produced, tolerance)


# --- Keep-one-node oracle, a candidate made by another tool: one quantized node left unquantized ---


def candidate_single_keep_ranking(model_path: Path, candidate_path: Path, feed, tolerance, output: str) -> list[tuple[float, str]]:
    """(the output's ratio, node) for each node of a candidate made by another tool that reads a
    DequantizeLinear, left unquantized alone (`candidate_output_ratio`), best first. The reference is the
    FP32 model run as it is."""
    model, candidate = onnx.load(str(model_path)), onnx.load(str(candidate_path))
    reference = _session(model).run([output], feed)[0]
    dequantized = {o for n in candidate.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    quantized = [n.name for n in candidate.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear") and any(i in dequantized for i in n.input)]
    return sorted((candidate_output_ratio(model, candidate, reference, feed, tolerance, output, {name}), name) for name in quantized)


def candidate_output_ratio(model, candidate, reference: np.ndarray, feed, tolerance, output: str, keep: set[str]) -> float:
    """`output`'s worst |cand - ref| / tolerance when the candidate runs in ONNX Runtime with the nodes `keep`
    unquantized (`unquantized`)."""
    produced = _session(_fp16_rounded(unquantized(model, candidate, keep))).run([output], feed)[0]
    return _ratio(reference, produced, tolerance)


def candidate_keep_top1_ranking(model_path: Path, candidate_path: Path, feeds, output: str) -> tuple[float, list[tuple[float, str]]]:
    """The candidate's top-1 agreement with the FP32 model along `output`'s last axis, over every position of
    `feeds`, and (that agreement, node) for each node reading a DequantizeLinear left unquantized alone
    (`unquantized`), best first: which one keep recovers most of the decision."""
    model, candidate = onnx.load(str(model_path)), onnx.load(str(candidate_path))
    top1 = _top1_against(model, feeds, output)
    dequantized = {o for n in candidate.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    quantized = [n.name for n in candidate.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear") and any(i in dequantized for i in n.input)]
    return top1(candidate), sorted(((top1(unquantized(model, candidate, {name})), name) for name in quantized), key=lambda item: -item[0])


def candidate_keep_top1(model_path: Path, candidate_path: Path, feeds, output: str, keep: set[str],
                        parts: tuple[str, ...] = ("weights", "activations")) -> tuple[float, float]:
    """The candidate's top-1 agreement (as `candidate_keep_top1_ranking`) with nothing kept, and with `keep`
    unquantized (only the `parts` of what they read: "weights", "activations", "per channel")."""
    model, candidate = onnx.load(str(model_path)), onnx.load(str(candidate_path))
    top1 = _top1_against(model, feeds, output)
    return top1(candidate), top1(unquantized(model, candidate, keep, parts))


def _top1_against(model: onnx.ModelProto, feeds, output: str):
    """A function giving a variant's top-1 agreement with `model` along `output`'s last axis, over every position of `feeds`."""
    session = _session(model)
    reference = [session.run([output], feed)[0].argmax(-1) for feed in feeds]

    def top1(variant: onnx.ModelProto) -> float:
        session = _session(_fp16_rounded(variant))
        return float(np.mean(np.concatenate([(session.run([output], feed)[0].argmax(-1) == ref).ravel() for feed, ref in zip(feeds, reference)])))

    return top1


def unquantized(model, candidate, keep: set[str], parts: tuple[str, ...] = ("weights", "activations")) -> onnx.ModelProto:
    """The candidate with the nodes `keep` unquantized: each input they read through a Q/DQ pair read from
    before it (a quantized weight: the FP32 model's weight at the same input of its node of the same name),
    and a graph output a Q/DQ pair quantizes right after them their own result again; of `parts`, only the
    "weights" (a pair on a constant, or codes) or only the "activations" (a pair on a computed value). FP16
    values are to be rounded through Cast pairs (`_fp16_rounded`: ONNX Runtime's CPU provider would compute
    them in FP32 unrounded); the kept nodes stay in the type they had. Of `parts`, "per channel" reads each
    weight a pair quantizes with one scale (a float constant before it) requantized instead, by numpy: 8-bit
    symmetric codes with a scale per output channel (axis 0 of a Conv's, the last of a MatMul's), read back."""
    original = {n.name: n for n in _loaded(model).graph.node}
    weights = {init.name: init for init in _loaded(model).graph.initializer}
    variant = onnx.ModelProto()
    variant.CopyFrom(_loaded(candidate))
    graph = variant.graph
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    constants = {init.name for init in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    for node in graph.node:
        if node.name not in keep:
            continue
        for position, name in enumerate(node.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            q = producer.get(dq.input[0])
            source = q.input[0] if q is not None and q.op_type == "QuantizeLinear" else dq.input[0]
            if "per channel" in parts and source in constants and q is not None and q.op_type == "QuantizeLinear":
                values = _constant_values(graph, source)
                axis = 0 if node.op_type == "Conv" else values.ndim - 1
                step = np.abs(values).max(axis=tuple(i for i in range(values.ndim) if i != axis), keepdims=True) / 127
                step[step == 0] = 1
                graph.initializer.append(numpy_helper.from_array((np.clip(np.round(values / step), -127, 127) * step).astype(np.float32), f"{source}__oracle_per_channel"))
                node.input[position] = f"{source}__oracle_per_channel"
                continue
            if ("weights" if source in constants else "activations") not in parts:
                continue
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[position] = q.input[0]
            elif node.name in original and original[node.name].input[position] in weights:
                weight = weights[original[node.name].input[position]]
                graph.initializer.append(weight)
                node.input[position] = weight.name
        for out in node.output if "activations" in parts else ():
            for q in [n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == out]:
                for dq in [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0] and n.output[0] in outputs]:
                    dq.op_type, dq.input[:] = "Identity", [out]
                    del dq.attribute[:]
    return variant


def _constant_values(graph: onnx.GraphProto, name: str) -> np.ndarray:
    """A constant's values: an initializer's, or a Constant node's."""
    found = next((i for i in graph.initializer if i.name == name), None)
    return numpy_helper.to_array(found if found is not None else next(n for n in graph.node if n.output[0] == name).attribute[0].t)


def _fp16_rounded(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every FP16 value held in FP32 and rounded to FP16 by a Cast pair after the node that
    writes it, its FP16 weights as FP32 values (exact), a Cast to FP16 as the same round trip."""
    model = onnx.shape_inference.infer_shapes(model)
    graph = model.graph
    halves = {vi.name for vi in [*graph.value_info, *graph.output] if vi.type.tensor_type.elem_type == FP16}
    if not halves and not any(init.data_type == FP16 for init in graph.initializer):
        return model
    for init in graph.initializer:
        if init.data_type == FP16:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    nodes = []
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FP16:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
        if node.op_type == "Cast" and any(a.name == "to" and a.i == FP16 for a in node.attribute):
            nodes += _round_trip(node.input[0], node.output[0])
            continue
        rounded = [o for o in node.output if o in halves]
        node.output[:] = [f"{o}__unrounded" if o in halves else o for o in node.output]
        nodes.append(node)
        for out in rounded:
            nodes += _round_trip(f"{out}__unrounded", out)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    for vi in [*graph.input, *graph.output]:
        if vi.type.tensor_type.elem_type == FP16:
            vi.type.tensor_type.elem_type = FLOAT
    return model


# --- Keep-one oracle, FP16 candidate made by another tool: one node at a time reads its FP32 weights again ---


def fp16_candidate_keep_ranking(model_path: Path, candidate_path: Path, feed, tolerance, output: str) -> tuple[float, list[tuple[float, str]]]:
    """The output's ratio as the FP16 candidate stands, and (ratio, node) for each of its nodes kept in FP32
    alone, best first. FP16 storage is emulated (`_fp16_rounded`: every FP16 value rounded where it is
    written, arithmetic in FP32, as ONNX Runtime's CPU provider computes FP16 nodes); a node kept in FP32
    reads the FP32 model's weights at the inputs where the FP32 model's node of the same name reads a
    weight, its other inputs as the candidate writes them, and writes its outputs in the candidate's types
    (its FP16 readers read them in FP16). A node that reads no weight is then the candidate unchanged: its
    ratio is the candidate's, without a run."""
    model, candidate = _loaded(model_path), _fp16_rounded(_loaded(candidate_path))
    reference = _session(model).run([output], feed)[0]
    base = _ratio(reference, _session(candidate).run([output], feed)[0], tolerance)
    weights = {init.name: init for init in model.graph.initializer}
    weights.update({n.output[0]: a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"})
    original = {n.name: n for n in model.graph.node if n.name}
    ranking = []
    for node in candidate.graph.node:
        twin = original.get(node.name)
        if twin is None or twin.op_type != node.op_type:
            continue  # a node the converter added (its Casts)
        positions = [p for p, name in enumerate(twin.input) if name in weights]
        if not positions:
            ranking.append((base, node.name))
            continue
        variant = onnx.ModelProto()
        variant.CopyFrom(candidate)
        kept = next(n for n in variant.graph.node if n.name == node.name)
        for position in positions:
            weight = onnx.TensorProto()
            weight.CopyFrom(weights[twin.input[position]])
            weight.name = f"{node.name}__fp32_weight_{position}"
            variant.graph.initializer.append(weight)
            kept.input[position] = weight.name
        ranking.append((_ratio(reference, _session(variant).run([output], feed)[0], tolerance), node.name))
    return base, sorted(ranking)


# --- Exclude-one oracle: the candidate made again by the tool that made it, one node excluded at a time ---


def exclusion_ranking(model_path: Path, make, nodes, feeds, tolerance, output: str) -> list[tuple[float, str]]:
    """(`output`'s worst |cand - ref| / tolerance over `feeds`, node) for each of `nodes` excluded alone when
    the tool that quantized the candidate quantizes the float model again (`make(excluded)` writes that
    candidate and returns its path), best first: what the quantizer's own nodes_to_exclude answers."""
    reference = _session(_loaded(model_path))
    expected = [reference.run([output], feed)[0] for feed in feeds]
    return sorted((exclusion_ratio(make((node,)), expected, feeds, tolerance, output), node) for node in nodes)


def exclusion_ratio(candidate: Path, expected: list[np.ndarray], feeds, tolerance, output: str, optimized: bool = False) -> float:
    """`output`'s worst ratio over `feeds` for one candidate, against the float model's `expected` outputs
    (`optimized`: the candidate's session optimized, as ONNX Runtime runs a model by default)."""
    session = _session(_loaded(candidate), optimized)
    return max(_ratio(reference, session.run([output], feed)[0], tolerance) for reference, feed in zip(expected, feeds))


def dynamic_matmul_parts(model_path: Path, candidate_path: Path, node: str, folder: Path, per_channel_path: Path | None = None) -> dict[str, Path]:
    """A MatMul that ONNX Runtime's quantize_dynamic quantized (DynamicQuantizeLinear of its input, then
    MatMulInteger, a Cast and two Muls by the scales) rewritten by hand one part at a time, saved in `folder`:
    "weights float" (its input still quantized as the model runs, read back by a DequantizeLinear, times the
    float model's weight) and "activations float" (its input as it is, times its weight's codes dequantized
    with numpy); with `per_channel_path` (quantize_dynamic's model with per_channel=True), "weights per
    channel" (its input as in "weights float", times the weight's codes as that model holds them, dequantized)."""
    reference, candidate = _loaded(model_path), _loaded(candidate_path)
    float_node = next(n for n in reference.graph.node if n.name == node)
    integer = next(n for n in candidate.graph.node if n.name == f"{node}_quant" and n.op_type == "MatMulInteger")
    activation = next(n for n in candidate.graph.node if n.op_type == "DynamicQuantizeLinear" and n.output[0] == integer.input[0])
    members = _members_between(candidate, integer, float_node.output[0])
    weights = {"weights float": numpy_helper.to_array({i.name: i for i in reference.graph.initializer}[float_node.input[1]]),
               "activations float": _dynamic_weight(candidate, integer)}
    if per_channel_path is not None:
        per_channel = _loaded(per_channel_path)
        weights["weights per channel"] = _dynamic_weight(per_channel, next(n for n in per_channel.graph.node if n.name == integer.name))
    made = {}
    for part, weight in weights.items():
        variant = onnx.ModelProto()
        variant.CopyFrom(candidate)
        variant.graph.initializer.append(numpy_helper.from_array(weight.astype(np.float32), "oracle_weight"))
        if part == "activations float":
            new = [helper.make_node("MatMul", [activation.input[0], "oracle_weight"], [float_node.output[0]])]
        else:
            new = [helper.make_node("DequantizeLinear", list(activation.output), ["oracle_activation"]),
                   helper.make_node("MatMul", ["oracle_activation", "oracle_weight"], [float_node.output[0]])]
        nodes = [n for n in variant.graph.node if n.name not in members]
        at = next(i for i, n in enumerate(nodes) if n.name == activation.name) + 1
        del variant.graph.node[:]
        variant.graph.node.extend(nodes[:at] + new + nodes[at:])
        made[part] = folder / f"{part.replace(' ', '_')}.onnx"
        onnx.save(variant, str(made[part]))
    return made


def dynamic_matmuls_exact(candidate_path: Path, target: Path) -> Path:
    """quantize_dynamic's model with every MatMulInteger (and the Cast and Muls by the scales after it)
    computed as the float product of its codes read back: what its codes give without a kernel's 16-bit saturation
    (as TensorRT's INT8 kernels accumulate, in 32 bits), where ONNX Runtime's own x86 kernels without VNNI
    can saturate on codes that use the whole 8-bit range."""
    model = _loaded(candidate_path)
    producers = {out: n for n in model.graph.node for out in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    replaced, added = set(), {}
    for integer in [n for n in model.graph.node if n.op_type == "MatMulInteger"]:
        [cast] = readers[integer.output[0]]
        [last] = readers[cast.output[0]]  # the Mul by the scales
        activation = producers[integer.input[0]]
        members = _members_between(model, integer, last.output[0])
        weight = f"oracle_weight_{len(added)}"
        model.graph.initializer.append(numpy_helper.from_array(_dynamic_weight(model, integer).astype(np.float32), weight))
        added[last.name] = [helper.make_node("DequantizeLinear", list(activation.output), [f"{weight}_activation"]),
                            helper.make_node("MatMul", [f"{weight}_activation", weight], [last.output[0]])]
        replaced |= members - {last.name}
    nodes = []
    for n in model.graph.node:
        if n.name in added:
            nodes += added[n.name]
        elif n.name not in replaced:
            nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(target))
    return target


def _dynamic_weight(model: onnx.ModelProto, integer: onnx.NodeProto) -> np.ndarray:
    """A MatMulInteger's weight codes as quantize_dynamic wrote them, read back: (code - zero point) x scale,
    one scale or one per column."""
    initializers = {i.name: i for i in model.graph.initializer}
    codes, zero = (numpy_helper.to_array(initializers[name]).astype(np.float32) for name in (integer.input[1], integer.input[3]))
    return (codes - zero) * numpy_helper.to_array(initializers[integer.input[1].replace("_quantized", "_scale")])


def _members_between(model: onnx.ModelProto, first: onnx.NodeProto, output: str) -> set[str]:
    """The nodes from `first` to the one writing `output`, following what each writes (a dynamic MatMul's
    MatMulInteger, Cast and Muls; the scales' Mul reads only scales, and is found as the last Mul's input)."""
    producers = {out: n for n in model.graph.node for out in n.output}
    found, pending = set(), [producers[output]]
    while pending:
        node = pending.pop()
        if node.name in found:
            continue
        found.add(node.name)
        if node is not first and node.name != first.name:
            pending += [producers[name] for name in node.input if name in producers and producers[name].op_type in ("MatMulInteger", "Cast", "Mul")]
    return found


# --- Decision figures, from the two runs' outputs with plain numpy ---


def token_figures(reference: list[np.ndarray], candidate: list[np.ndarray]) -> dict:
    """Per position along the last axis of logits, over every sample: the share whose top entry agrees, the
    KL divergence KL(softmax(reference) || softmax(candidate)) (mean, median and 99th percentile at index ceil(q (n - 1)), largest),
    and how much probability the reference's top entry loses (mean, largest)."""
    kl, dp, same = [], [], []
    for ref, cand in zip(reference, candidate):
        for r, c in zip(ref.reshape(-1, ref.shape[-1]).astype(np.float64), cand.reshape(-1, ref.shape[-1]).astype(np.float64)):
            log_p, log_q = r - np.logaddexp.reduce(r), c - np.logaddexp.reduce(c)
            p, top = np.exp(log_p), int(r.argmax())
            kl.append(float(np.sum(p * (log_p - log_q))))
            dp.append(float(p[top] - np.exp(log_q[top])))
            same.append(int(c.argmax()) == top)
    rank = lambda q: float(np.quantile(kl, q, method="higher"))  # noqa: E731 - the value at index ceil(q (n - 1)), as accudiff's sketches read it
    return {"top1": float(np.mean(same)), "kl": float(np.mean(kl)), "kl_median": rank(0.5), "kl_p99": rank(0.99),
            "kl_max": float(np.max(kl)), "delta_p": float(np.mean(dp)), "delta_p_max": float(np.max(dp)), "score_vectors": len(kl)}


def embedding_figures(reference: list[np.ndarray], candidate: list[np.ndarray]) -> dict:
    """Per vector along the last axis, over every sample: the cosine (mean, lowest); for [batch, dim]
    outputs of more than two rows, the share of rows whose nearest other row is the same on both sides."""
    cosines, same, rows = [], 0, 0
    for ref, cand in zip(reference, candidate):
        r, c = ref.reshape(-1, ref.shape[-1]).astype(np.float64), cand.reshape(-1, ref.shape[-1]).astype(np.float64)
        cosines += [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(r, c)]
        if ref.ndim == 2 and len(r) > 2:
            nearest = [[max((j for j in range(len(m)) if j != i), key=lambda j: m[i] @ m[j] / np.linalg.norm(m[j])) for i in range(len(m))] for m in (r, c)]
            same += sum(a == b for a, b in zip(*nearest))
            rows += len(r)
    found = {"cosine": float(np.mean(cosines)), "cosine_min": float(np.min(cosines)), "vectors": len(cosines)}
    return {**found, "neighbors": same / rows} if rows else found


def detection_counts(reference: list[np.ndarray], candidate: list[np.ndarray], threshold: float = 0.25) -> dict:
    """A YOLOv8 head's output [batch, 4 + classes, boxes] decoded as ultralytics decodes it: a box whose best
    class score reaches `threshold`, boxes of a class overlapping a higher-scoring one by IoU > 0.7 dropped,
    at most 300 an image; then each reference detection, the highest score first, matched to the unmatched
    candidate detection of its class it overlaps most, if by IoU >= 0.5. Counts over every image, and the
    matched pairs' IoU added up."""

    def iou(a, b):
        w, h = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
        inter = max(w, 0.0) * max(h, 0.0)
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return inter / union if union > 0 else 0.0

    def detected(image):  # [4 + classes, boxes]
        found = []
        for column in image.T.astype(np.float64):
            scores = list(column[4:])
            best = max(range(len(scores)), key=lambda k: scores[k])
            if scores[best] >= threshold:
                cx, cy, w, h = column[:4]
                found.append((scores[best], best, (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)))
        found.sort(key=lambda d: -d[0])
        kept = []
        for score, label, box in found:
            if len(kept) < 300 and all(other_label != label or iou(box, other) <= 0.7 for _, other_label, other in kept):
                kept.append((score, label, box))
        return kept

    counts = {"images": 0, "reference": 0, "candidate": 0, "matched": 0, "iou_sum": 0.0}
    for ref, cand in zip(reference, candidate):
        for image_r, image_c in zip(ref, cand):
            found_r, found_c = detected(image_r), detected(image_c)
            taken = [False] * len(found_c)
            for _, label, box in found_r:
                overlaps = [(iou(box, other), k) for k, (_, other_label, other) in enumerate(found_c) if other_label == label and not taken[k]]
                if overlaps and max(overlaps)[0] >= 0.5:
                    taken[max(overlaps)[1]] = True
                    counts["iou_sum"] += max(overlaps)[0]
            counts["images"] += 1
            counts["reference"] += len(found_r)
            counts["candidate"] += len(found_c)
            counts["matched"] += sum(taken)
    return counts


def run_results_outputs(path: Path, name: str) -> list[np.ndarray]:
    """Tensor `name` of every iteration of a polygraphy RunResults file (its first runner), decoded here:
    each array is a base64 .npy, bare or wrapped in a LazyArray."""
    import base64
    import io
    import json

    runner = json.loads(Path(path).read_text())["lst"][0]
    arrays = []
    for iteration in runner[1]:
        encoded = iteration["outputs"][name]
        encoded = encoded.get("values", encoded)
        arrays.append(np.load(io.BytesIO(base64.b64decode(encoded["array"])), allow_pickle=False))
    return arrays


def generation(reference: Path, candidate: Path, prompts: list[np.ndarray], new_tokens: int, eos: set[int] = frozenset(),
               tolerance: tuple[float, float, float] | None = None, qdq_as_written: bool = False) -> dict:
    """A decoder's generation as deployed, with two plain ONNX Runtime sessions on the model files (graph
    outputs only), each carrying its own KV cache (present fed back as past): every prompt's prefill, then
    `new_tokens` decode steps fed the reference's greedy token. Per phase ("prefill", "decode"), numpy's
    figures over every position: top-1 agreement, KL(reference || candidate) mean and max, Δp of the
    reference's top entry, ΔNLL of the token that follows each position; per prompt the first step at
    which the candidate's own greedy token differs (None: never), and its own continuation: the reference's
    tokens up to there, then its own greedy choices on its own cache, as many as the reference made (up to an
    end-of-sequence token); given a `tolerance` (atol, rtol, stol), the
    worst step's logits against it, as a multiple of it. `qdq_as_written`: the candidate's Q/DQ pairs are computed as
    written, not fused into ONNX Runtime's integer kernels (its DequantizeLinear and MatMul into MatMulNBits)."""
    options = ort.SessionOptions()
    if qdq_as_written:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    sessions = [ort.InferenceSession(str(reference), providers=["CPUExecutionProvider"]),
                ort.InferenceSession(str(candidate), options, providers=["CPUExecutionProvider"])]
    pasts = [[i for i in s.get_inputs() if i.name.startswith("past_key_values.")] for s in sessions]
    capacity = _window_capacity(reference)
    found = {"prefill": [], "decode": []}
    parted, continuations = [], []

    def run(k: int, fed: list[int], cache: dict, done: int) -> tuple[np.ndarray, dict]:
        feed = {"input_ids": np.asarray([fed], np.int64), "attention_mask": np.ones((1, done + len(fed)), np.int64), **cache}
        names = [o.name for o in sessions[k].get_outputs()]
        out = dict(zip(names, sessions[k].run(names, {n: v for n, v in feed.items() if n in {i.name for i in sessions[k].get_inputs()}})))
        return out["logits"][0].astype(np.float64), {name.replace("present.", "past_key_values."): value for name, value in out.items() if name.startswith("present.")}

    for prompt in prompts:
        caches = [{i.name: np.zeros((1, i.shape[1], capacity.get(i.name, 0), _head_size(reference)), _ORT_NUMPY[i.type]) for i in past} for past in pasts]
        first_different, own, tokens, done = None, None, [], 0
        fed = list(prompt)
        for step in range(new_tokens + 1):
            logits = []
            for k in range(2):
                scores, caches[k] = run(k, fed, caches[k], done)
                logits.append(scores)
            done += len(fed)
            chosen = int(logits[0][-1].argmax())
            tokens.append(chosen)
            if first_different is None and int(logits[1][-1].argmax()) != chosen:
                first_different, own = step, (int(logits[1][-1].argmax()), caches[1], done)
            found["prefill" if step == 0 else "decode"].append((logits[0], logits[1], np.asarray([*fed[1:], chosen])))
            if step == new_tokens or chosen in eos:
                break
            fed = [chosen]
        parted.append(first_different)
        alone = list(tokens)
        if own is not None:
            token, cache, held = own
            alone = [*tokens[:first_different], token]
            while len(alone) < len(tokens) and token not in eos:
                scores, cache = run(1, [token], cache, held)
                held += 1
                token = int(scores[-1].argmax())
                alone.append(token)
        continuations.append(alone)
    figures = {"phases": {phase: _token_phase(rows) for phase, rows in found.items() if rows}, "first_different": parted,
               "candidate_continuations": continuations}
    if tolerance is not None:
        figures["tol_ratio"] = max(_ratio(ref, cand, tolerance) for rows in found.values() for ref, cand, _ in rows)
    return figures


def _token_phase(rows) -> dict:
    ref = np.concatenate([r for r, _, _ in rows])
    cand = np.concatenate([c for _, c, _ in rows])
    nxt = np.concatenate([t for _, _, t in rows])
    log_p = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
    log_q = cand - np.logaddexp.reduce(cand, axis=1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=1)
    top = ref.argmax(axis=1)
    at = np.arange(len(top))
    return {"positions": len(top), "top1": float((cand.argmax(axis=1) == top).mean()), "kl": float(kl.mean()), "kl_max": float(kl.max()),
            "delta_p": float((np.exp(log_p[at, top]) - np.exp(log_q[at, top])).mean()), "delta_nll": float((log_p[at, nxt] - log_q[at, nxt]).mean())}


def rows_apart(model: Path, tokens: list[int]) -> bool:
    """Whether a plain ONNX Runtime session of a GenAI build gives each row of a batch of one-token prompts (a decode
    step's shape, its past empty) the logits it gives that prompt alone, bit for bit."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]

    def logits(rows: list[int]) -> np.ndarray:
        feed = {"input_ids": np.array(rows, np.int64)[:, None], "attention_mask": np.ones((len(rows), 1), np.int64)}
        feed.update({i.name: np.zeros((len(rows), i.shape[1], 0, _head_size(model)), _ORT_NUMPY[i.type]) for i in pasts})
        return session.run(["logits"], feed)[0]

    batch = logits(tokens)
    return all(np.array_equal(batch[k], logits([token])[0]) for k, token in enumerate(tokens))


def _head_size(model: Path) -> int:
    return int(_genai_decoder(model)["head_size"])


def _window_capacity(model: Path) -> dict[str, int]:
    """The past inputs of the layers whose KV cache is a window (the GenAI config's sliding_window), each with
    the capacity the runtime gives it: the window and the slack kept beyond it."""
    sliding = _genai_decoder(model).get("sliding_window")
    if not sliding:
        return {}
    return {f"past_key_values.{layer}.{part}": sliding["window_size"] + sliding.get("cache_slack", 0) for layer in sliding["layers"] for part in ("key", "value")}


def _genai_decoder(model: Path) -> dict:
    import json

    return json.loads((Path(model).parent / "genai_config.json").read_text())["model"]["decoder"]


_ORT_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
