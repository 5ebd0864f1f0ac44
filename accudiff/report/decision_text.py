"""What an output's error does to the decision taken from it, in words, with the figures' intervals: the
lines the console, report.html and the bisectors share; a decoder's figures per phase, its KV cache and its
greedy generation."""

from __future__ import annotations

import math
from typing import Callable

from accudiff.judging.decisions import MATCH_IOU, NEAR_TIE
from accudiff.judging.intervals import FIGURES, MIN_UNITS, Interval
from accudiff.judging.objective import REQUIREMENTS, figure_style
from accudiff.judging.output_kinds import OutputKind
from accudiff.model.prompts import decode_tokens
from accudiff.text import digits_apart, fixed, general, percent, signed, times_tolerance

GENERATIONS_SHOWN = 3  # prompts whose two continuations the console prints


def interval_text(name: str, span: Interval | None) -> str:
    """A figure's 95% interval, as said beside it: " [97.0%, 99.8%]"; nothing where it has none."""
    if span is None:
        return ""
    share = FIGURES[name][3] == "share"
    decimals = max(1, 2 - math.floor(math.log10(max(span.high * 100, 1e-9)))) if share else 0  # three significant digits of the larger bound
    low, high = (percent(v, min(decimals, 6)) if share else f"{v:.3g}" for v in (span.low, span.high))
    return f" [{low}, {high}]"


def with_interval(name: str, value: float, span: Interval | None, text: Callable[[float, int], str], digits: int) -> str:
    """A figure (`text` at a precision, `digits`) and its 95% interval beside it as `interval_text` says it:
    "96.88% [89.3%, 99.1%]". Where rounding would print a bound on the wrong side of the figure, or two
    different bounds alike (a cosine's "0.999999 [1, 1]"), all three with more digits, alike."""
    shown, bounds = text(value, digits), interval_text(name, span)
    more = 0
    while span is not None and not _consistent(shown, bounds, span) and more < 8:
        more += 1
        shown, low, high = (text(v, digits + more) for v in (value, span.low, span.high))
        bounds = f" [{low}, {high}]"
    return shown + bounds


def _consistent(shown: str, bounds: str, span: Interval) -> bool:
    """The printed figure within its printed bounds, and different bounds printed differently ("<0.1%" and
    the like, not numbers, are taken as they are)."""
    low, high = bounds.strip(" []").split(", ")
    try:
        figure, lowest, highest = (float(t.rstrip("%")) for t in (shown, low, high))
    except ValueError:
        return True
    return lowest <= figure <= highest and (low != high or span.low == span.high)


def said_figure(name: str, value: float, span: Interval | None, target: float | None = None) -> str:
    """A required figure as `figure_text` says it (beside its `target`, never reading as it when it is not), with its interval."""
    text, digits = figure_style(name)
    return with_interval(name, value, span, text, digits_apart(value, target, text, digits))


def interval_note(spans: dict[str, Interval], prompts: bool = False, independent: bool = False) -> str:
    """How the intervals of an output's figures were made, in words; `independent`: its positions are rows
    of their own (a batch of class scores), not positions of a few sequences, which are not independent."""
    span = next(iter(spans.values()), None)
    if span is None:
        return ""
    units = "prompts" if prompts else "samples"
    what = FIGURES[next(iter(spans))][4]
    if span.clustered:
        return f"[95% intervals, resampling the {span.units} {units}]"
    if independent:
        return f"[95% intervals over the {span.positions} {what}, each its own sequence]"
    return (f"[95% intervals over {span.positions} {what} taken as independent: with fewer than {MIN_UNITS} {units} the spread between them "
            "is not measured, and the intervals are likely too narrow]")


