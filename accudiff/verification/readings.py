"""A keep-list tried at one failing output, as the objective reads it; and the smallest part of a
verified repair that still holds (each node dropped while the rest meets the target)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from accudiff.judging.intervals import Interval
from accudiff.judging.objective import Objective, decision_error, describe
from accudiff.verification.pruning import prune
from accudiff.verification.trial import TrialOutcome, Trials
from accudiff.findings import Repair, RepairStep

HELPS = 0.8  # a keep helps when it brings the output's score below this share of what it was
SEVERAL_FACTOR = 2.0  # a keep that improves the output at least this much carries most of its error (each of several causes must)


@dataclass(frozen=True)
class Reading:
    """One keep-list at one output: its tolerance ratio and decision figures, and how the objective reads
    them (`score`: lower is better; `met`: the output passes)."""

    tol_ratio: float
    figures: dict
    score: float
    met: bool
    decisive: bool  # the objective reads the decision here (--objective decision, or a required figure)
    spans: dict[str, Interval] = field(default_factory=dict)  # the figures' 95% intervals over the samples tried
    required: dict[str, float] = field(default_factory=dict)  # the targets (--require) of the figures the output has

    @classmethod
    def of(cls, outcome: TrialOutcome, output: str, objective: Objective) -> Reading:
        ratio, figures, spans = outcome.tol_ratio.get(output, math.inf), outcome.figures.get(output, {}), outcome.spans.get(output, {})
        met, required = objective.met(ratio, figures, spans), {name: target for name, target in objective.require.items() if name in figures}
        return cls(ratio, figures, objective.score(ratio, figures), met, objective.score(ratio, figures) != ratio, spans, required)

    def decides_better_than(self, before: Reading) -> bool:
        """Whether its decision is shown better than `before`'s: their 95% intervals of top-1 agreement (or of
        detection agreement, or of the flipped share) apart; a figure without one (a lowest cosine) is taken at its value."""
        for name, higher in (("top1", True), ("detections", True), ("flipped_share", False)):
            now, then = self.spans.get(name), before.spans.get(name)
            if name in self.figures and now is not None and then is not None:
                return now.low > then.high if higher else now.high < then.low
        return True

    def decides_worse_than(self, before: Reading) -> bool:
        """Whether its decision is worse than `before`'s on the same samples (more top-1 disagreements, a lower
        cosine, more flips): a keep that lowers the worst element's error but flips a decision nothing kept
        left alone is not one to recommend."""
        now, then = decision_error(self.figures), decision_error(before.figures)
        return now is not None and then is not None and now > then

    def step(self, keep: list[str]) -> RepairStep:
        return RepairStep(keep, self.tol_ratio, self.figures)

    def said(self, *, named: bool = True, figures: bool = False) -> str:
        """As the findings say it: by its requirement where the output has one, the decision figure beside the
        ratio only where the objective reads it (or `figures` asks for it). `named`: the unit said ("its tolerance")."""
        return describe(self.tol_ratio, self.figures if self.decisive or self.required or figures else {}, self.required, named)


@dataclass
class Tries:
    """Trials of keep-lists read at one output by the objective."""

    trials: Trials
    output: str
    objective: Objective

    def run(self, keep_lists: list[list[str]], exact: bool = False) -> list[tuple[list[str], Reading]]:
        return [(o.keep, Reading.of(o, self.output, self.objective)) for o in self.trials.run(keep_lists, exact=exact)]


def pruned(repair: Repair, tries: Tries, protected: set[str]) -> Repair:
    """A verified repair without the nodes it holds without (pruning.prune), the pruned list its last step;
    `protected`: the causes, never dropped."""
    held: list[tuple[list[str], Reading]] = []

    def holds(rest: list[str]) -> bool:
        [(kept, reading)] = tries.run([rest], exact=True)
        if reading.met:
            held.append((kept, reading))
        return reading.met

    keep, runs, _ = prune(repair.keep, holds, protected)
    if len(keep) == len(repair.keep):
        return replace(repair, pruning_runs=runs)
    kept, reading = held[-1]
    return replace(repair, keep=kept, steps=[*repair.steps, reading.step(kept)], pruning_runs=runs)


def improvement(before: float, after: float) -> float:
    """How many times smaller a score became (Inf to finite: infinitely; Inf to Inf: not at all)."""
    if math.isinf(after):
        return 1.0 if math.isinf(before) else 0.0
    return math.inf if math.isinf(before) or after == 0 else before / after
