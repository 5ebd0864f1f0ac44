"""The cause search's reach: before an answer says that no single node repairs a failing output (or carries
most of its error), every node the candidate changes upstream of it has been searched.

The rules' suspects are tried one at a time (verify.py). Every other changed node is searched in groups,
ranked by their own error (the isolated run), or weights first where the loss split says the weights'
narrowing brings most of the loss: a group is kept in higher precision as a whole, and when that does not
halve the output's error (nor meet its target), none of its nodes could alone, as long as keeping more never
hurts; a group that does is split in halves, down to single nodes, which are then tried like suspects. A
single node that repairs the output, or halves its error, is found in about log2(N) runs. Where a node was
tried both alone and in a group, the group must do at least what the node did (within readings.HELPS): where it does
not, keeping more hurt there, the group proves nothing, and its nodes are tried alone within the budget.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import pandas as pd

from accudiff.verification.trial import TrialOutcome
from accudiff.diagnosis.cause import ancestor_tensors
from accudiff.findings import Search
from accudiff.judging.objective import Objective
from accudiff.diagnosis.rules import DiagnosisContext
from accudiff.verification.readings import HELPS, Reading, improvement

GROUP_FACTOR = 2.0  # a group kept must halve the output's error (or meet its target) to hold a node worth finding: verify.SEVERAL_FACTOR


def search_groups(before: Reading, candidates: Sequence[str], alone: dict[str, Reading], run: Callable[[list[list[str]]], list[tuple[list[str], Reading]]],
                  budget: int, units: Sequence[tuple[Sequence[str], Reading]] = ()) -> tuple[dict[str, tuple[list[str], Reading]], Search]:
    """Search the `candidates` (ranked) in groups (see the module's docstring) within `budget` runs: the
    nodes found worth a look alone (each with its keep-list as tried and its reading), and the search's
    reach. `alone`: the nodes already tried alone, and their readings (a group split down to one of them
    needs no run; the monotonicity check reads them); `units`: keep-lists of several nodes already tried
    as one (a cancellation with what computes its operands), and their readings: one that does not halve
    the error covers its nodes as a group does. `run` tries keep-lists, a batch at a time."""
    found: dict[str, tuple[list[str], Reading]] = {}
    covered, singles = set(), set()  # nodes covered by a group; nodes the search tried alone
    groups, broken, runs = 0, 0, 0
    for unit, reading in units:
        if not _worth_splitting(before, reading):
            covered |= set(unit) - set(alone)
            groups += 1
    level = _halves([node for node in candidates if node not in covered])
    while level and runs < budget:
        pending = [group for group in level if not (len(group) == 1 and group[0] in alone)]  # a node tried alone is known
        batch, level = pending[: budget - runs], pending[budget - runs :]
        runs += len(batch)
        for group, (kept, reading) in zip(batch, run([list(group) for group in batch]) if batch else []):
            if _worth_splitting(before, reading):
                if len(group) == 1:
                    found[group[0]] = (kept, reading)
                else:
                    level += _halves(group)
            elif len(group) == 1:
                singles.add(group[0])
            elif any(not _at_least(reading, alone[node]) for node in group if node in alone):
                broken += 1
                level += [[node] for node in group if node not in alone]  # keeping more hurt here: its nodes are tried one by one
            else:
                groups += 1
                covered |= set(group)
    measured = set(alone) | set(found) | singles
    reach = Search(len(candidates), len(measured & set(candidates)), len(covered - measured), groups,
                   len(set(candidates) - measured - covered), broken)
    return found, reach


def _halves(nodes: list[str]) -> list[list[str]]:
    return [nodes[: len(nodes) // 2], nodes[len(nodes) // 2 :]] if len(nodes) > 1 else [nodes] if nodes else []


def _worth_splitting(before: Reading, reading: Reading) -> bool:
    """A group kept meets the target or halves the error: it may hold a node that does, alone."""
    return reading.met or improvement(before.score, reading.score) >= GROUP_FACTOR


def _at_least(group: Reading, node: Reading) -> bool:
    """A group kept does at least (within readings.HELPS) what one of its nodes kept alone does."""
    return group.met or not node.met and (math.isinf(node.score) or group.score <= node.score / HELPS)


def candidates_upstream(output: str, table: pd.DataFrame, context: DiagnosisContext, weights_first: bool) -> list[str]:
    """Every node the candidate changes upstream of `output`, ranked: by their own error (the isolated run),
    those whose weights a grid loses first where the weights' narrowing brings most of the loss."""
    rows = table[table.index.isin(ancestor_tensors(output, context.upstream)) & table["node"].isin(context.converted)].drop_duplicates("node")
    own = rows["isolated_tol_ratio"].fillna(0.0) if "isolated_tol_ratio" in rows else pd.Series(0.0, index=rows.index)
    weighted = rows["node"].isin(context.weight_findings.keys()) & weights_first
    return list(rows.assign(_weighted=weighted.to_numpy(), _own=own.to_numpy()).sort_values(["_weighted", "_own"], ascending=False, kind="stable")["node"])


def weights_dominate(split: dict[str, TrialOutcome], control: TrialOutcome, objective: Objective) -> dict[str, bool]:
    """Per output, whether its weights' narrowing brings more of the loss than its activations' (the loss
    split: the output with only its activations' quantization undone against with only its weights'), as
    `objective` reads them (a detector's ratio, set by one pixel flipped from 0 to 1, read 33.3x on both
    sides, its flipped share 4.17% and 5.17%)."""
    if not {"activations", "weights"} <= split.keys():
        return {}
    return {output: Reading.of(split["activations"], output, objective).score > Reading.of(split["weights"], output, objective).score
            for output in control.tol_ratio}
