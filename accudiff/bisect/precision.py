"""A small set of nodes to keep in FP32 (for INT8: to leave unquantized) so the graph outputs meet tolerance.

1. One comparison with the isolated run and verification (verification/verify.py) names the cause of each
   failing output and its verified repair, and ranks the converted nodes: the repairs' nodes first, then
   the contributors by their measured effect at the output, then every other node by its own error.
2. Where every failing output has a verified repair, their union is tried on all the samples and pruned
   node by node, value-moving readers kept for company included (each dropped if the rest still passes):
   the keep-list is never longer than compare's.
3. Otherwise, keeping the top k nodes is tried for the smallest k that passes (at most 2 log2(N) runs):
   first the whole ranking (if even that fails, no keep-list of these nodes repairs the model), then the
   top 1, 2, 4, ... until one passes, then halving between the last that failed and it; that list is
   pruned (its nodes dropped while the rest still passes, the last added first, in groups that halve down
   to single nodes: at most PRUNE_LIMIT runs).
4. Every keep-list is closed over precision boundaries and judged at the graph outputs by the same trial
   mechanism verification uses (verification/trial.py); the keep-list, the repaired model (exactly the
   variant that passed) and the ranking are written out. The reference runs once for all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from accudiff.result import CompareResult
from accudiff.bisect.session import BisectSession
from accudiff.diagnosis.cause import rank_contributors
from accudiff.judging.objective import Resolution, strictest_met
from accudiff.verification.pruning import prune
from accudiff.verification.trial import TrialOutcome, Trials
from accudiff.model.saving import save_model
from accudiff.model.quantized_ops import modelopt_pattern
from accudiff.report.decision_text import unresolved_text
from accudiff.transforms.candidate import repaired, repaired_file

KEEP_LIST_FILE, NODES_FILE, RANKING_FILE = "keep_fp32.txt", "nodes.txt", "ranking.csv"
# Runs pruning a passing prefix of the ranking may take (in groups first: pruning.prune). The trained Magika by
# quantize_static, one node at a time: its prefix of 50 nodes pruned to 26 within 32 runs (19 never tried), to 15
# within 64, each of them needed (28 s -> 38 s).
PRUNE_LIMIT = 64


@dataclass
class PrecisionResult:
    passed_without_changes: bool
    keep: list[str] = field(default_factory=list)  # ONNX node names
    repaired: bool = False
    repaired_model: str | None = None  # file name, relative to the result folder
    ranking: pd.DataFrame | None = None
    candidate_runs: int = 0
    bound: int = 0
    interrupted: bool = False
    trivial: bool = False  # only keeping every converted node meets the target: the format is too coarse for it
    minimal: bool = False  # each node of `keep` was tried without: none can be left out
    untried: int = 0  # else how many of its nodes pruning did not try alone (within PRUNE_LIMIT runs)
    unresolved: list[str] = field(default_factory=list)  # requirements the data cannot resolve, said: no keep-list is searched for them
    unresolved_kept_all: list[str] = field(default_factory=list)  # those the data cannot resolve even with every converted node kept
    converted: int = 0  # nodes the candidate computes in reduced precision (what a keep-list may take from)
    decisions: dict = field(default_factory=dict)  # the candidate's decision figures and tolerance met, per failing output
    intervals: dict = field(default_factory=dict)  # the decision figures' 95% intervals, per failing output
    tolerance_met: dict = field(default_factory=dict)
    decision_met: dict[str, Resolution] = field(default_factory=dict)  # per failing output: the strictest requirement on its decision it meets
    quantized_by: dict[str, str] = field(default_factory=dict)  # a node another tool quantized with ops of its own -> the tool
    reads_constant_weights: list[str] = field(default_factory=list)  # nodes reading a float weight a Constant node holds
    op_types: list[str] = field(default_factory=list)  # compare's verified repairs keep every quantized node but these op types' (one quantizer option)
    prompts: int = 0  # a decoder's: the prompts it generated from (its figures' units)


def bisect_precision(session: BisectSession, out_dir: Path) -> PrecisionResult:
    session.progress("step 1: compare the whole model (with isolated errors), name and verify the causes")
    full = session.compare(isolate=True, verify=True)
    result = PrecisionResult(passed_without_changes=full.passed, quantized_by=full.quantized_by, converted=len(full.converted),
                             reads_constant_weights=sorted(full.reads_constant_weights), prompts=len(full.generations))
    result.unresolved = [unresolved_text(output, r, bool(full.generations)) for output, found in full.unresolved.items() for r in found]
    if full.passed or result.unresolved:  # a requirement the data cannot resolve is never answered with a repair
        result.candidate_runs = session.candidate_runs
        return result
    ranking = rank(full)
    result.ranking = ranking
    failing = [f.tensor for f in full.output_failures]
    result.decisions = {name: full.decisions.get(name, {}) for name in failing}
    result.intervals = {name: full.intervals.get(name, {}) for name in failing}
    result.tolerance_met = {name: full.tolerance_met.get(name, {}) for name in failing}
    if not full.require:
        result.decision_met = {name: met for name in failing if (met := strictest_met(full.decisions.get(name, {}), full.intervals.get(name, {}))) is not None}
    units = {c.node: c.keep for f in full.output_failures for c in f.cause.contributors if c.keep}  # a cancellation with what computes its operands
    repairs = [f.repair for f in full.output_failures]
    verified = all(r is not None and r.verified for r in repairs)
    start = list(dict.fromkeys(n for r in repairs if r is not None for n in r.keep)) if verified else []
    result.op_types = repairs[0].op_types if verified and len({tuple(r.op_types) for r in repairs}) == 1 else []
    ranking.to_csv(out_dir / RANKING_FILE, index=False)
    trials = session.trials(full)
    result.bound = _run_bound(len(ranking), len(trials.boundaries.close(start)))
    try:
        found = _from_repair(session, trials, start, full, result.bound) if verified else None
        if found is None:  # the steps say the bound of the whole search: a repair failing on every sample falls back to this
            found = _smallest_passing_prefix(session, trials, list(ranking["node"]), units, full, result.bound)
        best, result.untried = found if found is not None else (None, 0)
        result.minimal = best is not None and not result.untried
        if best is None and not result.interrupted:
            every = sorted(full.converted)
            outcome = _tried(session, trials, every, full, f"every one of the {len(every)} converted nodes", result.bound)
            if outcome.passes(full.deciding_outputs, session.settings.judging.objective):
                best, result.trivial = trials.boundaries.close(every), True
            else:  # with nothing reduced, a target the trial's samples cannot tell from the figure is no proof it is out of reach
                result.unresolved_kept_all = [
                    unresolved_text(output, r, bool(full.generations)) for output in full.deciding_outputs
                    for r in session.settings.judging.objective.resolve(outcome.figures.get(output, {}), outcome.spans.get(output, {})) if r.outcome == "unresolved"]
    except KeyboardInterrupt:
        result.interrupted = True
        best = None
    finally:
        trials.close()
    result.candidate_runs = session.candidate_runs
    if best is None:
        return result
    result.keep, result.repaired = best, True
    ranking["kept"] = ranking["node"].isin(result.keep)
    ranking.to_csv(out_dir / RANKING_FILE, index=False)
    # One pattern a line, exact for --keep-fp32 and for ModelOpt's --nodes_to_exclude (which matches from a name's start); the names themselves
    # for the tools that take names (ONNX Runtime's nodes_to_exclude).
    (out_dir / KEEP_LIST_FILE).write_text("".join(f"{modelopt_pattern(name)}\n" for name in result.keep))
    (out_dir / NODES_FILE).write_text("".join(f"{name}\n" for name in result.keep))
    result.repaired_model = repaired_file(trials.setup.variants.recipe)
    save_model(repaired(trials.setup.variants, result.keep), out_dir / result.repaired_model, one_file=True)
    return result


def rank(full: CompareResult) -> pd.DataFrame:
    """The converted nodes in the order to try keeping them: the verified repairs' nodes (or the rules'
    local causes), then contributors by their measured effect at the output, then by own error."""
    table = full.table.set_index("tensor", drop=False)
    tensor_of = dict(zip(table["node"], table.index))
    op_of = dict(zip(table["node"], table["op_type"]))
    rows = []
    for failure in full.output_failures:
        cause, repair = failure.cause, failure.repair
        if repair is not None and repair.verified:
            rows += [{"node": n, "why": "in the verified repair of a failing output"} for n in repair.keep]
        elif cause.kind in ("local", "several", "dominant"):
            rows.append({"node": cause.node, "why": "cause of a failing output" if cause.kind != "dominant" else "carries most of a failing output's error"})
        rows += [{"node": c.node, "why": "effect at the output (verification)"} for c in cause.contributors if c.tol_ratio_kept is not None]
    rows += [{"node": c.node, "why": "own error (isolated run)"} for c in rank_contributors(table, full.converted)]
    ranked = pd.DataFrame(rows, columns=["node", "why"]).drop_duplicates("node")
    ranked = ranked[ranked["node"].isin(tensor_of.keys())].reset_index(drop=True)
    ranked.insert(1, "op_type", [op_of[n] for n in ranked["node"]])
    ranked.insert(2, "tensor", [tensor_of[n] for n in ranked["node"]])
    for column in ("isolated_tol_ratio", "isolated_sqnr_db", "isolated_max_abs_err", "sqnr_db", "status"):
        ranked[column] = table.loc[ranked["tensor"], column].to_numpy() if len(ranked) and column in table.columns else None
    ranked = ranked.rename(columns={"sqnr_db": "accumulated_sqnr_db", "status": "accumulated_status"})
    ranked.insert(0, "rank", range(1, len(ranked) + 1))
    ranked["kept"] = False
    return ranked


def _passes(session: BisectSession, trials: Trials, chosen: list[str], full: CompareResult, what: str, total: int, regions: bool | None = None,
            exact: bool = False) -> bool:
    return _tried(session, trials, chosen, full, what, total, regions, exact).passes(full.deciding_outputs, session.settings.judging.objective)


def _tried(session: BisectSession, trials: Trials, chosen: list[str], full: CompareResult, what: str, total: int, regions: bool | None = None,
           exact: bool = False) -> TrialOutcome:
    """One step: the candidate run with `chosen` kept (closed over what their boundaries need, unless `exact`)."""
    keep = list(chosen) if exact else trials.boundaries.close(chosen, regions)
    kept = f"keep {len(keep)} node(s) in higher precision ({what}{'' if exact else ' and what they need'})"
    # Steps count as runs do, but for the first: the comparison, with its isolated run, is one step of two runs.
    session.progress(f"{kept}: answered by an earlier run" if trials.answered(chosen, regions, exact) else f"step {session.candidate_runs} of at most {total - 1}: {kept}")
    before = trials.tried
    [outcome] = trials.run([keep], regions=regions, exact=exact)
    session.candidate_runs += trials.tried - before  # a keep-list tried before is answered without a run
    return outcome


def _pruned(session: BisectSession, trials: Trials, chosen: list[str], full: CompareResult, total: int, limit: int,
            halving: bool = False) -> tuple[list[str], int]:
    """A passing keep-list (closed over its regions) with each node dropped while the rest, run as it is,
    still passes: the value-moving readers kept for company and what a closure added too (pruning.prune, in
    groups first where `halving`), in at most `limit` runs; and how many of its nodes were not tried alone
    (0: every one was)."""
    def holds(rest: list[str]) -> bool:
        return _passes(session, trials, rest, full, "pruning: fewer nodes", total, exact=True)

    kept, _, untried = prune(trials.boundaries.close(chosen), holds, limit=limit, halving=halving)
    return kept, untried


def _from_repair(session: BisectSession, trials: Trials, start: list[str], full: CompareResult, total: int) -> tuple[list[str], int] | None:
    """compare's verified repairs, together, tried on every sample and pruned; None if they fail there."""
    closed = trials.boundaries.close(start)
    if not _passes(session, trials, start, full, f"the {len(start)} of the verified repairs", total):
        return None
    return _pruned(session, trials, start, full, total, len(closed))


