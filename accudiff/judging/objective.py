"""How a keep is judged at the graph outputs, in verification and `bisect precision`: by the output's tolerance
ratio (the default), or by the decision taken from it (`--objective decision`: class scores' top-1 agreement,
a probability map's flipped share), towards a target where one is required (`--require top1=0.97`).

An elementwise tolerance can be tighter than a format's accumulated rounding while the decision hardly moves
(a detector's map flips 0.02% of its pixels), and a keep can lift top-1 agreement from 93% to 97.5% while the
worst element's ratio barely moves: judged by the ratio alone, the most useful keep looks useless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping, Sequence

from accudiff.judging.intervals import Interval, best_case, needed_units, resolve
from accudiff.errors import AccudiffError
from accudiff.text import digits_apart, fixed, general, percent, times_tolerance

OBJECTIVES = ("tolerance", "decision")
# A required figure: whether it must reach its target from below ("min") or stay under it ("max"), its name, and
# the kind of output it applies to (judging/decisions.py, output_kinds.py).
REQUIREMENTS = {
    "top1": ("min", "top-1 agreement", "logits or probabilities"), "top5": ("min", "top-5 agreement", "logits or probabilities of more than five entries"),
    "kl": ("max", "KL divergence (mean)", "logits or probabilities"), "kl_max": ("max", "largest KL divergence", "logits or probabilities"),
    "delta_p": ("max", "Δp (mean)", "logits or probabilities"),
    "cosine": ("min", "cosine (mean)", "an embedding"), "cosine_min": ("min", "lowest cosine", "an embedding"),
    "neighbors": ("min", "nearest-neighbour agreement", "an embedding of more than two rows"),
    "iou": ("min", "IoU", "a probability map"), "flipped_share": ("max", "flipped share", "a probability map"),
    "detections": ("min", "detection agreement", "a detector's boxes and class scores"),
}
UNBOUNDED = frozenset({"kl", "kl_max"})  # the figures that are no share (between 0 and 1)


def parse_requirements(texts: Iterable[str]) -> dict[str, float]:
    """`["top1=0.97", "kl=0.01"]` -> {"top1": 0.97, "kl": 0.01}; one sentence if malformed."""
    found = {}
    for text in texts:
        name, _, value = str(text).partition("=")
        if name not in REQUIREMENTS:
            raise AccudiffError(f"--require '{text}' names no decision figure; it takes {', '.join(f'{n}=VALUE' for n in REQUIREMENTS)}")
        try:
            target = float(value)
        except ValueError:
            raise AccudiffError(f"--require '{text}' is not FIGURE=VALUE, e.g. top1=0.97") from None
        if name in UNBOUNDED and not 0 <= target < math.inf:
            raise AccudiffError(f"--require '{text}': {REQUIREMENTS[name][1]} is 0 or more")
        if name not in UNBOUNDED and not 0 <= target <= 1:
            raise AccudiffError(f"--require '{text}': {REQUIREMENTS[name][1]} is a share, between 0 and 1")
        found[name] = target
    return found


@dataclass(frozen=True)
class Resolution:
    """A required figure against its target: "met", "missed" or "unresolved" (its 95% interval straddles the
    target: the data cannot tell), with the interval and, when unresolved, about how many more units
    (sequences, samples) of the same size would tell (None: none would, the figure equals the target)."""

    name: str
    target: float
    value: float
    outcome: str
    interval: Interval | None = None
    needed: float | None = None

    @property
    def direction(self) -> str:
        return REQUIREMENTS[self.name][0]


@dataclass(frozen=True)
class Objective:
    """`kind` "tolerance" or "decision", and the required figures (name -> target). An output with a required
    figure is met when its figures reach their targets, else when it is within tolerance."""

    kind: str = "tolerance"
    require: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise AccudiffError(f"--objective takes {' or '.join(OBJECTIVES)}, not '{self.kind}'")

    def miss(self, figures: Mapping[str, float]) -> float | None:
        """How far the required figures the output has are from their targets (at most 1: every one
        reached), or None when it has none of them."""
        misses = [_miss(figures[name], target, REQUIREMENTS[name][0]) for name, target in self.require.items() if name in figures]
        return max(misses) if misses else None

    def resolve(self, figures: Mapping[str, float], spans: Mapping[str, Interval]) -> list[Resolution]:
        """Each required figure the output has, judged against its target with its interval (intervals.py)."""
        found = []
        for name, target in self.require.items():
            if name not in figures:
                continue
            span = spans.get(name)
            outcome = resolve(REQUIREMENTS[name][0], target, figures[name], span)
            needed = needed_units(figures[name], target, span) if outcome == "unresolved" else None
            found.append(Resolution(name, target, figures[name], outcome, span, needed))
        return found

    def score(self, tol_ratio: float, figures: Mapping[str, float]) -> float:
        """What a keep is ranked and judged helpful by (lower is better): the miss of a required figure,
        else with `decision` the decision's error (1 - top-1, the flipped share), else the tolerance ratio."""
        miss = self.miss(figures)
        if miss is not None:
            return miss
        if self.kind == "decision" and decision_error(figures) is not None:
            return decision_error(figures)
        return tol_ratio

    def met(self, tol_ratio: float, figures: Mapping[str, float], spans: Mapping[str, Interval] | None = None) -> bool:
        """Whether an output meets what is asked of it: its required figures each shown reached (with
        `spans`, their 95% intervals: one that straddles its target is not met), else its tolerance."""
        if spans is not None and any(name in figures for name in self.require):
            return all(r.outcome == "met" for r in self.resolve(figures, spans))
        miss = self.miss(figures)
        return miss <= 1.0 if miss is not None else tol_ratio <= 1.0

    def applies(self, decisions: Mapping[str, Mapping[str, float]], outputs: Sequence[str]) -> None:
        """A required figure no graph output has would make the requirement vacuous: one sentence."""
        for name in self.require:
            if not any(name in decisions.get(output, {}) for output in outputs):
                raise AccudiffError(f"a requirement on {name} (--require) applies to {REQUIREMENTS[name][2]}, and no graph output of the model is one "
                                    "(--output-kind says what one is)")


