"""What the error of a graph output does to the decision taken from it, and which tolerance it meets: per
sample, in figures that add up over samples, workers and machines. What an output decides is its kind
(output_kinds.py, read from the graph):

* logits and probabilities, per position (every vector along the kind's axis, of every sequence of every
  sample): whether the candidate's top entry is the reference's (and among its five highest, over more than
  five entries), the KL divergence KL(reference || candidate) of the two softmax distributions (of
  probabilities, the distributions themselves, each below 1e-30 read as 1e-30), and Δp, the probability the
  reference's top entry loses in the candidate; a position holding a NaN agrees with nothing (its KL is
  infinite, its Δp all the reference gave). A flip where the reference's own top two entries lie within
  NEAR_TIE nats of each other is a near-tie, counted apart (a coin the reference itself barely tossed).
  Where each position's next token is known (a decoder's generation), ΔNLL: how much less likely the
  candidate finds that token than the reference does, -log q(token) + log p(token);
* an embedding, per vector along the last axis: the cosine of the candidate's with the reference's (1 when
  both are 0, -1 for one holding a NaN), and for a [batch, dim] output of more than two rows, whether each
  row's nearest other row (by cosine) is the same on both sides;
* a probability map (a Sigmoid's output, or values all in [0, 1] nothing else explains): how many elements
  cross the output's threshold (0.5 unless set) on one side and not on the other, and the intersection and
  union of the two binarized maps (their IoU);
* a detector's boxes and class scores (YOLOv8's head: along the kind's axis, 4 box coordinates, centre,
  width and height, then a score per class): each side's detections (its highest class score at least the
  threshold, 0.25 unless set, then per class non-maximum suppression at IoU 0.7, at most 300, as ultralytics
  does), and how many of the reference's the candidate matches (the same class, IoU at least 0.5, each
  matched once, the reference's highest scores first), with how much the matched boxes overlap (their IoU);
* any float output: the tolerance it meets, the smallest atol (at the run's rtol and stol) and the
  smallest rtol (at its atol and stol) under which every element would pass; and a sketch of each
  element's error in tolerances (|err| / (atol + rtol·|ref| + stol·absmax)), for its percentiles.
Rows are read a bounded number at a time: memory stays bounded for vocabularies of 100k entries and more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable, Mapping

import numpy as np

from accudiff.judging import _reduce
from accudiff.judging.metrics import CHUNK, KERNEL_PAIRS, SKETCH_BITS, SKETCH_BUCKETS, SKETCH_LOW_EXPONENT, quantiles
from accudiff.judging.output_kinds import OutputKind
from accudiff.judging.tolerances import Tolerance

MAX_CLASSES = 1 << 20  # wider rows are not scores (a [1, N] signal, say), and ranking them costs seconds
DEFAULT_THRESHOLD = 0.5
ROWS_AT_ONCE = 1 << 20  # elements of score or embedding rows read at once (float64: 8 MB an array)
PROBABILITY_FLOOR = 1e-30
NEAR_TIE = 0.1  # nats: a flip where the reference's top two log-probabilities lie closer than this is a near-tie
MAX_NEIGHBOUR_ROWS = 4096  # a batch's nearest neighbours compare every row with every other
BOX_COORDINATES = 4  # a detector's rows: centre x, centre y, width, height, then the class scores
DETECTION_SCORE = 0.25  # ultralytics' default confidence: the default threshold of a detector's scores
NMS_IOU = 0.7  # ultralytics' default: a box overlapping a better one of its class more than this is the same detection
MATCH_IOU = 0.5  # a candidate's detection is the reference's when of the same class and overlapping it this much
MAX_DETECTIONS = 300  # ultralytics' default: detections kept per image after NMS
MAX_SCORED_BOXES = 30000  # boxes above the threshold NMS looks at, the highest scores first (as ultralytics)


@dataclass(frozen=True)
class Decision:
    """One output on one sample (see the module's docstring); counts are 0 where a figure does not apply."""

    rows: int = 0  # score vectors: positions of logits or probabilities
    sequences: int = 0  # the sequences they belong to (each row of a [batch, classes] output is its own)
    top1: int = 0
    top5: int = 0
    top5_rows: int = 0  # score vectors of more than five classes: where top-5 agreement is not vacuous
    near_ties: int = 0  # positions where the reference's top two entries lie within NEAR_TIE of each other
    near_tie_flips: int = 0  # ... whose top-1 the candidate flipped
    kl_sum: float = 0.0  # KL(reference || candidate) over the positions, added up
    kl_sq_sum: float = 0.0  # ... and its squares (the spread of the positions' KL, for intervals)
    kl_max: float = 0.0
    dp_sum: float = 0.0  # the probability the reference's top entry lost, added up over the positions
    dp_sq_sum: float = 0.0
    dp_max: float = -1.0  # ... at the position where it lost most (negative: it gained everywhere)
    nll_rows: int = 0  # positions scored on a known next token
    nll_sum: float = 0.0  # ΔNLL of that token, added up
    nll_sq_sum: float = 0.0
    vectors: int = 0  # embedding vectors
    cosine_sum: float = 0.0
    cosine_sq_sum: float = 0.0
    cosine_min: float = 1.0
    nan_vectors: int = 0  # ... holding NaN/Inf in the candidate: counted as cosine -1, the worst there is
    neighbor_rows: int = 0  # rows of a [batch, dim] embedding of more than two rows
    neighbor_same: int = 0  # ... whose nearest other row is the same on both sides
    map_elements: int = 0
    flipped: int = 0
    intersection: int = 0
    union: int = 0
    det_images: int = 0  # images a detector's output was decoded for
    det_reference: int = 0  # detections of the reference
    det_candidate: int = 0  # ... of the candidate
    det_matched: int = 0  # the reference's detections the candidate matches
    det_union: int = 0  # detections either side makes, a matched pair counted once
    det_iou_sum: float = 0.0  # the matched pairs' IoU, added up
    det_iou_sq_sum: float = 0.0  # ... and its squares
    atol_needed: float = 0.0
    rtol_needed: float = 0.0
    non_finite: int = 0  # elements NaN/Inf on one side and not the same on the other: their error is Inf


@dataclass(frozen=True, kw_only=True)
class SampleOutcome(Decision):
    """One graph output on one sample (the per-sample view of a dataset): its error, and what the error does
    to the decision taken from it (the figures of `Decision`)."""

    sample: int
    tensor: str
    max_abs_err: float
    tol_ratio: float
    outside_share: float
    sqnr_db: float


COUNTS = tuple(f.name for f in fields(Decision) if f.name not in ("atol_needed", "rtol_needed"))  # what the decision figures are made of
# How each count merges over samples and workers: its lowest or its highest kept, or (the others) added up.
LOWEST, HIGHEST = ("cosine_min",), ("kl_max", "dp_max")
SUMMED = tuple(name for name in COUNTS if name not in LOWEST + HIGHEST)


def merge_counts(into: dict, one) -> dict:
    """One sample's (or trial's) COUNTS, a mapping, merged into `into`."""
    for name in COUNTS:
        merge = min if name in LOWEST else max if name in HIGHEST else (lambda a, b: a + b)
        into[name] = merge(into[name], one[name]) if name in into else one[name]
    return into


def total_counts(rows) -> dict:
    """The COUNTS of several samples' outcomes (a DataFrame, a row each) merged."""
    return {**rows[list(SUMMED)].sum().to_dict(), **rows[list(LOWEST)].min().to_dict(), **rows[list(HIGHEST)].max().to_dict()}


def decide(ref: np.ndarray, cand: np.ndarray, kind: OutputKind, tolerance: Tolerance, threshold: float, absmax: float,
           sketches: dict[str, np.ndarray], targets: np.ndarray | None = None) -> Decision:
    """The decision figures of one output on one sample (`absmax`: of its finite reference values); each
    element's error in tolerances is added to the sketch `sketches["ratio"]`, each position's KL divergence to
    `sketches["kl"]` (SKETCH_BUCKETS counts each). `targets`: of token scores, the token each position is
    scored on for ΔNLL (-1: the reference's top entry), a position a row. Elements are read CHUNK at a time,
    rows ROWS_AT_ONCE elements at a time: memory stays bounded whatever the output's size."""
    if not np.issubdtype(ref.dtype, np.floating) or ref.shape != cand.shape or ref.size == 0:
        return Decision()
    found: dict = {}
    if kind.kind in ("logits", "probabilities"):
        found = _scores(ref, cand, kind, sketches["kl"], targets)
    elif kind.kind == "embedding":
        found = _embedding(ref, cand)
    elif kind.kind == "detections":
        found = _detections(ref, cand, kind.axis, threshold)
    r, c = np.ascontiguousarray(ref).reshape(-1), np.ascontiguousarray(cand).reshape(-1)
    is_map = kind.kind == "map" or (kind.kind == "values" and _is_probability_map(r))
    counts = np.zeros(3, np.int64)  # flipped, intersection, union
    if is_map:
        for start in range(0, r.size, CHUNK):
            counts += _map_counts(r[start : start + CHUNK].astype(np.float64), c[start : start + CHUNK].astype(np.float64), threshold)
    atol, rtol, non_finite = _tolerance_needed(r, c, tolerance, absmax, sketches["ratio"])
    if is_map:
        found.update(map_elements=r.size, flipped=int(counts[0]), intersection=int(counts[1]), union=int(counts[2]))
    return Decision(**found, atol_needed=atol, rtol_needed=rtol, non_finite=non_finite)


def _rows(array: np.ndarray, axis: int) -> np.ndarray:
    """The vectors along `axis`, one a row."""
    return np.moveaxis(np.asarray(array), axis, -1).reshape(-1, array.shape[axis])


def _scores(ref: np.ndarray, cand: np.ndarray, kind: OutputKind, kl_sketch: np.ndarray, targets: np.ndarray | None) -> dict:
    """Per-position figures of logits or probabilities along the kind's axis (see the module's docstring)."""
    width = ref.shape[kind.axis]
    if ref.ndim < 2 or not 2 <= width <= MAX_CLASSES:
        return {}
    r, c = _rows(ref, kind.axis), _rows(cand, kind.axis)
    scored = targets is not None and np.asarray(targets).size == r.shape[0]
    targets = np.asarray(targets, np.int64).reshape(-1) if scored else None
    found = dict(rows=r.shape[0], sequences=ref.shape[0] if ref.ndim > 2 else r.shape[0],  # a [batch, positions, entries] output: its batch
                 top1=0, top5=0, top5_rows=r.shape[0] if width > 5 else 0, near_ties=0, near_tie_flips=0, kl_sum=0.0, kl_sq_sum=0.0, kl_max=0.0,
                 dp_sum=0.0, dp_sq_sum=0.0, dp_max=-1.0, nll_rows=r.shape[0] if scored else 0, nll_sum=0.0, nll_sq_sum=0.0)
    step = max(1, ROWS_AT_ONCE // width)
    for start in range(0, r.shape[0], step):
        part_r, part_c = r[start : start + step].astype(np.float64), c[start : start + step].astype(np.float64)
        decided = np.isfinite(part_c).all(axis=1)  # a position holding a NaN or Inf decides nothing
        top = part_r.argmax(axis=1)
        agree = (part_c.argmax(axis=1) == top) & decided
        found["top1"] += int(np.count_nonzero(agree))
        if width > 5:  # among the candidate's five highest: fewer than five entries above it (a tie counts for it)
            above = np.count_nonzero(part_c > np.take_along_axis(part_c, top[:, None], axis=1), axis=1)
            found["top5"] += int(np.count_nonzero((above < 5) & decided))
        log_p, log_q = (_log_distribution(part, kind.kind) for part in (part_r, np.where(decided[:, None], part_c, 0.0)))
        p = np.exp(log_p)
        kl = np.where(decided, np.maximum((p * (log_p - log_q)).sum(axis=1), 0.0), np.inf)
        taken = np.take_along_axis(p, top[:, None], axis=1)[:, 0]
        dp = taken - np.where(decided, np.exp(np.take_along_axis(log_q, top[:, None], axis=1)[:, 0]), 0.0)
        two = np.partition(log_p, width - 2, axis=1)[:, -2:]
        tied = (two[:, 1] - two[:, 0]) < NEAR_TIE
        found["near_ties"] += int(np.count_nonzero(tied))
        found["near_tie_flips"] += int(np.count_nonzero(tied & ~agree))
        found["kl_sum"] += float(kl.sum())
        found["kl_sq_sum"] += float(np.square(kl).sum())
        found["kl_max"] = max(found["kl_max"], float(kl.max()))
        found["dp_sum"] += float(dp.sum())
        found["dp_sq_sum"] += float(np.square(dp).sum())
        found["dp_max"] = max(found["dp_max"], float(dp.max()))
        if targets is not None:
            token = targets[start : start + step]
            token = np.where(token >= 0, token, top)[:, None]
            nll = np.where(decided, np.take_along_axis(log_p, token, axis=1)[:, 0] - np.take_along_axis(log_q, token, axis=1)[:, 0], np.inf)
            found["nll_sum"] += float(nll.sum())
            found["nll_sq_sum"] += float(np.square(nll).sum())
        _add_to_sketch(kl_sketch, kl)
    return found


def _log_distribution(rows: np.ndarray, kind: str) -> np.ndarray:
    """Each row's log-probabilities: a log-softmax of logits, or of probabilities their own logarithms
    (normalized; each below PROBABILITY_FLOOR read as it)."""
    if kind == "logits":
        shifted = rows - rows.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    p = np.maximum(rows, 0.0)
    p = p / np.maximum(p.sum(axis=1, keepdims=True), PROBABILITY_FLOOR)
    return np.log(np.maximum(p, PROBABILITY_FLOOR))


def _embedding(ref: np.ndarray, cand: np.ndarray) -> dict:
    """Per-vector cosines along the last axis, and the nearest neighbours of a [batch, dim] output's rows."""
    r, c = _rows(ref, -1), _rows(cand, -1)
    found = dict(vectors=r.shape[0], cosine_sum=0.0, cosine_sq_sum=0.0, cosine_min=1.0, nan_vectors=int(np.count_nonzero(~np.isfinite(c).all(axis=1))))
    step = max(1, ROWS_AT_ONCE // r.shape[1])
    for start in range(0, r.shape[0], step):
        cosine = _cosines(r[start : start + step].astype(np.float64), c[start : start + step].astype(np.float64))
        found["cosine_sum"] += float(cosine.sum())
        found["cosine_sq_sum"] += float(np.square(cosine).sum())
        found["cosine_min"] = min(found["cosine_min"], float(cosine.min()))
    if ref.ndim == 2 and 2 < r.shape[0] <= MAX_NEIGHBOUR_ROWS:
        found.update(neighbor_rows=r.shape[0], neighbor_same=int(np.count_nonzero(_nearest(r) == _nearest(c))))
    return found


def _cosines(r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Row by row: 1 where both are 0, 0 where one is, -1 where the candidate holds a NaN or Inf."""
    norms = np.linalg.norm(r, axis=1) * np.linalg.norm(np.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(norms > 0, (r * c).sum(axis=1) / norms, np.where((r == 0).all(axis=1) & (c == 0).all(axis=1), 1.0, 0.0))
    return np.where(np.isfinite(c).all(axis=1), np.clip(cosine, -1.0, 1.0), -1.0)


def _nearest(rows: np.ndarray) -> np.ndarray:
    """Each row's nearest other row by cosine (a row holding a NaN is nobody's neighbour and has none: -1)."""
    rows = rows.astype(np.float64)
    finite = np.isfinite(rows).all(axis=1)
    unit = np.where(finite[:, None], rows, 0.0)
    unit = unit / np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), np.finfo(np.float64).tiny)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    similarity[:, ~finite] = -np.inf
    return np.where(finite, similarity.argmax(axis=1), -1)


def threshold_for(output: str, kind: str, thresholds: Mapping[str, float]) -> float:
    """The threshold `--threshold` sets for `output`, else its kind's default: 0.5 for a probability map,
    DETECTION_SCORE for a detector's class scores."""
    return thresholds.get(output, thresholds.get("", DETECTION_SCORE if kind == "detections" else DEFAULT_THRESHOLD))


def _detections(ref: np.ndarray, cand: np.ndarray, axis: int, threshold: float) -> dict:
    """Each image's detections on both sides, and how many of the reference's the candidate matches (see
    the module's docstring); the images are the output's rows along every axis but `axis` and the boxes'.
    An axis not read from the graph (-1, as `--output-kind NAME=detections` gives it) is the shorter of the
    last two: an image holds more boxes than each has coordinates and scores ([1, 84, 8400] or [1, 8400, 84])."""
    if ref.ndim < 2:
        return {}
    if axis == -1 and ref.shape[-2] < ref.shape[-1]:
        axis = -2
    if ref.shape[axis] <= BOX_COORDINATES:
        return {}
    r, c = np.moveaxis(ref, axis, -1), np.moveaxis(cand, axis, -1)
    r, c = r.reshape(-1, *r.shape[-2:]), c.reshape(-1, *c.shape[-2:])  # [image, box, coordinates and scores]
    found = dict(det_images=r.shape[0], det_reference=0, det_candidate=0, det_matched=0, det_union=0, det_iou_sum=0.0, det_iou_sq_sum=0.0)
    for image_r, image_c in zip(r, c):
        (boxes_r, classes_r), (boxes_c, classes_c) = _detected(image_r, threshold), _detected(image_c, threshold)
        overlaps = _matched(boxes_r, classes_r, boxes_c, classes_c)
        found["det_reference"] += len(boxes_r)
        found["det_candidate"] += len(boxes_c)
        found["det_matched"] += len(overlaps)
        found["det_union"] += len(boxes_r) + len(boxes_c) - len(overlaps)
        found["det_iou_sum"] += float(np.sum(overlaps))
        found["det_iou_sq_sum"] += float(np.sum(np.square(overlaps)))
    return found


def _detected(rows: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """One image's detections (boxes as corners, classes), the highest score first: rows whose best class
    score reaches `threshold` (a row holding a NaN detects nothing), then per class NMS."""
    rows = rows.astype(np.float64)
    scores = np.nan_to_num(rows[:, BOX_COORDINATES:], nan=-np.inf).max(axis=1)
    chosen = np.flatnonzero((scores >= threshold) & np.isfinite(rows).all(axis=1))
    chosen = chosen[np.argsort(-scores[chosen], kind="stable")][:MAX_SCORED_BOXES]
    centre, size = rows[chosen, :2], rows[chosen, 2:BOX_COORDINATES]
    boxes, classes = np.concatenate([centre - size / 2, centre + size / 2], axis=1), rows[chosen, BOX_COORDINATES:].argmax(axis=1)
    suppressed = np.zeros(len(chosen), bool)
    kept = []
    for i in range(len(chosen)):
        if suppressed[i]:
            continue
        kept.append(i)
        if len(kept) == MAX_DETECTIONS:
            break
        suppressed[i + 1 :] |= (classes[i + 1 :] == classes[i]) & (_iou(boxes[i], boxes[i + 1 :]) > NMS_IOU)
    return boxes[kept], classes[kept]


def _matched(boxes_r: np.ndarray, classes_r: np.ndarray, boxes_c: np.ndarray, classes_c: np.ndarray) -> list[float]:
    """The IoU of each of the reference's detections (the highest score first) a candidate's detection
    matches: the same class, IoU at least MATCH_IOU, the best overlap not yet taken."""
    taken = np.zeros(len(boxes_c), bool)
    overlaps = []
    for box, label in zip(boxes_r, classes_r):
        overlap = np.where(taken | (classes_c != label), -1.0, _iou(box, boxes_c))
        if overlap.size and overlap.max() >= MATCH_IOU:
            taken[overlap.argmax()] = True
            overlaps.append(float(overlap.max()))
    return overlaps


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """The intersection over union of `box` (corners) with each of `boxes`."""
    low, high = np.maximum(box[:2], boxes[:, :2]), np.minimum(box[2:], boxes[:, 2:])
    inter = np.prod(np.clip(high - low, 0.0, None), axis=1)
    area = np.prod(np.clip(box[2:] - box[:2], 0.0, None)) + np.prod(np.clip(boxes[:, 2:] - boxes[:, :2], 0.0, None), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(area - inter > 0, inter / (area - inter), 0.0)


def _is_probability_map(r: np.ndarray) -> bool:
    """Float values all in [0, 1] (no NaN): what a sigmoid or a softmax over a map gives."""
    low, high = np.min(r), np.max(r)
    return bool(np.isfinite(low) and np.isfinite(high) and low >= 0 and high <= 1)


def _map_counts(r: np.ndarray, c: np.ndarray, threshold: float) -> np.ndarray:
    """(elements on the other side of `threshold`, intersection, union) of the two binarized maps."""
    above_r, above_c = r > threshold, np.nan_to_num(c, nan=-np.inf) > threshold
    return np.array([np.count_nonzero(above_r != above_c), np.count_nonzero(above_r & above_c), np.count_nonzero(above_r | above_c)], np.int64)


def _tolerance_needed(r: np.ndarray, c: np.ndarray, tolerance: Tolerance, absmax: float, ratios: np.ndarray) -> tuple[float, float, int]:
    """(the smallest atol at the run's rtol and stol, the smallest rtol at its atol and stol) under which
    every element passes (infinite where none would: NaN/Inf on one side only, or an error where the
    reference is 0 for rtol), and the count of elements NaN/Inf on one side only (or Inf of the other
    sign); each element's error in tolerances goes into `ratios`. Computed by the compiled kernel
    (_reduce.c: each element in float64, as numpy would; tests hold it to numpy), which reads float32 with
    float32 or float16, or two float64 buffers: other pairs are widened a chunk at a time."""
    spread = tolerance.stol * absmax
    if (r.dtype, c.dtype) in KERNEL_PAIRS:
        parts: Iterable[tuple[np.ndarray, np.ndarray]] = [(r, c)]
    else:
        parts = ((r[start : start + CHUNK].astype(np.float64), c[start : start + CHUNK].astype(np.float64)) for start in range(0, r.size, CHUNK))
    atol = rtol = 0.0
    non_finite = 0
    for part_r, part_c in parts:
        part_atol, part_rtol, part_non_finite = _reduce.tolerance_needed(part_r, part_c, tolerance.atol, tolerance.rtol, spread, ratios)
        atol, rtol, non_finite = max(atol, part_atol), max(rtol, part_rtol), non_finite + part_non_finite
    return atol, rtol, non_finite


def _add_to_sketch(sketch: np.ndarray, values: np.ndarray) -> None:
    """Count `values` (non-negative) into a sketch laid out as the kernel's error sketch: the float32
    exponent and top SKETCH_BITS mantissa bits; 0 and values below its lowest octave in bucket 0, Inf
    (and what overflows float32) in the last."""
    single = np.minimum(values, np.finfo(np.float32).max).astype(np.float32)
    bits = single.view(np.uint32).astype(np.int64)
    exponent = ((bits >> 23) & 0xFF) - 127 - SKETCH_LOW_EXPONENT
    bucket = (exponent << SKETCH_BITS) + ((bits >> (23 - SKETCH_BITS)) & ((1 << SKETCH_BITS) - 1))
    bucket = np.where(single > 0, np.clip(bucket, 0, SKETCH_BUCKETS - 1), 0)
    bucket = np.where(np.isinf(values), SKETCH_BUCKETS - 1, bucket)
    sketch += np.bincount(bucket, minlength=SKETCH_BUCKETS)


def decision_figures(counts: dict, threshold: float | None = None) -> dict:
    """The decision figures of an output from its COUNTS merged over samples (figures that do not apply are
    left out): top-1/top-5 agreement, mean and largest KL divergence, mean and worst Δp of scores; the mean
    and lowest cosine, the nearest neighbours kept, of an embedding; a probability map's flipped share and IoU;
    a detector's detections on both sides and their agreement (the matched over those either side makes)."""
    found: dict = {}
    if counts.get("rows"):
        vectors = int(counts["rows"])
        found.update(score_vectors=vectors, sequences=int(counts["sequences"]), top1=float(counts["top1"] / vectors),
                     kl=float(counts["kl_sum"] / vectors), kl_max=float(counts["kl_max"]), delta_p=float(counts["dp_sum"] / vectors),
                     delta_p_max=float(counts["dp_max"]))
        if counts.get("top5_rows"):
            found["top5"] = float(counts["top5"] / counts["top5_rows"])
        found.update(flips=vectors - int(counts["top1"]), near_tie_flips=int(counts.get("near_tie_flips", 0)), near_ties=int(counts.get("near_ties", 0)))
        if counts.get("nll_rows"):
            found.update(delta_nll=float(counts["nll_sum"] / counts["nll_rows"]), nll_positions=int(counts["nll_rows"]))
    if counts.get("vectors"):
        found.update(vectors=int(counts["vectors"]), cosine=float(counts["cosine_sum"] / counts["vectors"]), cosine_min=float(counts["cosine_min"]))
        if counts.get("nan_vectors"):
            found["nan_vectors"] = int(counts["nan_vectors"])
        if counts.get("neighbor_rows"):
            found.update(neighbor_rows=int(counts["neighbor_rows"]), neighbors=float(counts["neighbor_same"] / counts["neighbor_rows"]))
    if counts.get("det_images"):
        found.update(**({"threshold": threshold} if threshold is not None else {}), detection_images=int(counts["det_images"]),
                     reference_detections=int(counts["det_reference"]), candidate_detections=int(counts["det_candidate"]),
                     matched_detections=int(counts["det_matched"]))
        if counts["det_union"]:
            found["detections"] = float(counts["det_matched"] / counts["det_union"])
        if counts["det_matched"]:
            found["matched_iou"] = float(counts["det_iou_sum"] / counts["det_matched"])
    if counts.get("map_elements"):
        elements, union = int(counts["map_elements"]), int(counts["union"])
        found.update(**({"threshold": threshold} if threshold is not None else {}), map_elements=elements,
                     flipped_share=float(counts["flipped"] / elements), iou=float(counts["intersection"] / union) if union else 1.0)
    return found


def summarize(rows, sketches: dict[str, np.ndarray], errors: np.ndarray | None, threshold: float) -> dict:
    """An output's decision figures over every sample (`rows`: its per-sample outcomes, a DataFrame;
    `sketches`: of its elements' errors in tolerances ("ratio") and of its positions' KL divergences ("kl");
    `errors`: of its elements' absolute errors)."""
    counts = total_counts(rows)
    found = decision_figures(counts, threshold)
    if errors is not None:
        errors = np.array(errors, np.int64)
        errors[-1] += int(counts["non_finite"])  # the kernel's sketch holds finite errors only; these are Inf
        found.update(zip(("p99_abs_err", "p999_abs_err"), _percentiles(errors)))
    ratios, kl = sketches.get("ratio"), sketches.get("kl")
    if ratios is not None and ratios.sum():
        found.update(zip(("p99_tol_ratio", "p999_tol_ratio"), _percentiles(ratios)))
    if "kl" in found and kl is not None and kl.sum():  # read from the sketch (within 1.6%), never beyond the exact largest
        found["kl_median"], found["kl_p99"] = (min(math.inf if q[0] >= _TOP else float(q[0]), found["kl_max"]) for q in quantiles(kl[None], (0.5, 0.99)))
    return found


def _percentiles(sketch: np.ndarray) -> list[float]:
    """The 99th and 99.9th percentiles of a sketch, Inf where they fall in the last bucket (where Inf is counted)."""
    return [math.inf if q[0] >= _TOP else float(q[0]) for q in quantiles(sketch[None], (0.99, 0.999))]


_TOP = quantiles(np.eye(1, SKETCH_BUCKETS, SKETCH_BUCKETS - 1, dtype=np.int64), (0.5,))[0][0]  # what the last bucket (Inf) reads as


def tolerance_met(rows) -> dict[str, float]:
    """The smallest atol (at the run's rtol and stol) and the smallest rtol (at its atol and stol) under
    which the output passes on every sample."""
    return {"atol": float(rows["atol_needed"].max()), "rtol": float(rows["rtol_needed"].max())}