def decision_lines(output: str, found: dict, kind: OutputKind | None = None, spans: dict[str, Interval] | None = None, prompts: int = 0) -> list[str]:
    """What an output's error does to the decision taken from it (judging/decisions.py), in one line, by
    its kind (and why it was given), with 95% intervals (`spans`): scores' top-1 agreement, KL divergence,
    Δp (and ΔNLL where the next tokens are known); an embedding's cosines and neighbours; a probability
    map's flipped elements; or else its error percentiles. `prompts`: a decoder's, generated from."""
    what = f" ({kind.why})" if kind is not None and kind.why else ""
    spans = spans or {}
    if "top1" in found:
        vectors, sequences = found["score_vectors"], found["sequences"]
        where = (f"over {vectors} positions of {prompts} prompt(s)" if prompts else f"over {vectors} positions of {sequences} sequence(s)"
                 if sequences < vectors else f"over {vectors} score vector(s)")
        lines = [f"  {kind.kind if kind is not None else 'scores'} '{output}'{what}: top-1 agreement "
                 f"{with_interval('top1', found['top1'], spans.get('top1'), percent, 2)} {where}"]
        if found.get("near_tie_flips"):
            lines.append(f"    {found['near_tie_flips']} of the {found['flips']} flip(s) are near-ties: the reference's own top two within {NEAR_TIE:g} nats")
        top5 = f"top-5 agreement {with_interval('top5', found['top5'], spans.get('top5'), percent, 2)}; " if "top5" in found else ""
        spread = ", ".join(f"{name} {_figure(found[key])}" for name, key in (("median", "kl_median"), ("p99", "kl_p99"), ("max", "kl_max")) if key in found)
        lines.append(f"    {top5}KL divergence mean {with_interval('kl', found['kl'], spans.get('kl'), general, 3)} ({spread})")
        lines.append(f"    Δp, what the candidate takes from the probability of the reference's top entry (negative: it gives more): "
                     f"mean {with_interval('delta_p', found['delta_p'], spans.get('delta_p'), general, 3)}, at worst {found['delta_p_max']:.3g}")
        if "delta_nll" in found:
            lines.append(f"    ΔNLL, what the reference's next token costs the candidate more than the reference, in nats (negative: less): "
                         f"mean {with_interval('delta_nll', found['delta_nll'], spans.get('delta_nll'), signed, 3)}")
        note = interval_note(spans, bool(prompts), sequences == vectors)
        return lines + ([f"    {note}"] if note else [])
    if "cosine" in found:
        neighbours = (f"; each row's nearest other row in the batch is the same for {percent(found['neighbors'], 2)} of {found['neighbor_rows']} rows"
                      if "neighbors" in found else "")
        poisoned = f" ({found['nan_vectors']} of them hold NaN/Inf in the candidate, each counted as cosine -1)" if found.get("nan_vectors") else ""
        note = interval_note(spans)
        return [f"  embedding '{output}'{what}: cosine mean {with_interval('cosine', found['cosine'], spans.get('cosine'), fixed, 6)}, lowest {found['cosine_min']:.6f} "
                f"over {found['vectors']} vector(s){poisoned}{neighbours}"] + ([f"    {note}"] if note else [])
    if "detection_images" in found:
        return detection_lines(output, found, what, spans)
    if "flipped_share" in found:
        note, span = interval_note(spans), spans.get("flipped_share")
        flipped = with_interval("flipped_share", found["flipped_share"], span, percent, 3)
        if span is not None and span.positions == span.units:  # one probability a sample (a yes/no classifier): no map, no IoU
            said = f"  probability '{output}'{what}: {flipped} of its {span.units} decisions, one a sample, fall on the other side of {found['threshold']:g} (--threshold)"
        else:
            said = (f"  probability map '{output}'{what}: {flipped} of its elements fall on the other side of {found['threshold']:g} (--threshold), "
                    f"IoU of the binarized maps {found['iou']:.4f}")
        return [said] + ([f"    {note}"] if note else [])
    if "p999_tol_ratio" in found:
        return [f"  error percentiles '{output}'{what}: p99 |err| {found['p99_abs_err']:.3g}, p99.9 {found['p999_abs_err']:.3g}; in tolerances p99 "
                f"{times_tolerance(found['p99_tol_ratio'], '')}, p99.9 {times_tolerance(found['p999_tol_ratio'], '')}"]
    return []