# The targets a requirement is suggested from, strictest first, and the figures in the order tried (`strictest_met`):
# scores by their top-1 agreement, else by the KL divergence of their distributions (how the field judges a
# quantized language model, whose top-1 often agrees at 85-95% with nothing lost that matters).
LADDERS = {
    "top1": (0.999, 0.995, 0.99, 0.98, 0.95, 0.9),
    "kl": (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1),
    "cosine_min": (0.9999, 0.999, 0.995, 0.99, 0.98, 0.95, 0.9),
    "flipped_share": (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2),
    "detections": (0.999, 0.995, 0.99, 0.98, 0.95, 0.9),
}


def strictest_met(figures: Mapping[str, float], spans: Mapping[str, Interval], names: Collection[str] | None = None) -> Resolution | None:
    """The strictest requirement on an output's decision (its top-1 agreement, else its KL divergence; its
    lowest cosine, its flipped share, its detection agreement) that its figures, with their 95% intervals, are
    shown to meet: what a user who decides by it may judge the output by instead of its elementwise
    tolerance. `names`: only these figures (of a requirement the output fails, what it meets of it). None
    where no target of LADDERS is met."""
    for name, targets in LADDERS.items():
        if name in figures and (names is None or name in names):
            met = [r for target in targets for r in Objective("tolerance", {name: target}).resolve(figures, spans) if r.outcome == "met"]
            if met:
                return met[0]
    return None


NAN_AS_WORST = ": a vector holding NaN/Inf counts as -1"


def figure_text(name: str, value: float, target: float | None = None) -> str:
    """A decision figure as said: a share in percent, a divergence or a cosine as a number; beside a
    `target` (a requirement), with the digits it needs not to read as the target when it is not."""
    text, digits = figure_style(name)
    return text(value, digits_apart(value, target, text, digits))


def figure_style(name: str) -> tuple[Callable[[float, int], str], int]:
    """How a required figure is said, and to how many digits: a divergence to three significant ones, a
    cosine to six decimals, a share in percent to three."""
    if name in UNBOUNDED:
        return general, 3
    return (fixed, 6) if name.startswith("cosine") else (percent, 3)


# The figure an output's decision is read by, first one the output has: scores' top-1 agreement, an embedding's
# lowest cosine, a detector's detection agreement, a map's flipped share; and what a finding calls its error.
DECISION_FIGURES = {"top1": "its top-1 disagreement", "cosine_min": "its lowest cosine's distance from 1",
                    "detections": "its detection disagreement", "flipped_share": "its flipped share"}


def decision_figure(figures: Mapping[str, float]) -> str | None:
    """The name of the figure the output's decision is read by (DECISION_FIGURES), None where it has none."""
    return next((name for name in DECISION_FIGURES if name in figures), None)


def decision_error(figures: Mapping[str, float]) -> float | None:
    """What a decision gets wrong: 1 - top-1 agreement of scores, 1 - the lowest cosine of an embedding, 1 -
    a detector's detection agreement, the flipped share of a map."""
    name = decision_figure(figures)
    return None if name is None else wrong_by(name, figures[name])


def wrong_by(name: str, value: float) -> float:
    """How far a required figure's `value` is from a perfect decision: 1 - value of a figure that must reach
    its target ("min"), the value itself of one that must stay under it."""
    return 1.0 - value if REQUIREMENTS[name][0] == "min" else value


