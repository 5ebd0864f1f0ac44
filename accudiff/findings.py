"""What a diagnosis says, as plain values: findings at a tensor, the cause of a failing output (with its
contributors, the nodes whose keep does not help, and what the search covered) and the repair. The result
types: diagnosis/ computes them, verification/ confirms them, report/ and `CompareResult` carry them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    kind: str  # see the README's Findings table
    message: str


@dataclass(frozen=True)
class Contributor:
    """A node upstream of a failing output, with the error it makes on its own (isolated run) and any
    range fault found at it (an underflow can stay inside a tensor's tolerance and still matter downstream)."""

    node: str
    op_type: str
    tensor: str
    isolated_sqnr_db: float
    isolated_max_abs_err: float
    isolated_tol_ratio: float
    findings: list[Finding] = field(default_factory=list)
    tol_ratio_kept: float | None = None  # verified: the failing output's tolerance ratio with this node kept (and what its boundaries need)
    keep: list[str] = field(default_factory=list)  # verified: the nodes that keep-list held
    figures_kept: dict = field(default_factory=dict)  # verified: the output's decision figures with it kept (top-1, a map's flipped share)


@dataclass(frozen=True)
class Absorbed:
    """A node the rules flagged whose keep in higher precision does not help the output (`by`: the first node
    downstream across which its error measurably shrinks, where one does: diagnosis/mechanisms.py)."""

    node: str
    op_type: str
    tensor: str
    tol_ratio_kept: float  # the output's tolerance ratio with this node kept
    by: str | None = None
    by_op_type: str | None = None
    evidence: str | None = None  # how the error measurably shrinks across `by`
    figures_kept: dict = field(default_factory=dict)  # the output's decision figures with this node kept


# Suspects kept together that repair an output none repairs alone are left out again one by one while the rest
# stays within this factor of what all of them do (verify._together): a repair's steps that shrink say so.
NEARLY_AS_MUCH = 1.25

# What each kind of cause says of a failing output, in every command's words.
CAUSE_KINDS = {
    "local": "one node introduces the error",
    "several": "several nodes introduce the error, none alone",
    "dominant": "one node carries most of the error, the rest accumulates",
    "accumulated": "no single node breaks it: the error accumulates",
    "not_found": "NaN/Inf reach it and no keep tried removes them",
    "unknown": "cause unknown",
}


@dataclass(frozen=True)
class Search:
    """What the search covered at one output: how many nodes the candidate changes upstream of it, how many
    were tried alone, how many are covered by groups whose keep does not halve the error (in how many
    groups), how many were left when the budget ran out, and how many groups broke the assumption that
    keeping more never hurts (their nodes then count as not covered unless tried alone)."""

    candidates: int
    alone: int
    grouped: int = 0
    groups: int = 0
    left: int = 0
    broken: int = 0

    @property
    def complete(self) -> bool:
        return self.left == 0

    def said(self, what: str, undone: str, short: str, best: str, measure: str = "its error") -> str:
        """The search's finding in words: of the `what` nodes ("quantized", "converted"), each `undone`
        ("left unquantized") alone leaves the output `short` ("out of tolerance"); `best`: the best single
        keep, said ("(best: ...)"); `measure`: what a group's keep does not halve (objective.score_said)."""
        if self.candidates == 0:
            return f"accudiff finds no {what} node upstream of it, and the suspects, {undone} alone, each leave it {short} {best}"
        if self.grouped == 0 and self.complete:
            return f"each of the {self.candidates} {what} nodes upstream, {undone} alone, leaves it {short} {best}"
        parts = [f"the {self.alone} {undone} alone each leave it {short} {best}"] if self.alone else []
        if self.grouped:
            parts.append(f"the {'other ' if self.alone else ''}{self.grouped}, {undone} in {self.groups} group(s), do not even halve {measure}: none of "
                         f"them could alone, so long as keeping more never hurts{'' if self.alone else f' {best}'}")
        text = f"of the {self.candidates} {what} nodes upstream, " + ", and ".join(parts)
        if not self.complete:
            text += f"; {self.left} were not searched (the budget, --cause-budget, ran out)"
        return text


@dataclass(frozen=True)
class Cause:
    kind: str  # a key of CAUSE_KINDS
    node: str | None = None
    tensor: str | None = None
    op_type: str | None = None
    findings: list[Finding] = field(default_factory=list)
    contributors: list[Contributor] = field(default_factory=list)
    verified: bool = False  # tested at the output by keeping suspects in higher precision (verification/verify.py)
    co_causes: list[Contributor] = field(default_factory=list)  # kind "several": the other nodes the repair needs
    alternatives: list[Contributor] = field(default_factory=list)  # kind "local": other single keeps that meet the target too
    absorbed: list[Absorbed] = field(default_factory=list)
    stand_in: str | None = None  # verified on this candidate instead (the compared one was captured elsewhere)
    searched: Search | None = None  # verified: what the cause search covered (verification/search.py)
    decision_keep: list[str] = field(default_factory=list)  # beside an accumulated error: the keep-list of its "decision" finding
    decision_node: str | None = None  # and the node it names
    failing_alone: int = 0  # "accumulated": nodes upstream that err past their own tolerance fed the reference's values (isolated run)


@dataclass(frozen=True)
class RepairStep:
    keep: list[str]
    tol_ratio: float  # the output's tolerance ratio with `keep` in higher precision
    figures: dict = field(default_factory=dict)  # and its decision figures (top-1 agreement, a map's flipped share)


@dataclass(frozen=True)
class Repair:
    """Nodes to keep in higher precision for one output, the steps that found them (the first: nothing
    kept), and whether the last step brought the output within tolerance on the samples tried (and, where
    those were some of the run's, `whole_run` on all of them)."""

    keep: list[str]
    steps: list[RepairStep]
    verified: bool
    samples: list[int] = field(default_factory=list)
    pruning_runs: int = 0  # runs that tried dropping its nodes once it held (readings.pruned): the last step is what held
    whole_run: RepairStep | None = None  # where `samples` are some of the run's: every verified repair's nodes kept, on all of them
    op_types: list[str] = field(default_factory=list)  # a repair by op type: these alone stay quantized, every other quantized node is kept
    # Suspects kept together (step 1), then left out one by one in the steps that keep fewer (verify._together): while the
    # rest still met the target (True), or stayed within NEARLY_AS_MUCH of all of them (False). None: not found so.
    left_out_while_met: bool | None = None