def detection_lines(output: str, found: dict, what: str, spans: dict[str, Interval]) -> list[str]:
    """A detector's output: the detections both sides make, with their agreement's interval; or that neither
    side detects anything at the threshold (no figure, said rather than counted as agreement)."""
    images, reference, candidate, matched = (found[k] for k in ("detection_images", "reference_detections", "candidate_detections", "matched_detections"))
    head = f"  detections '{output}'{what}:"
    if "detections" not in found:
        return [f"{head} neither side detects anything with a class score of at least {found['threshold']:g} in {images} image(s), so there is no "
                "detection to agree on: give a lower --threshold, or images with objects in them"]
    note = interval_note(spans)
    lines = [f"{head} the candidate finds {matched} of the reference's {reference} detection(s) in {images} image(s) (same class, IoU ≥ {MATCH_IOU:g}) "
             f"and {candidate - matched} of its own match{'es' if candidate - matched == 1 else ''} none of the reference's; detection agreement {with_interval('detections', found['detections'], spans.get('detections'), percent, 2)} "
             f"(class score ≥ {found['threshold']:g}, --threshold)"]
    if "matched_iou" in found:
        lines.append(f"    the matched boxes overlap by IoU {with_interval('matched_iou', found['matched_iou'], spans.get('matched_iou'), fixed, 4)} on average")
    return lines + ([f"    {note}"] if note else [])


def _figure(value: float) -> str:
    return general(value, 3)


def output_kind(result, output: str) -> str:
    kind = result.output_kinds.get(output)
    return kind.kind if kind is not None else "values"


def sample_name(result, sample: int) -> str:
    """A sample as a reader knows it: a decoder's step of a prompt, else its number."""
    if result.steps is None:
        return f"sample {sample}"
    step = result.steps.set_index("sample").loc[sample]
    return f"prompt {int(step['sequence'])}'s {'prefill' if step['phase'] == 'prefill' else f'decode step {int(step.step)}'}"


def phase_lines(phases: dict[str, dict]) -> list[str]:
    """A decoder's scores per phase: its prefills' positions, and its decode steps (each side carrying its own KV cache)."""
    lines = []
    for phase, found in phases.items():
        figures, spans = found["figures"], found["intervals"]
        what = "prefill" if phase == "prefill" else "decode, each side carrying its own KV cache"
        nll = f", ΔNLL {with_interval('delta_nll', figures['delta_nll'], spans.get('delta_nll'), signed, 3)}" if "delta_nll" in figures else ""
        lines.append(f"{what} ({figures['score_vectors']} positions): top-1 {with_interval('top1', figures['top1'], spans.get('top1'), percent, 2)}, "
                     f"KL mean {with_interval('kl', figures['kl'], spans.get('kl'), general, 3)}, max {_figure(figures['kl_max'])}{nll}")
    if {"prefill", "decode"} <= phases.keys():
        lines.append(entry_text(phases))
    return lines


def entry_text(phases: dict[str, dict]) -> str:
    """Whether a decoder's error enters in the prefill or grows through the cache: the decode steps' KL against the prefill's."""
    prefill, decode = phases["prefill"]["figures"]["kl"], phases["decode"]["figures"]["kl"]
    span = phases["decode"]["intervals"].get("kl")
    said = f"the decode steps' KL, {with_interval('kl', decode, span, general, 3)}, {{}} the prefill's, {_figure(prefill)}"
    if prefill == 0:  # no error enters in the prefill (a KV cache stored rounded, and nothing else)
        return "the candidate's next-token distributions are the reference's in both phases (KL 0)" if decode == 0 else (
            "the error arises only in the decode steps: " + said.format("against"))
    if span is not None and span.low > prefill:
        return "the error grows through the KV cache: " + said.format("lies above")
    if span is not None and span.high < prefill:
        return "the error enters in the prefill and does not grow through the KV cache: " + said.format("lies below")
    # An interval that holds the prefill's KL: a few decode positions cannot show growth, nor its absence.
    return "the error enters in the prefill and is not shown to grow through the KV cache: " + said.format(
        "whose interval holds" if span is not None else "has no interval to tell it from")