TIGHTER_BY = 4  # a target suggested for a search by the decision cuts what it gets wrong at least this many times


def tighter_target(figures: Mapping[str, float], spans: Mapping[str, Interval]) -> tuple[str, float] | None:
    """A target for a search by the output's decision (its figure, DECISION_FIGURES) that cuts what it gets
    wrong TIGHTER_BY times at least and that the data could show met (its interval were the figure perfect,
    intervals.best_case): the loosest such target of its ladder (LADDERS); None where there is none (the
    figure has no ladder, its error lies below it already, or the data is too little for every such target)."""
    name, error = decision_figure(figures), decision_error(figures)
    if name not in LADDERS or not error:
        return None
    direction = REQUIREMENTS[name][0]
    perfect = 1.0 if direction == "min" else 0.0
    best = best_case(spans[name], perfect) if name in spans else None
    rungs = [target for target in LADDERS[name] if wrong_by(name, target) <= error / TIGHTER_BY and resolve(direction, target, perfect, best) == "met"]
    return (name, max(rungs, key=lambda target: wrong_by(name, target))) if rungs else None


def score_said(objective: Objective, figures: Mapping[str, float]) -> str:
    """What `objective.score` measures of an output with these figures, as a finding says it ("do not even
    halve its error")."""
    if objective.miss(figures) is not None:
        return "its distance from its requirement"
    if objective.kind == "decision" and (name := decision_figure(figures)) is not None:
        return DECISION_FIGURES[name]
    return "its error"


def describe(tol_ratio: float, figures: Mapping[str, float], require: Mapping[str, float] | None = None, named: bool = True) -> str:
    """A tried keep as read: by its requirement where the output has one (`require`, --require: how far its
    required figures are from their targets, at most 1 when reached), else by its tolerance ratio; with its
    decision figures where the output has them. The elementwise ratio of an output judged by a requirement
    would read "0.65x its tolerance" beside a failing verdict. `named`: the unit said ("its tolerance")."""
    required = {name: target for name, target in (require or {}).items() if name in figures}
    if required:
        miss = Objective("tolerance", required).miss(figures)
        # A target no figure short of it can approach (top-1 of 1, a KL of 0) is missed by no finite ratio.
        text = times_tolerance(miss, " its requirement" if named else "") if math.isfinite(miss) else "short of a target it must reach exactly"
    else:
        text = times_tolerance(tol_ratio, " its tolerance" if named else "")
    said = _figures_said(figures, required)
    said.update((name, f"{REQUIREMENTS[name][1]} {figure_text(name, figures[name], required[name])}") for name in required if name not in said)
    return text + (f" ({', '.join(said.values())})" if said else "")


def _figures_said(figures: Mapping[str, float], targets: Mapping[str, float] = {}) -> dict[str, str]:
    """An output's main decision figures, as a tried keep's reading gives them (by name); one with a target
    (`targets`, its requirements) never reads as its target when it is not."""
    if "top1" in figures:
        top1, kl = (_apart(figures, targets, name, style, digits) for name, style, digits in (("top1", percent, 2), ("kl", general, 3)))
        return {"top1": f"top-1 agreement {top1}", **({"kl": f"KL divergence {kl}"} if "kl" in figures else {})}
    if "cosine_min" in figures:
        return {"cosine_min": f"lowest cosine {figures['cosine_min']:.6f}{NAN_AS_WORST if figures.get('nan_vectors') else ''}"}
    if "detections" in figures:
        return {"detections": f"detection agreement {percent(figures['detections'], 2)}"}
    if "flipped_share" in figures and figures.get("decisions"):
        return {"flipped_share": f"{percent(figures['flipped_share'], 3)} of its {figures['decisions']} decisions flipped"}
    if "flipped_share" in figures:
        return {"flipped_share": f"{percent(figures['flipped_share'], 3)} of the map flipped"}
    return {}


def _apart(figures: Mapping[str, float], targets: Mapping[str, float], name: str, style: Callable[[float, int], str], digits: int) -> str | None:
    """Figure `name` as `style` says it to `digits`, with more where it would read as its target when it is not."""
    if name not in figures:
        return None
    return style(figures[name], digits_apart(figures[name], targets.get(name), style, digits))


def _miss(value: float, target: float, direction: str) -> float:
    """At most 1 when `value` reaches `target` (from below for "min", staying under it for "max")."""
    if direction == "min":
        return 0.0 if value >= 1.0 else (1.0 - value) / (1.0 - target) if target < 1.0 else math.inf
    return value / target if target > 0 else (0.0 if value == 0 else math.inf)