def _smallest_passing_prefix(session: BisectSession, trials: Trials, nodes: list[str], units: dict[str, list[str]], full: CompareResult,
                             total: int) -> tuple[list[str], int] | None:
    """The keep-list of the smallest k, found from below, such that keeping nodes[:k] (each with its unit: a
    cancellation with the nodes computing its operands; closed over boundaries) passes, pruned, and how many of
    its nodes its pruning did not try; None if keeping all of them still fails."""

    def prefix(k: int) -> list[str]:
        return list(dict.fromkeys(n for node in nodes[:k] for n in units.get(node, [node])))

    if not nodes or not _passes(session, trials, prefix(len(nodes)), full, f"all {len(nodes)} ranked", total):
        return None
    # Searched from below (the top 1, 2, 4, ... until one passes), then halving between: keeping more can make an
    # output worse (the detector quantized per tensor, on 4 pages: its top 64 and 100 pass, its top 143 does not),
    # and halving from the whole ranking then found the top 230, where from below it finds the top 64 or fewer.
    failing, passing = 0, len(nodes)
    size = 1
    while size < len(nodes):
        if _passes(session, trials, prefix(size), full, f"the top {size}", total):
            passing = size
            break
        failing, size = size, 2 * size
    while passing - failing > 1:
        middle = (failing + passing) // 2
        if _passes(session, trials, prefix(middle), full, f"the top {middle}", total):
            passing = middle
        else:
            failing = middle
    chosen = prefix(passing)
    return _pruned(session, trials, chosen, full, total, PRUNE_LIMIT, halving=True)


def _run_bound(ranked: int, repair: int) -> int:
    """Candidate runs at most: the comparison with its isolated run (2) and verification (reported apart),
    then either the repair and its pruning, or all ranked kept, the bisection and the pruning; and, if
    none of these passes, every converted node kept."""
    from_repair = 1 + repair if repair else 0
    bisection = 1 + 2 * math.ceil(math.log2(max(ranked, 1))) + PRUNE_LIMIT if ranked else 0  # up by doubling, then halving
    return 2 + from_repair + bisection + 1  # and last, every converted node kept