def state_lines(result, state: list[str]) -> list[str]:
    """A decoder's KV-cache outputs in one line: compared, and judged through the logits of later steps."""
    if not state:
        return []
    rows = result.samples[result.samples["tensor"].isin(state)]
    failing = rows[rows["status"] == "fail"]
    # The worst step output by the measure "outside tolerance" counts (it read "9 outside tolerance; the worst at 0.805x
    # its tolerance", a 99.9th percentile over every step beside a count of steps judged each by its share outside).
    worst = rows.loc[rows["tol_ratio"].idxmax()] if rows["tol_ratio"].notna().any() else None
    said = (f"; the worst, '{worst['tensor']}' at {sample_name(result, int(worst['sample']))}: {percent(worst['outside_share'])} of elements outside, "
            f"{times_tolerance(worst['tol_ratio'])}" if worst is not None else "")
    return [f"  KV cache: {len(state)} present output(s), the model's state (each fed back as its past at the next step), compared and judged through "
            f"the logits of later steps: {len(failing)} of {len(rows)} step outputs outside tolerance{said}"]


def generation_lines(result) -> list[str]:
    """A decoder's greedy generation: where the candidate, choosing on its own, first parts from the reference, and both continuations."""
    if not result.generations:
        return []
    parted = [g for g in result.generations if g["diverged_at"] is not None]
    given = any(g["given"] for g in result.generations)
    whose = "the continuation given" if given else "the reference's greedy choices"
    count = len(result.generations)
    if all(len(g["reference"]) <= 1 for g in result.generations):  # no decode step (--new-tokens 0): the prefill's next token alone
        lines = ["  generation: the prefill only; the candidate's greedy next token "
                 + (f"differs from the reference's in {len(parted)} of {count} prompt(s)" if parted else f"is the reference's in all {count} prompt(s)")]
    else:
        lines = [f"  generation: both sides fed {whose}; the candidate choosing greedily on its own "
                 + (f"parts from them in {len(parted)} of {count} prompt(s)" if parted else f"chooses the same in all {count} prompt(s)")]
    folder = result.model.parent
    for g in parted[:GENERATIONS_SHOWN]:
        at = g["diverged_at"]
        lines.append(f"    prompt {g['sequence']}: first different token at {'the prefill' if at == 0 else f'decode step {at}'} "
                     f"(token {at + 1} after the prompt)")
        for side in ("reference", "candidate"):
            tokens = g[side]
            text = decode_tokens(folder, tokens)
            lines.append(f"      {side + ':':<10} {repr(text) if text is not None else tokens}")
    if len(parted) > GENERATIONS_SHOWN:
        lines.append(f"    and {len(parted) - GENERATIONS_SHOWN} more prompt(s) (report.html, summary.json)")
    return lines


def unresolved_lines(result) -> list[str]:
    """The requirements of a comparison's outputs that its data cannot resolve, each said so."""
    return [unresolved_text(output, r, bool(result.generations)) for output, found in result.unresolved.items() for r in found]


def unresolved_text(output: str, resolution, prompts: bool) -> str:
    """A requirement the data cannot resolve, said so, with about how much more data would."""
    name, direction = resolution.name, "reaches" if resolution.direction == "min" else "stays at most at"
    span, units = resolution.interval, "prompts" if prompts else "samples"
    what = REQUIREMENTS[name][1]
    measured = f"{said_figure(name, resolution.value, span, resolution.target)} over {span.positions} {FIGURES[name][4]} of {span.units} {units[:-1] if span.units == 1 else units}"
    needed = ("no amount of data would tell: the figure equals the target" if resolution.needed is None else
              f"about {resolution.needed:,.0f} {units} like these would" if math.isfinite(resolution.needed) else "far more data than this would")
    return f"output '{output}': the data cannot tell whether its {what} {direction} {resolution.target:g}: {measured}; {needed}"
