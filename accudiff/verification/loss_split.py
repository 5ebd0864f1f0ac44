"""The loss split: which part of a candidate's narrowing its loss comes from. A candidate made by another tool
is run with every converted node kept, each part of its narrowing undone alone (its quantization or its
casts; its activations' quantization or its weights'), in verification's batch, beside the control; and
each verified cause's node is, with its activations' quantization and its weights' undone alone, and its
weight quantized with one scale given a scale per output channel (alone, and every weight so)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Mapping, Sequence

from accudiff.findings import Cause, Finding, Repair
from accudiff.judging.objective import Objective
from accudiff.verification.readings import HELPS, Reading, improvement
from accudiff.verification.trial import TrialOutcome, Trials
from accudiff.model.formats import QUANTIZED_FORMATS
from accudiff.model.quantized_ops import per_channel_option
from accudiff.model.quantized_weights import PER_CHANNEL_OPS
from accudiff.transforms.candidate import CandidateVariants

ACTIVATION_GRIDS = frozenset({"int8", "int8-dynamic", "fp8", "int4", "fp4"})  # formats that quantize activations (not only weights)


def loss_split_keeps(variants: CandidateVariants, formats: frozenset[str], given_alone: bool) -> dict[str, tuple[list[str], str]]:
    """For a candidate made by another tool, every converted node kept with one part of its narrowing
    undone, to tell which part brings the loss, by what is undone: its quantization and its casts
    (ModelOpt's INT8 and FP8 models also store the rest in FP16), the quantization of its activations and
    of its weights, and the quantization of its matrix ops (Conv, MatMul, Gemm: what quantizers' integer
    kernels are for) and of the other ops a quantizer also quantized (quantize_static's default quantizes a
    GELU's Muls and a LayerNorm's variance too); each `(keep-list, what keeping undoes)`. Nothing for any
    other candidate."""
    if variants.recipe.candidate_model is None:
        return {}
    every = sorted(variants.base.converted)
    pairs = [("quantization", "casts")] * bool(formats & QUANTIZED_FORMATS and formats - QUANTIZED_FORMATS)
    pairs += [("activations", "weights")] * bool(formats & ACTIVATION_GRIDS and not given_alone)  # alone, its weights are the reference's
    split = {part: (every, part) for pair in pairs for part in pair}
    matrix, quantized = variants.converted_of(PER_CHANNEL_OPS), variants.quantized_nodes()
    others = [node for node in every if node not in set(matrix) and node in quantized]  # not those it only casts
    if formats & QUANTIZED_FORMATS and matrix and others:
        undo = "all" if formats <= QUANTIZED_FORMATS else "quantization"  # their casts stay as the candidate has them
        split |= {"matrix_ops": (matrix, undo), "other_ops": (others, undo)}
    return split


def loss_split(outputs: Sequence[str], control: TrialOutcome, parts: Mapping[str, TrialOutcome], op_types: Mapping[str, dict[str, int]] = {}) -> dict[str, dict]:
    """Each failing output's tolerance ratio (and decision figures) with everything, and with each part
    undone (keyed by the part undone); `op_types`: of the split by op type, how many nodes of each op type
    each side keeps ("matrix_ops", "other_ops")."""
    if not parts:
        return {}
    named = {"with_both": control, **parts}
    return {
        output: {"ratios": {key: outcome.tol_ratio.get(output, math.inf) for key, outcome in named.items()},
                 "figures": {key: dict(outcome.figures.get(output, {})) for key, outcome in named.items()},
                 **({"op_types": dict(op_types)} if op_types else {})}
        for output in outputs
    }


def split_op_types(split: Mapping[str, tuple[list[str], str]], op_type: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """How many nodes of each op type each side of the split by op type keeps: the matrix ops by name (in
    the order the repair names them), the others most first; nothing without that split."""
    if "matrix_ops" not in split:
        return {}
    matrix, others = (Counter(op_type[node] for node in split[key][0]) for key in ("matrix_ops", "other_ops"))
    return {"matrix_ops": dict(sorted(matrix.items())), "other_ops": dict(others.most_common())}


def by_op_type(verdicts: Mapping[str, tuple[Cause, Repair]], control: TrialOutcome, parts: Mapping[str, TrialOutcome],
               split: Mapping[str, tuple[list[str], str]], matrix_op_types: Sequence[str], objective: Objective) -> dict[str, tuple[Cause, Repair]]:
    """Where no keep-list repairs an output (its error made at many places) and the candidate with only its
    matrix ops quantized meets the target, that is its repair, verified: every other quantized node kept
    (what the quantizer's op_types_to_quantize leaves out), `matrix_op_types` the ops still quantized.
    Only where keeping undoes all of their narrowing, as the repair's keep-list applied does."""
    if "other_ops" not in parts or split["other_ops"][1] != "all":
        return dict(verdicts)
    found = dict(verdicts)
    for output, (cause, repair) in verdicts.items():
        after = Reading.of(parts["other_ops"], output, objective)
        if repair.verified or cause.kind not in ("accumulated", "not_found") or not after.met:
            continue
        before = Reading.of(control, output, objective)
        kept = parts["other_ops"].keep
        found[output] = (cause, Repair(kept, [before.step([]), after.step(kept)], verified=True, op_types=list(matrix_op_types)))
    return found


PART_KINDS = {"weights": frozenset({"per_tensor_scale", "block_scale"}), "activations": frozenset({"int8_dynamic_range"})}  # the findings that speak of each part


def cause_parts(verdicts: Mapping[str, tuple[Cause, Repair]], variants: CandidateVariants, trials: Trials, control: TrialOutcome,
                objective: Objective) -> dict[str, tuple[Cause, Repair]]:
    """Why a cause costs the output, tested as where it is: of a node that quantizes both its activations
    and its weights (a candidate made by another tool), each part's quantization undone alone, on the
    samples the cause was verified on. A rule names the range of an input, or a weight's scale; which of
    them the output pays for is what undoing each says (a MatMul whose input's run-time range zeroes a
    quarter of its values loses it through its weight's one scale). A `several` cause's other nodes are
    tested so too (finding `part` on each). The node a `decision` finding names beside an accumulated error
    is read by the decision. Where the cause's weight has one scale, what a scale per channel makes of the
    loss too (finding `per_channel`)."""
    splittable: dict[str, bool] = {}  # node -> whether it quantizes both its activations and its weights

    def both(node: str) -> bool:
        if node not in splittable:
            splittable[node] = {"activations", "weights"} <= variants.parts_of(node)
        return splittable[node]

    wanted: dict[str, tuple[str, Objective, list[str]]] = {}  # output -> its cause's node, how it is read, the nodes whose parts are tried
    for output, (cause, _) in verdicts.items():
        node, by = ((cause.node, objective) if cause.kind in ("local", "dominant", "several") else
                    (cause.decision_node, replace(objective, kind="decision")))
        tested = [n for n in [node, *(c.node for c in cause.co_causes)] if n is not None and both(n)]
        if tested:
            wanted[output] = (node, by, tested)
    if not wanted:
        return dict(verdicts)
    nodes = list(dict.fromkeys(n for _, _, tested in wanted.values() for n in tested))
    # A weight one scale covers (a per_tensor_scale finding), of a candidate made by another tool (accudiff's own
    # --int8 scales weights per channel already): with a scale per output channel, at this node alone and at
    # every node a quantizer scales so (what its per_channel option makes).
    said = {node for output, (node, _, tested) in wanted.items() if node in tested and any(f.kind == "per_tensor_scale" for f in verdicts[output][0].findings)}
    one_scale = [node for node in nodes if node in said] if variants.recipe.candidate_model is not None else []
    keeps = [[node] for node in nodes for _ in range(3)] + [[node] for node in one_scale] + ([variants.converted_of(PER_CHANNEL_OPS)] if one_scale else [])
    outcomes = trials.run(keeps, ["all", "activations", "weights"] * len(nodes) + ["per_channel"] * (len(one_scale) + bool(one_scale)))
    tried = {node: outcomes[3 * i : 3 * i + 3] for i, node in enumerate(nodes)}
    rescaled = dict(zip(one_scale, outcomes[3 * len(nodes) :]))
    found = dict(verdicts)
    for output, (node, by, tested) in wanted.items():
        cause, repair = verdicts[output]
        before = Reading.of(control, output, by)
        of = "" if node == cause.node else f"of '{node}', by what the output decides: "

        def part(of_node: str, findings: Sequence[Finding], said_of: str = "") -> Finding:
            return Finding("part", said_of + _part_said(before, *(Reading.of(outcome, output, by) for outcome in tried[of_node]), findings))

        findings = [*cause.findings, part(node, cause.findings, of)] if node in tested else list(cause.findings)
        if node in rescaled:
            alone, every = (Reading.of(outcome, output, by) for outcome in (rescaled[node], outcomes[-1]))
            option = per_channel_option(variants.base.quantized_by.get(node), node in variants.base.reads_constant_weights)
            findings.append(Finding("per_channel", of + _per_channel_said(before, alone, every, option, bool(by.require))))
        co_causes = [replace(c, findings=[*c.findings, part(c.node, c.findings)]) if c.node in tested else c for c in cause.co_causes]
        found[output] = (replace(cause, findings=findings, co_causes=co_causes), repair)
    return found


def _per_channel_said(before: Reading, alone: Reading, every: Reading, option: str, required: bool) -> str:
    """What a scale per output channel makes of the loss, measured: this node's weight so (its activations as
    they are), then every weight a quantizer scales so, with how the tool does it. Computed as the codes read
    back in FP32, as TensorRT accumulates (in 32 bits), where ONNX Runtime's x86 INT8 kernels without VNNI
    saturate on codes that span the whole grid (MiniLM's pooled output, two sentences: 1.96x its
    tolerance computed exactly, 4.10x by those kernels, 2.0x with reduce_range=True's 7-bit codes)."""
    verdict = "meets" if every.met else "does not meet"
    return (f"its weight with a scale per output channel instead of one (symmetric codes of as many bits; its activations still quantized) "
            f"brings the output from {before.said(named=False)} to {alone.said(named=False)}; every MatMul, Gemm and Conv weight so, to {every.said()}, which {verdict} "
            f"{'what --require asks' if required else 'the tolerance'} (the codes read back and multiplied in FP32: no CPU kernel's 16-bit saturation). {option[0].upper()}{option[1:]}")


def _part_said(before: Reading, both: Reading, activations: Reading, weights: Reading, findings: Sequence[Finding]) -> str:
    """Which part of a node's quantization its loss comes from, with the figures: undoing its weights'
    alone, its activations' alone, and both (its keep)."""
    helps = {part: improvement(before.score, reading.score) > 1 / HELPS or (reading.met and not before.met)
             for part, reading in (("weights", weights), ("activations", activations), ("both", both))}
    said = (f"undoing its weights' quantization alone (its activations still quantized) brings the output from {before.said(named=False)} to {weights.said(named=False)}, "
            f"its activations' alone (its weights still quantized) to {activations.said(named=False)}, both to {both.said()}")
    if helps["weights"] == helps["activations"]:
        if helps["weights"]:
            return said + ": each part carries some of the loss"
        # (a `several` cause's node: kept alone it does not help; it costs the output beside the others)
        return said + (": neither part alone carries it, only both together" if helps["both"] else ": neither part, nor both, helps alone")
    carrier, other = ("weights", "activations") if helps["weights"] else ("activations", "weights")
    said += f": its {carrier}' quantization carries the loss"
    wrong = [f.kind for f in findings if f.kind in PART_KINDS[other]]
    return said + (f"; not the {' or '.join(dict.fromkeys(wrong))} finding above (its {other})" if wrong else "")
