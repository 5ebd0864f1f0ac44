"""What verification found on the samples it tried, run once more on all of the run's samples (or prompts)
in one batch: the repair a command applies is verified where the command measures it.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from accudiff.findings import Cause, Finding, Repair
from accudiff.judging.objective import Objective
from accudiff.verification.readings import SEVERAL_FACTOR, Reading, improvement
from accudiff.verification.trial import TrialSetup, Trials


def on_every_sample(verdicts: dict[str, tuple[Cause, Repair]], setup: TrialSetup, table: pd.DataFrame, objective: Objective, phrase: str,
                     unit: str, timings: dict[str, dict[str, float]], ray: str | None = None) -> dict[str, tuple[Cause, Repair]]:
    """What verification found on some of the run's samples (chosen for what they lose, not for all a claim
    covers), run once more on all of them, in one batch: the repairs verified there, every such repair's nodes
    kept together (as the command `next:` prints applies them, and the repaired candidate holds them), verified
    only if they hold here too; and a one-node cause's keep beside nothing kept, its kind judged again on
    these figures (a keep that halved the tried samples' error may not halve the run's). Not for a model
    of large weights (Trials.large): its trials record the reference's outputs, here those of every sample."""
    keep = list(dict.fromkeys(n for _, repair in verdicts.values() if repair.verified for n in repair.keep))
    singles = {output: repair.steps[1].keep for output, (cause, repair) in verdicts.items() if cause.kind in ("local", "dominant") and len(repair.steps) > 1}
    deciding = {output: cause.decision_keep for output, (cause, _) in verdicts.items() if cause.decision_keep}
    beside_nothing = [*singles.values(), *deciding.values()]  # each measured against nothing kept
    if not keep and not beside_nothing:
        return verdicts
    keep_lists = list(dict.fromkeys(tuple(k) for k in ([[]] if beside_nothing else []) + ([keep] if keep else []) + beside_nothing))
    with Trials(setup, table, replayed=False, ray=ray) as trials:
        if trials.large:  # its reference would be recorded: the outputs of every sample on disk
            return verdicts
        outcomes = dict(zip(keep_lists, trials.run([list(k) for k in keep_lists], exact=True)))  # as verified: closed already, or pruned to what held
    timings["every sample"] = trials.timings
    on_all = f"on all {len(setup.samples)} {unit}s"
    confirmed = {}
    for output, (cause, repair) in verdicts.items():
        if repair.verified:
            reading = Reading.of(outcomes[tuple(keep)], output, objective)
            repair = replace(repair, whole_run=reading.step(keep), verified=reading.met)
        if output in singles and not (before := Reading.of(outcomes[()], output, objective)).met:
            cause = _judged_again(cause, before, Reading.of(outcomes[tuple(singles[output])], output, objective), f"{on_all}, {phrase}")
        if output in deciding:
            by_decision = replace(objective, kind="decision")
            before, after = (Reading.of(outcomes[tuple(k)], output, by_decision) for k in ([], deciding[output]))
            short = "" if improvement(before.score, after.score) >= SEVERAL_FACTOR else ": less than half of what the decision loses there"
            said = f"{on_all}, by what the output decides, {phrase} brings the output from {before.said(named=False)} to {after.said(named=False)}{short}"
            cause = replace(cause, findings=[*cause.findings, Finding("every_sample", said)])
        confirmed[output] = (cause, repair)
    return confirmed


def _judged_again(cause: Cause, before: Reading, after: Reading, said: str) -> Cause:
    """A one-node cause, judged by its keep's figures on every sample: it repairs the output there (local),
    or at least halves what it loses (dominant), or it is one contributor to an error that accumulates."""
    gain = improvement(before.score, after.score)
    kind = cause.kind if after.met or (cause.kind == "dominant" and gain >= SEVERAL_FACTOR) else "dominant" if gain >= SEVERAL_FACTOR else "accumulated"
    why = {"dominant": ": it carries most of the error there, the rest accumulates",
           "accumulated": ": less than half of what it loses there, an error that accumulates over the network"}[kind] if kind != cause.kind else ""
    return replace(cause, kind=kind, findings=[*cause.findings, Finding("every_sample", f"{said} brings the output from {before.said(named=False)} to {after.said()}{why}")])
