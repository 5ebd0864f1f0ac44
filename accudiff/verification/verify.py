"""Verified causes: every suspect is tested where it matters, at the failing output.

The rules (cause.py) and mechanisms (mechanisms.py) only nominate suspects. For each failing output:

1. Suspects (suspects.py): every node the rules flag upstream (overflow, NaN/Inf origin, a constant that
   became Inf, INT8 clipping, failing on its own), every cancelling Add/Sub (kept with the nodes computing
   its operands), and the top contributors by their own error and by how far the accumulated SQNR falls
   across them (where error enters: early layers, whose rounding depth amplifies, show up here).
2. Screen: each suspect kept in higher precision on its own (closed over precision boundaries), the
   candidate run again on the failing samples, graph outputs only (verification/trial.py). A flagged node
   whose keep leaves the output as it was is `absorbed`: its error never reaches the output. Beside
   them, in the same batch, the candidate with nothing kept: the control every keep is measured against.
   The comparison's own figure is not one: it covers every sample, where the trials run the worst
   failing few, and its sessions may be made otherwise (optimized for many samples, a TensorRT engine
   built with other tactics). An output that passes in the control (it fails on other samples, or the
   rerun does not show its failure) keeps the rules' hypothesis as its cause.
3. Confirm greedily: keep the suspect that helps most; while the output still fails, try the next two
   beside it (in one call) and add the better if it helps, within the budget of runs per output. The steps and their tolerance ratios are the `Repair`; it is verified
   only when its last run is within tolerance.

The cause is then `local` (one suspect's keep repairs the output), `several` (two or three suspects repair
it together, each step of the repair improving the output at least twofold; or suspects that repair it
together where none alone does: two or three, or any number the rules flagged), `dominant` (no
keep repairs it, but one improves it at least twofold: that fault carries most of the error, the rest accumulates) or
`accumulated` (no single keep among those tried repairs it or halves it; contributors ranked by their measured effect
at the output; where the output decides, the node whose keep halves what the decision loses, searched again
by the decision), or `not_found` where NaN/Inf still reach the output with every keep tried.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import pandas as pd

from accudiff.stages.group import GroupRun, could_be_a_shape
from accudiff.judging.objective import Objective, score_said
from accudiff.judging.table import STATUS_FAIL
from accudiff.verification.trial import MAX_TRIAL_SAMPLES, TrialOutcome, TrialSetup, Trials, trial_workers
from accudiff.execution.pool import prestart
from accudiff.verification.loss_split import by_op_type, cause_parts, loss_split, loss_split_keeps, split_op_types
from accudiff.verification.every_sample import on_every_sample
from accudiff.verification.readings import HELPS, SEVERAL_FACTOR, Reading, Tries, improvement, pruned
from accudiff.verification.search import candidates_upstream, search_groups, weights_dominate
from accudiff.verification.suspects import Suspect, contributor, findings_of, nominate
from accudiff.findings import NEARLY_AS_MUCH, Absorbed, Cause, Finding, Repair, RepairStep, Search
from accudiff.diagnosis.cause import ancestor_tensors, find_cause
from accudiff.diagnosis.mechanisms import absorber
from accudiff.diagnosis.rules import DiagnosisContext, isolation_ran
from accudiff.model.formats import QUANTIZED_FORMATS, formats_of
from accudiff.run_options import DEFAULT_CAUSE_BUDGET
from accudiff.model.loading import load_graph, read_again
from accudiff.model.prompts import GenerationPlan, replayed_prompts
from accudiff.runners.base import BACKEND_NAMES
from accudiff.model.saving import save_model
from accudiff.model.value_file import ValueFile
from accudiff.model.samples import Samples
from accudiff.transforms.candidate import CandidateVariants, repaired, repaired_file

if TYPE_CHECKING:
    from accudiff.result import CompareResult
    from accudiff.settings import Compared, Diagnosing, Judging

GREEDY_RESERVE = 3  # runs of the budget kept for confirming combinations after the screen
GREEDY_ROUND = 2  # combinations tried in one call while confirming (a fixed number: the answer does not depend on the cores)
SEVERAL_LIMIT = 3


def verify_outputs(
    result: CompareResult, context: DiagnosisContext, compared: Compared, judging: Judging, diagnosing: Diagnosing, runs: Sequence[GroupRun],
    samples: Samples, scratch: Path, report: Path | None = None, ray: str | None = None, generation: GenerationPlan | None = None,
) -> list[str]:
    """The verify stage: each failing output's suspects tested at the output (`verify_causes`) on the
    worst failing samples, by trials of the candidate `compare` built; the output failures get their
    verified causes and repairs. A candidate captured elsewhere cannot run again: ONNX Runtime's model of
    the same precision stands in for it, on the outputs that fail there too. For a candidate made by
    another tool, the verified repairs' nodes kept in it are saved in the `report` folder as the repaired
    candidate. `ray`: the batch on every sample runs as Ray tasks, as the comparison did. A decoder's trials
    generate as the comparison's `generation` did, step by step on the tokens it fed. Returns the notices
    of the outputs whose causes could not be verified."""
    if len(runs) > 1:
        return [f"causes were not verified: the samples take {len(runs)} different combinations of If branches "
                "(compare each group's samples on their own to verify)"]
    if compared.trt.engine is not None:
        return ["causes were not verified: a pre-built engine (--engine) cannot be rebuilt with nodes kept in higher precision"]
    indexed = result.table.set_index("tensor", drop=False)
    failures = result.output_failures
    stand_in, notices = None, []
    if compared.backend == "recorded":
        stand_in, notice, failures = _stand_in(failures, indexed, compared)
        notices = [notice] if notice else []
        if stand_in is None:
            return notices
        compared = replace(compared, backend=compared.also, also=None)  # the candidate of its precision that ran beside it
    prestart(trial_workers(compared))  # the trial workers start while their models are prepared (or are warm)
    candidate = runs[0].candidate
    outputs = [f.tensor for f in failures]
    info = read_again(candidate.info)
    generating = generation is not None  # a decoder's trials generate as the comparison did
    unit = "prompt" if generating else "sample"
    if generating:  # each chosen prompt fed again the tokens the comparison fed it (model/prompts.py)
        chosen, total = _trial_prompts(result, outputs), len(result.generations)

        def sequences(picked: Sequence[int], name: str) -> Samples:  # in the order picked: the k-th trial sample is picked[k]
            generations = {g["sequence"]: g for g in result.generations}
            return replayed_prompts([generations[p] for p in picked], scratch / name)

        tried, everything = sequences(chosen, "replayed.npz"), lambda: sequences(range(total), "every-prompt.npz")
    else:
        chosen, total = result.losing_samples(outputs)[:MAX_TRIAL_SAMPLES] or [0], len(samples)
        tried, everything = samples.subset(chosen), lambda: samples
    base = replace(candidate.transformed, model=load_graph(candidate.path))
    first = {} if generating else tried[0]  # a prompt's feeds are made as it generates
    setup = TrialSetup(
        info, CandidateVariants(info, compared.recipe, base=base, values=ValueFile(scratch / "verify")), tried, compared, judging, scratch / "verify",
        {name: first[name].reshape(-1).tolist() for name in first if could_be_a_shape(first[name])},
        generation.as_json(trial=True) if generating else None,
    )
    recorded = (runs[0].outputs, chosen) if runs[0].outputs is not None else None
    with Trials(setup, indexed, recorded, variant_seconds=_variant_seconds(result.worker_timings.get("comparison", {}), candidate.passes, len(chosen) / len(samples))) as trials:
        split = loss_split_keeps(setup.variants, context.formats, compared.given_alone)
        verdicts, control, parts = verify_causes(outputs, indexed, context, trials, diagnosing.verify_budget, judging.tolerances.default.rtol, split,
                                                 judging.objective, diagnosing.cause_budget)
        counts = split_op_types(split, setup.variants.float_op_types())
        result.loss_split = loss_split(outputs, control, parts, counts)
        verdicts = by_op_type(verdicts, control, parts, split, sorted(counts.get("matrix_ops", {})), judging.objective)
        verdicts = cause_parts(verdicts, setup.variants, trials, control, judging.objective)
    result.worker_timings["verification"] = trials.timings
    if len(chosen) < total:
        verdicts = on_every_sample(verdicts, replace(setup, samples=everything(), scratch=scratch / "every-sample"), indexed, judging.objective,
                                    keep_phrase(context.precision), unit, result.worker_timings, ray)
    keep = list(dict.fromkeys(n for _, repair in verdicts.values() if repair.verified for n in (repair.whole_run or repair).keep))
    if report is not None and keep and compared.candidate_model is not None:
        save_model(repaired(setup.variants, keep), report / repaired_file(setup.variants.recipe), one_file=True)
        result.repaired_candidate = repaired_file(setup.variants.recipe)
    result.output_failures = [
        replace(f, cause=replace(verdicts[f.tensor][0], stand_in=stand_in), repair=replace(verdicts[f.tensor][1], samples=chosen))
        if f.tensor in verdicts else f
        for f in result.output_failures
    ]
    passed = [f"'{name}' ({Reading.of(control, name, judging.objective).said(named=False)})" for name in outputs if name not in verdicts]
    if passed:
        notices.append(
            f"output(s) {', '.join(passed)} met {'their target' if judging.objective.require else 'the tolerance'} on the {len(chosen)} "
            f"{unit}(s) verification runs (the worst failing ones), "
            f"{stand_in or 'the candidate'} run again with nothing kept: a keep cannot be verified where the failure does not show, "
            "so the cause stays the rules' hypothesis")
    return notices


def _variant_seconds(timings: dict[str, float], passes: Sequence[dict], share: float) -> float | None:
    """What one variant of the candidate costs a worker, as the comparison measured it: a session (its
    sessions' time shared among the reference and its passes) and the candidate's runs of the `share` of
    the samples that trials run on."""
    if "sessions" not in timings:
        return None
    return timings["sessions"] / (1 + len(passes)) + timings.get("runs: candidate", 0.0) * share


def _trial_prompts(result: CompareResult, outputs: Sequence[str]) -> list[int]:
    """A decoder's prompts verification tries (at most MAX_TRIAL_SAMPLES): those whose steps leave the
    failing outputs furthest from the reference (most top-1 flips, then the largest tolerance ratio)."""
    rows = result.samples[result.samples["tensor"].isin(outputs)]
    per_prompt = rows.assign(flips=rows["rows"] - rows["top1"]).groupby("sequence").agg(flips=("flips", "sum"), ratio=("tol_ratio", "max"))
    return [int(p) for p in per_prompt.sort_values(["flips", "ratio"], ascending=False).index[:MAX_TRIAL_SAMPLES]]


def _stand_in(failures: list, table: pd.DataFrame, compared: Compared) -> tuple[str | None, str | None, list]:
    """For a captured candidate: the candidate that stands in for it in verification (ONNX Runtime's
    model of the same precision), the failures it can verify (those it reproduces), and a notice for
    the rest. A keep that repairs the stand-in is evidence about the model, not about the captured
    engine's own kernels, and the report says which candidate it was."""
    if compared.also is None or f"{compared.also}_status" not in table.columns:
        return None, "causes were not verified: a candidate captured elsewhere cannot run again here, and no candidate of its precision ran beside it", []
    stand_in = f"{BACKEND_NAMES.get(compared.also, compared.also)}'s {compared.precision.upper()} model"
    reproduced = [f for f in failures if table.loc[f.tensor, f"{compared.also}_status"] == "fail"]
    unexplained = [f"'{f.tensor}'" for f in failures if f not in reproduced]
    notice = None
    if unexplained:
        notice = (f"output(s) {', '.join(unexplained)} fail only in the captured candidate ({stand_in} meets the tolerance there): "
                  "what the engine adds (its kernels, fusions or tactics) cannot be verified here; their causes are the rules' hypotheses")
    if not reproduced:
        return None, notice, []
    return stand_in, notice, reproduced


def verify_causes(
    outputs: Sequence[str], table: pd.DataFrame, context: DiagnosisContext, trials: Trials, budget: int, rtol: float,
    extra: Mapping[str, tuple[list[str], str]] = {}, objective: Objective = Objective(), cause_budget: int = DEFAULT_CAUSE_BUDGET,
) -> tuple[dict[str, tuple[Cause, Repair]], TrialOutcome, dict[str, TrialOutcome]]:
    """For each failing output that fails again in the control (nothing kept), the verified cause and
    repair (`table` indexed by tensor, topological order), keeps judged by `objective`; the control; and
    the outcomes of the `extra` keep-lists (each named, with what it undoes, see Trials.run). The screens of all
    outputs, the control and the extra keep-lists run as one batch; then every other node the candidate
    changes upstream of each output is searched in groups (search.py), within `cause_budget` runs an output."""
    suspects = {output: nominate(output, table, context, rtol)[: max(budget - GREEDY_RESERVE, 1)] for output in outputs}
    keep_lists = list(dict.fromkeys([(), *(tuple(s.keep) for group in suspects.values() for s in group)]))
    trials.expect([[node] for output in outputs for node in candidates_upstream(output, table, context, weights_first=False)])  # the search's
    outcomes = trials.run([*(list(k) for k in keep_lists), *(keep for keep, _ in extra.values())], ["all"] * len(keep_lists) + [parts for _, parts in extra.values()])
    screened = dict(zip(keep_lists, outcomes))
    control = screened[()]
    parts = dict(zip(extra, outcomes[len(keep_lists):]))
    weights_first = weights_dominate(parts, control, objective)
    verdicts = {}
    for output, group in suspects.items():
        before = Reading.of(control, output, objective)
        if before.met:
            continue
        for suspect in group:
            outcome = screened[tuple(suspect.keep)]
            suspect.tried, suspect.reading = outcome.keep, Reading.of(outcome, output, objective)
        tries = Tries(trials, output, objective)
        candidates = candidates_upstream(output, table, context, weights_first.get(output, False))
        alone = {s.node: s.reading for s in group if len(s.keep) == 1}
        units = [(s.keep, s.reading) for s in group if len(s.keep) > 1]
        found, reach = search_groups(before, candidates, alone, tries.run, cause_budget, units)
        runs_left = budget - len(group)  # the search's runs are its own budget's
        rows = table.reset_index(drop=True).drop_duplicates("node").set_index("node")
        group += [Suspect(node, rows.loc[node, "tensor"], rows.loc[node, "op_type"], [node], findings_of(rows.loc[node, "tensor"], table, context),
                           tried=kept, reading=reading) for node, (kept, reading) in found.items() if node not in {s.node for s in group}]
        verdicts[output] = _conclude(output, before, group, table, context, tries, runs_left, reach)
        if verdicts[output][0].kind == "accumulated" and not before.decisive:
            cause, repair = verdicts[output]
            verdicts[output] = (_with_decision_fault(cause, control, group, candidates, table, context,
                                                     Tries(trials, output, replace(objective, kind="decision")), cause_budget), repair)
    return verdicts, control, parts


def _with_decision_fault(cause: Cause, control: TrialOutcome, suspects: list[Suspect], candidates: list[str], table: pd.DataFrame,
                         context: DiagnosisContext, tries: Tries, budget: int) -> Cause:
    """An error that accumulates by the tolerance (no keep halves the worst element's) can still have one node
    that carries most of what the decision loses: a keep that lifts top-1 agreement from 56% to 86% leaves
    the worst flipped position as wrong as before. Searched as the cause was, read by the decision (top-1
    agreement, lowest cosine, flipped share), within `budget` runs: a node whose keep at least halves the
    decision's error, the figure's intervals before and after apart, is added to `cause`, as a finding and
    (among keeps measured) its first contributor, its keep-list and node kept (`decision_keep`, `decision_node`)."""
    before = Reading.of(control, tries.output, tries.objective)
    if not before.decisive or not before.score > 0:
        return cause
    singles = {s.node: s for s in suspects if len(s.keep) == 1}
    tried = dict(zip(singles, tries.run([s.tried for s in singles.values()])))  # answered by the screen's runs
    found, _ = search_groups(before, candidates, {node: reading for node, (_, reading) in tried.items()}, tries.run, budget)
    node, (kept, best) = min({**tried, **found}.items(), key=lambda item: item[1][1].score, default=(None, (None, None)))
    if node is None or improvement(before.score, best.score) < SEVERAL_FACTOR or not best.decides_better_than(before):
        return cause  # (one flip of 320 unflipped halves the error, and tells nothing)
    row = table[table["node"] == node].iloc[0]
    suspect = Suspect(node, row["tensor"], row["op_type"], [node], findings_of(row["tensor"], table, context), tried=kept, reading=best)
    finding = Finding("decision", f"by what the output decides, {row['op_type']} '{node}' carries most of the loss: "
                                  f"{keep_phrase(context.precision)} brings the output from {before.said(named=False)} to {best.said(named=False)} "
                                  "(verified at the output; --objective decision judges keeps by the decision)")
    said = [replace(f, message=f"of '{node}': {f.message}") for f in suspect.findings if f.kind != "own_error"]  # what the rules say of why
    measured = not cause.contributors or cause.contributors[0].tol_ratio_kept is not None  # keeps measured, not the own errors standing in where none changed it
    first = [contributor(suspect, table)] if measured else []
    rest = [c for c in cause.contributors if not first or c.node != node]  # (listed once: first, with the keep the decision measured)
    return replace(cause, findings=[*cause.findings, finding, *said], contributors=first + rest, decision_keep=kept, decision_node=node)


def _conclude(
    output: str, before: Reading, suspects: list[Suspect], table: pd.DataFrame, context: DiagnosisContext, tries: Tries, runs_left: int,
    reach: Search | None = None,
) -> tuple[Cause, Repair]:
    # A keep helps when it improves the output enough to matter, or when it meets the target outright (an
    # output barely out of tolerance may be repaired by several keeps, each by a little).
    helpful = sorted((s for s in suspects if improvement(before.score, s.score) > 1 / HELPS or (s.reading is not None and s.reading.met)),
                     key=lambda s: s.rank)
    # A keep that leaves the output no better than nothing kept contributes nothing measurable: when none
    # does (a chain stuck on FP16's grid, whichever one node is exact), the largest own errors stand in.
    # A keep that flips a decision nothing kept left alone is neither a contributor nor the best keep, however it moves the worst element.
    fair = sorted((s for s in suspects if not (s.reading and s.reading.decides_worse_than(before))), key=lambda s: s.rank)
    contributors = [contributor(s, table) for s in fair if s.score < before.score] or find_cause(output, table, context).contributors
    steps, readings = [before.step([])], [before]
    now = before
    used: list[Suspect] = []
    if helpful:
        used, keep, now = [helpful[0]], helpful[0].tried, helpful[0].reading
        steps.append(now.step(keep))
        readings.append(now)
        # The others that help alone first; then the rest, as a node may help only beside another (an
        # input it reads must be exact too). They are tried GREEDY_ROUND at a time, in one call, and the
        # round's best that helps is added (a fixed round, so the answer does not depend on the cores).
        queue = helpful[1:] + [s for s in suspects if s not in helpful]
        while queue and not now.met and runs_left > 0:
            round_ = [s for s in queue if not set(s.tried) <= set(keep)][: min(GREEDY_ROUND, runs_left)]
            if not round_:
                break
            queue = queue[queue.index(round_[-1]) + 1 :]
            tried = tries.run([keep + [n for n in s.tried if n not in keep] for s in round_])
            runs_left -= len(round_)
            (kept, reading), suspect = min(zip(tried, round_), key=lambda pair: pair[0][1].score)
            if improvement(now.score, reading.score) > 1 / HELPS or (reading.met and not now.met):
                used.append(suspect)
                keep, now = kept, reading
                steps.append(now.step(keep))
                readings.append(now)
    joint, left_out_while_met = False, None
    if not helpful and len(suspects) >= 2 and runs_left > 0:
        # Two faults on one path (a weight whose one scale zeroes a channel, and the activation its node
        # writes on a grid that zeroes it again) each undo what the other would repair: none helps alone.
        found = _together(before, suspects, tries, runs_left)
        if found is not None:
            used, steps, now, left_out_while_met = found
            joint = len(used) > 1
    repair = Repair(steps[-1].keep, steps, verified=now.met, left_out_while_met=left_out_while_met)
    if repair.verified:
        repair = pruned(repair, tries, {s.node for s in used})
    # While NaN/Inf reach the output, a keep leaving them rules nothing out, unless the repair recovers it without it.
    ruled_out = [_absorbed(s, output, table, context) for s in suspects
                 if s.flagged and s not in helpful and s not in used and s.node not in repair.keep] if math.isfinite(before.tol_ratio) or repair.verified else []
    common = dict(contributors=contributors, verified=True, absorbed=ruled_out, searched=reach)
    phrase = keep_phrase(context.precision)
    # Faults with range evidence that each alone leave the output broken (five Muls each overflowing to Inf)
    # are several causes however many they are; more than SEVERAL_LIMIT unflagged ones are accumulation.
    if joint and repair.verified and (len(used) <= SEVERAL_LIMIT or all(s.flagged for s in used)):
        best = used[0]
        said = {s.reading.said(named=False) for s in used}
        alone = (f"each leaves it at {said.pop()}" if len(said) == 1 and len(used) > 2
                 else ", ".join(f"{s.op_type} '{s.node}' {s.reading.said(named=False)}" for s in used) + f" of {before.said(named=False)}")
        verdict = Finding("verified", f"none of them alone repairs the output ({alone}); "
                                      f"{phrase.replace(' it ', ' them ')} together brings it to {now.said()}")
        return Cause("several", best.node, best.tensor, best.op_type, [*best.findings, verdict],
                     co_causes=[contributor(s, table) for s in used[1:]], **common), repair
    if repair.verified and len(used) == 1:
        best = used[0]
        reads, boundary = len(best.keep) - 1, len(best.tried) - len(best.keep)
        needs = ", ".join(filter(None, [reads and f"{reads} node(s) computing what it reads", boundary and f"{boundary} node(s) its boundaries need"]))
        needs = f" (with {needs})" if needs else ""
        verdict = Finding("verified", f"{phrase}{needs} brings the output from {before.said(named=False)} to {best.reading.said()}")
        others = [contributor(s, table) for s in helpful if s is not best and s.reading.met]
        return Cause("local", best.node, best.tensor, best.op_type, [*best.findings, verdict], alternatives=others, **common), repair
    gains = [improvement(a.score, b.score) for a, b in zip(readings, readings[1:])]
    if repair.verified and len(used) <= SEVERAL_LIMIT and all(gain >= SEVERAL_FACTOR for gain in gains):
        best = used[0]
        verdict = Finding(
            "verified",
            f"{phrase} alone brings the output from {before.said(named=False)} to {best.reading.said()}; with "
            + ", ".join(f"{s.op_type} '{s.node}'" for s in used[1:]) + f" too, {now.said(named=False)}",
        )
        return Cause("several", best.node, best.tensor, best.op_type, [*best.findings, verdict], co_causes=[contributor(s, table) for s in used[1:]], **common), repair
    if helpful and improvement(before.score, helpful[0].score) >= SEVERAL_FACTOR:
        # One fault carries most of the error, the rest accumulates: naming only "accumulated" would hide it.
        best = helpful[0]
        rest = f"; with {len(repair.keep)} node(s) kept, {now.said(named=False)}" if len(repair.steps) > 2 else ""
        verdict = Finding("verified", f"{phrase} brings the output from {before.said(named=False)} to {best.reading.said(named=False)}{rest}: "
                                      "the rest of the error accumulates over the network")
        return Cause("dominant", best.node, best.tensor, best.op_type, [*best.findings, verdict], **common), repair
    best = fair[0] if fair else None
    what, undone = ("quantized", "left unquantized") if phrase == keep_phrase("int8") else ("converted", "kept in FP32")
    short = "short of its requirement" if before.required else "out of tolerance"
    # Tied with nothing kept on the ratio (at its ceiling), the best is best by its decision: said with it.
    tied = best is not None and best.reading is not None and best.reading.score == before.score and best.reading.figures != before.figures
    said_best = f"(best: {best.op_type} '{best.node}', {best.reading.said(named=False, figures=tied)} of {before.said(named=False, figures=tied)})" if best is not None and best.reading else ""
    reach = reach or Search(len(suspects), len(suspects))
    summary = f"no single node repairs the output: {reach.said(what, undone, short, said_best, score_said(tries.objective, before.figures))}"
    kind = "accumulated" if math.isfinite(now.tol_ratio) else "not_found"  # NaN/Inf are not small errors growing
    return Cause(kind, findings=[Finding("verified", summary)], failing_alone=failing_alone(output, table, context), **common), repair


def failing_alone(output: str, table: pd.DataFrame, context: DiagnosisContext) -> int:
    """How many converted nodes upstream of `output` err past their tolerance on their own, fed the reference's
    values (the isolated run): an error no single node breaks is then not small errors growing, but errors that
    several of them make adding up (magika's GELU cube and LayerNorm variance, each quantized to 0)."""
    if not isolation_ran(table):
        return 0
    rows = table[table.index.isin(ancestor_tensors(output, context.upstream)) & table["node"].isin(context.converted)]
    return int(rows.loc[rows["isolated_status"] == STATUS_FAIL, "node"].nunique())


def _together(before: Reading, suspects: list[Suspect], tries: Tries, runs_left: int) -> tuple[list[Suspect], list[RepairStep], Reading, bool] | None:
    """When no suspect helps alone: all of them kept together, and, if that helps, each dropped again (the
    one whose own keep did least first) while the rest helps as much, within `runs_left` runs; the members
    left, the steps (nothing kept, all kept, then the pruned lists), the last step's reading and whether all
    of them met the target (the rest then had to). None when together they do not help."""
    [(keep, joint)] = tries.run([list(dict.fromkeys(n for s in suspects for n in s.tried))])
    if improvement(before.score, joint.score) <= 1 / HELPS:
        return None
    members, steps, now, runs_left = list(suspects), [before.step([]), joint.step(keep)], joint, runs_left - 1
    for suspect in sorted(suspects, key=lambda s: -s.score):
        if runs_left <= 0 or len(members) <= 2:
            break
        rest = [s for s in members if s is not suspect]
        [(kept, reading)] = tries.run([list(dict.fromkeys(n for s in rest for n in s.tried))])
        runs_left -= 1
        # The rest still does what all did: meets the target where all met it; else helps about as much, never back
        # past a target all reached by its figure (KL 0.00796 against 0.008, not shown met: pruned on to 0.00818, it failed).
        if reading.met if joint.met else reading.score <= joint.score * NEARLY_AS_MUCH and (reading.score <= 1.0 or joint.score > 1.0):
            members, now = rest, reading
            steps.append(reading.step(kept))
    return members, steps, now, joint.met


def keep_phrase(precision: str) -> str:
    """How keeping a node in higher precision is said for this precision."""
    formats = formats_of(precision)
    return "leaving it unquantized" if formats and formats <= QUANTIZED_FORMATS else "keeping it in FP32"


def _absorbed(suspect: Suspect, output: str, table: pd.DataFrame, context: DiagnosisContext) -> Absorbed:
    by = absorber(suspect.tensor, output, table, context)
    reading = suspect.reading
    return Absorbed(suspect.node, suspect.op_type, suspect.tensor, reading.tol_ratio if reading else math.inf, *(by or (None, None, None)),
                    figures_kept=dict(reading.figures) if reading else {})

