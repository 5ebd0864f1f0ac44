"""The loss split: which part of a candidate's narrowing its loss comes from. A candidate made by another tool
is run with every converted node kept, each part of its narrowing undone alone (its quantization or its
casts; its activations' quantization or its weights'), in verification's batch, beside the control."""

from __future__ import annotations

import math
from typing import Sequence

from accudiff.verification.trial import TrialOutcome
from accudiff.model.formats import QUANTIZED_FORMATS
from accudiff.transforms.candidate import CandidateVariants

ACTIVATION_GRIDS = frozenset({"int8", "int8-dynamic", "fp8", "int4", "fp4"})  # formats that quantize activations (not only weights)


def loss_split_keeps(variants: CandidateVariants, formats: frozenset[str], given_alone: bool) -> list[tuple[list[str], str]]:
    """For a candidate made by another tool, every converted node kept with one part of its narrowing
    undone, to tell which part brings the loss: its quantization and its casts (ModelOpt's INT8 and FP8
    models also store the rest in FP16), and the quantization of its activations and of its weights;
    nothing for any other candidate."""
    if variants.recipe.candidate_model is None:
        return []
    every = sorted(variants.base.converted)
    pairs = [("quantization", "casts")] * bool(formats & QUANTIZED_FORMATS and formats - QUANTIZED_FORMATS)
    pairs += [("activations", "weights")] * bool(formats & ACTIVATION_GRIDS and not given_alone)  # alone, its weights are the reference's
    return [(every, part) for pair in pairs for part in pair]


def loss_split(outputs: Sequence[str], control: TrialOutcome, parts: list[TrialOutcome], split: list[tuple[list[str], str]]) -> dict[str, dict]:
    """Each failing output's tolerance ratio (and top-1 agreement) with everything, and with each part
    undone (keyed by the part undone)."""
    if not parts:
        return {}
    named = {"with_both": control, **{undone: outcome for (_, undone), outcome in zip(split, parts)}}
    return {
        output: {"ratios": {key: outcome.tol_ratio.get(output, math.inf) for key, outcome in named.items()},
                 "top1": {key: outcome.figures.get(output, {}).get("top1") for key, outcome in named.items()}}
        for output in outputs
    }
