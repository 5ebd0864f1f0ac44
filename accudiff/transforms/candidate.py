"""The candidate model as `compare` builds it, and variants of it with more nodes kept in higher precision.

One recipe (precision, the user's keep-list, autokeep, INT8 calibration) makes the candidate that
`compare` runs, the variants that verification and `accudiff bisect precision` try, and the repaired model
they save: so what is saved is exactly what was verified.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx

from accudiff.model.decoder import find_decoder
from accudiff.model.graph import GraphIndex
from accudiff.model.inputs import Feed, generate_feeds
from accudiff.model.inventory import ModelInfo
from accudiff.model.loading import load_model, remember_model
from accudiff.model.prompts import prepare_generation
from accudiff.model.quantized_ops import QuantizedOp, find_quantized_ops
from accudiff.model.samples import Samples, samples_from_feeds, samples_from_path
from accudiff.model.value_file import ValueFile
from accudiff.transforms.autokeep import Measure, close_autokeep
from accudiff.transforms.base import KeptNode, TransformResult
from accudiff.transforms.fp16 import HALVES, to_fp16
from accudiff.transforms.tool_made import adopt, keepable_nodes, reference_node_names
from accudiff.transforms.int8 import leave_unquantized, to_int8
from accudiff.transforms.keep_float import PARTS, keep_in_float, narrowed_parts
from accudiff.transforms.switches import Switchboard, build_candidate_switchboard, build_switchboard, gate_switches

KEPT_TO_VERIFY = "kept in higher precision to verify a cause"
REPAIRED_CANDIDATE_FILE = "repaired-candidate.onnx"


@dataclass(frozen=True)
class CandidateRecipe:
    """How the candidate is made from the FP32 model (what the user asked for)."""

    precision: str
    keep_fp32: tuple[str, ...] = ()
    autokeep: bool = True
    calib_data: Samples | str | Path | None = None
    seed: int = 0
    engine: Path | None = None  # a pre-built TensorRT engine: nothing to transform
    candidate_model: Path | None = None  # a candidate made by another tool, taken as it is (transforms/tool_made.py)


def transform_model(info: ModelInfo, recipe: CandidateRecipe, samples: Samples, measure: Measure, scratch: Path | None = None) -> TransformResult:
    """The candidate model exactly as `compare` builds it, for `samples` (the samples compared: what
    autokeep measures with `measure`, and the first is what random INT8 calibration data is shaped like)."""
    if recipe.engine is not None:
        return TransformResult(model=info.proto, precision=recipe.precision)
    if recipe.candidate_model is not None:
        given = load_model(recipe.candidate_model)
        remember_model(given)  # before adopt renames it: the repaired model is the user's own
        return replace(adopt(given, info, recipe.keep_fp32), given=given.remembered)
    if recipe.precision in HALVES:
        result = to_fp16(info.proto, recipe.keep_fp32, recipe.autokeep, HALVES[recipe.precision])
        return close_autokeep(info, result, samples, recipe.keep_fp32, HALVES[recipe.precision], measure) if recipe.autokeep else result
    if recipe.precision == "int8":
        calibration = calibration_samples(info, samples[0], recipe.calib_data, recipe.seed, scratch)
        on = None if recipe.calib_data is not None else "random" if drawn_at_random(samples[0]) else "first"
        return to_int8(info.proto, calibration, recipe.keep_fp32, calibrated_on=on)
    return TransformResult(model=info.proto, precision="fp32")


class CandidateVariants:
    """The candidate, and the same candidate with more nodes kept in higher precision (INT8: left
    unquantized). FP16 variants are converted anew with the nodes added to the keep-list (a fast pass);
    INT8 variants reuse the calibrated model, as calibration runs on the FP32 model and its scales do not
    depend on which nodes read them."""

    def __init__(self, info: ModelInfo, recipe: CandidateRecipe, base: TransformResult, values: ValueFile | None = None):
        """`base`: the candidate `transform_model(info, recipe, ...)` made. `values`: where the weights a
        candidate made by another tool has dequantized for a variant are written, once for every variant
        (else each variant holds its own in memory); keyed by the names in `base`, which the model `repaired`
        keeps (the user's own, before alignment renamed values) need not share, so it holds its own."""
        self.info, self.recipe, self.base, self.values = info, recipe, base, values

    def with_kept(self, nodes: Iterable[str], parts: str = "all") -> TransformResult:
        """The candidate with `nodes` kept in higher precision. Of a candidate made by another tool, or
        accudiff's INT8, `parts` says what keeping undoes: "all" (Q/DQ pairs and FP16/BF16), or only its
        "quantization" or its "casts", its "activations'" or its "weights'" (which share of its loss each brings)."""
        nodes = list(nodes)
        if not nodes or self.recipe.precision == "fp32" or self.recipe.engine is not None:
            return self.base
        if self.recipe.candidate_model is not None:
            kept = [KeptNode(node.name, node.op_type, KEPT_TO_VERIFY) for node in self.base.model.graph.node if node.name in self.base.converted and node.name in nodes]
            model = keep_in_float(self.base.model, self.info.proto, nodes, PARTS[parts], self.values)
            return replace(self.base, model=model, kept=[*self.base.kept, *kept], converted=self.base.converted - set(nodes))
        if self.recipe.precision == "int8":
            return leave_unquantized(self.base, self.info.proto, nodes, KEPT_TO_VERIFY, PARTS[parts])
        autokept = {k.node: k.reason for k in self.base.kept if k.autokept}  # as measured for the candidate (autokeep.py)
        return to_fp16(self.info.proto, [*self.recipe.keep_fp32, *map(keep_pattern, nodes)], self.recipe.autokeep, HALVES[self.recipe.precision], autokept)

    def parts_of(self, node: str) -> frozenset[str]:
        """What of `node`'s quantization a keep can undo apart ("activations", "weights"): of a candidate
        made by another tool, or accudiff's INT8; nothing of any other."""
        given = self.recipe.candidate_model is not None
        return narrowed_parts(self.base.model, self.info.proto, node) if given or self.recipe.precision == "int8" else frozenset()

    def converted_of(self, op_types: frozenset[str]) -> list[str]:
        """The nodes the candidate converts whose float op is one of `op_types`."""
        return sorted(name for name, op_type in self.float_op_types().items() if op_type in op_types and name in self.base.converted)

    def quantized_nodes(self) -> set[str]:
        """The nodes of a candidate made by another tool that are quantized: its quantized ops (by every name
        they take), and the nodes reading a dequantized value (a Q/DQ pair's readers); not those it only
        computes in FP16/BF16."""
        if self.recipe.candidate_model is None:
            return set()
        graph = self.base.model.graph
        dequantized = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
        return {node.name for node in graph.node if node.op_type != "QuantizeLinear" and dequantized & set(node.input)} | {name for op in self._quantized_ops for name in op.names}

    def float_op_types(self) -> dict[str, str]:
        """Each node's float op type: the FP32 model's node of that name, else the candidate's own (a node only
        the candidate has: ModelOpt's Flatten before a quantized MatMul); a name a quantized op took in with it
        (a bias Add fused into its MatMul) is of that op: keeping it keeps the op."""
        found = {node.name: node.op_type for graph in (self.base.model.graph, self.info.proto.graph) for node in graph.node}
        return found | {name: op.op_type for op in self._quantized_ops for name in op.names}

    @cached_property
    def _quantized_ops(self) -> list[QuantizedOp]:
        """The quantized ops of a candidate made by another tool (none of any other), found once: the base does not change."""
        if self.recipe.candidate_model is None:
            return []
        return find_quantized_ops(GraphIndex.of(self.base.model.graph), GraphIndex.of(self.info.proto.graph))

    def switchboard(self, nodes: Iterable[str], gated: bool = False) -> Switchboard | None:
        """The FP16 candidate, or a candidate made by another tool, with `nodes` switchable back to FP32
        (transforms/switches.py): one model for every keep-list among them. Nodes it already keeps (or that
        hold no float value) need no switch. None where keep-lists need variants of their own: accudiff's
        INT8 (a node left unquantized changes which Q/DQ pairs exist around it), a pre-built engine, a node
        inside an If/Loop/Scan body."""
        given = self.recipe.candidate_model is not None
        if (self.recipe.precision not in HALVES and not given) or self.recipe.engine is not None:
            return None
        main = {node.name for node in keepable_nodes(GraphIndex.of(self.base.model.graph), GraphIndex.of(self.info.proto.graph))} if given else {node.name for node in self.base.model.graph.node}
        nodes = [n for n in dict.fromkeys(nodes) if n in self.base.converted]
        if not set(nodes) <= main:
            return None
        board = build_candidate_switchboard(self.base.model, self.info.proto, nodes, self.values) if given else build_switchboard(self.base.model, self.info.proto, nodes)
        if gated:  # each kept copy computed only when its switch is on (switches.gate_switches)
            gate_switches(board)
        return board


def repaired(variants: CandidateVariants, nodes: Iterable[str]) -> onnx.ModelProto:
    """The model to ship with `nodes` kept in higher precision: the variant verified, or, for a candidate
    made by another tool, that candidate as the user gave it (its own tensor names; the names a run aligns
    do not change what it computes) with the same nodes kept, the user's --keep-fp32 ones included."""
    if variants.recipe.candidate_model is None:
        return variants.with_kept(nodes).model
    given = onnx.ModelProto()
    given.CopyFrom(variants.base.given)
    theirs = {ours: name for name, ours in reference_node_names(given.graph, variants.info.proto.graph).items()}  # a node the tool renamed
    return keep_in_float(given, variants.info.proto, [theirs.get(n, n) for n in [*(k.node for k in variants.base.kept), *nodes]])


def repaired_file(recipe: CandidateRecipe) -> str:
    """The repaired model's file name in a report or bisect folder."""
    return REPAIRED_CANDIDATE_FILE if recipe.candidate_model is not None else f"repaired-{recipe.precision}.onnx"


def keep_pattern(node: str) -> str:
    """A --keep-fp32 pattern that selects exactly this node name (names may hold regex characters)."""
    return re.escape(node)


def drawn_at_random(sample: Feed) -> bool:
    """Whether random calibration data shaped like `sample` draws anything: a floating-point input with
    elements (a decoder's prefill has none: its tokens are the prompt's, its past is empty)."""
    return any(np.issubdtype(value.dtype, np.floating) and value.size for value in sample.values())


def calibration_samples(info: ModelInfo, sample: Feed, calib_data=None, seed: int = 0, scratch: Path | None = None) -> Samples:
    """The INT8 calibration samples: `calib_data` (samples, or a file or a folder, read one at a time), else
    seeded random data (seed + 1, written into `scratch`) shaped like `sample`. Only the floating-point
    inputs are random: integer and bool inputs (shapes, indices, flags, the conditions of a model
    specialized for its branches) are taken from `sample`, as random values would make invalid shapes
    and take other branches."""
    if isinstance(calib_data, Samples):
        return calib_data
    folder = scratch if scratch is not None else Path(tempfile.mkdtemp(prefix="accudiff-calibration-"))
    if calib_data is not None and find_decoder(info.path, info.inputs, info.output_names) is not None:
        # A decoder is calibrated on prompts, as --prompts takes them (their prefills): nobody writes a KV cache by hand.
        (folder / "calibration").mkdir(exist_ok=True)
        return prepare_generation(info, calib_data, 0, folder / "calibration" / "prompts.npz", folder / "calibration").prefills
    if calib_data is not None:
        return samples_from_path(calib_data, info.inputs, "calibration", scratch)
    shapes = {spec.name: sample[spec.name].shape for spec in info.inputs}
    fixed = {name: value for name, value in sample.items() if not np.issubdtype(value.dtype, np.floating)}
    # Nothing to draw (drawn_at_random): the sample itself, once, not eight times over.
    feeds = [{**feed, **fixed} for feed in generate_feeds(info.inputs, shapes, seed + 1, iterations=8 if drawn_at_random(sample) else 1)]
    return samples_from_feeds(feeds, folder / "calibration.npz", info.inputs)
