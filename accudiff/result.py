"""What a comparison found: the table, the samples, the verdict and the causes (the product of
`accudiff.compare`, read by the reports, the bisectors and the pytest plugin)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import pandas as pd

from accudiff.judging.intervals import Interval
from accudiff.judging.objective import Resolution
from accudiff.judging.output_kinds import OutputKind, deciding
from accudiff.judging.table import STATUS_FAIL, STATUS_MISSING
from accudiff.judging.tolerances import Tolerances
from accudiff.findings import Cause, Finding, Repair
from accudiff.errors import AccudiffError
from accudiff.model.inventory import NodeSummary
from accudiff.transforms import KeptNode

if TYPE_CHECKING:
    from accudiff.settings import RunSettings

MIN_COVERAGE = 0.5  # below this share of the model's tensors compared, a clean result is not a pass


@dataclass(frozen=True)
class TensorFailure:
    """A tensor out of tolerance and what was found at it; for a graph output also the cause of its failure
    and the first tensor out of tolerance upstream (a fact about where the drift crossed the line, which
    is often not where it started)."""

    tensor: str
    node: str
    op_type: str
    findings: list[Finding]
    first_failing_upstream: str | None = None
    cause: Cause | None = None
    repair: Repair | None = None  # verified: what to keep in higher precision for this output, step by step


@dataclass
class CompareResult:
    """What a comparison found: the per-tensor table and per-sample outcomes, the verdict, and the causes."""

    model: Path
    precision: str
    candidate: str
    table: pd.DataFrame
    passed: bool
    first_failure: TensorFailure | None
    output_failures: list[TensorFailure]
    tolerances: Tolerances
    kept: list[KeptNode] = field(default_factory=list)
    converted: frozenset[str] = frozenset()  # nodes that compute in reduced precision
    not_observable: dict[str, str] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    iterations: int = 1  # samples compared
    seed: int | None = 0
    timings: dict[str, float] = field(default_factory=dict)  # wall seconds per stage of this process
    # Seconds per phase inside the worker processes, by stage ("comparison", "verification"), added over
    # workers (so with several workers they may exceed the stage's wall time): where a stage's time goes.
    worker_timings: dict[str, dict[str, float]] = field(default_factory=dict)
    # How the comparison ran: {"workers": N, "threads": [T]}, the threads each worker used (its sessions'
    # intra-op threads and its statistics).
    layout: dict = field(default_factory=dict)
    report_dir: Path | None = None
    samples: pd.DataFrame | None = None  # one row per sample and graph output (see stages/judge.py SAMPLE_COLUMNS)
    inputs: str = ""  # where the samples came from
    candidate_models: list[str] = field(default_factory=list)  # the candidate model files in the report (one per branch group)
    branches: list[dict] = field(default_factory=list)  # per group of samples: {"samples": [...], "taken": {If node: branch}}
    settings: RunSettings | None = None  # what was asked, its inputs as the report saved them: the commands a report prints run it again (report/next_steps.py)
    candidate_model: Path | None = None  # a candidate made by another tool (ModelOpt, ONNX Runtime's quantizer...), compared as it is
    unmatched: dict[str, str] = field(default_factory=dict)  # for such a candidate: a reference tensor it has no partner for -> why
    inside: dict[str, str] = field(default_factory=dict)
    output_kinds: dict[str, OutputKind] = field(default_factory=dict)  # what each graph output decides, and why (judging/output_kinds.py)  # ... of those, one computed inside a node its tool fused (compared at its output) -> that node
    quantized_by: dict[str, str] = field(default_factory=dict)  # for such a candidate: a node a tool quantized with ops of its own -> the tool
    reads_constant_weights: set[str] = field(default_factory=set)  # for such a candidate: nodes reading a float weight a Constant node holds
    repaired_candidate: str | None = None  # the file in the report: that candidate with its verified repairs kept
    # For such a candidate that quantizes and stores in FP16/BF16: per failing output, its tolerance ratio with
    # both, with its Q/DQ pairs undone, with its casts undone (and the top-1 agreement of each), on the trials' samples.
    loss_split: dict[str, dict] = field(default_factory=dict)
    # Per graph output, what its error does to the decision taken from it (judging/decisions.py: top-1/top-5
    # of class scores, a probability map's flipped share and IoU, error percentiles) and the tolerance it meets.
    decisions: dict[str, dict] = field(default_factory=dict)
    tolerance_met: dict[str, dict[str, float]] = field(default_factory=dict)
    require: dict[str, float] = field(default_factory=dict)  # decision targets outputs are judged by instead of their tolerance (--require)
    # Per graph output: the 95% interval of each decision figure that has one (judging/intervals.py), and the
    # required figures whose intervals straddle their targets (the data cannot tell: the verdict is inconclusive).
    intervals: dict[str, dict[str, Interval]] = field(default_factory=dict)
    unresolved: dict[str, list[Resolution]] = field(default_factory=dict)
    # A decoder's generation (execution/generation.py): each step (a sample) with its prompt, phase and both sides'
    # greedy choices; each prompt's tokens on both sides; the scores' figures per phase ("prefill", "decode").
    steps: pd.DataFrame | None = None
    generations: list[dict] = field(default_factory=list)
    phases: dict[str, dict[str, dict]] = field(default_factory=dict)
    # For the HTML report: the nodes and weights as written, every failing output's and cause's error
    # sketch (metrics.error_histogram), and sampled [reference, candidate] pairs of each graph output.
    nodes: dict[str, NodeSummary] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)
    error_sketches: dict[str, np.ndarray] = field(default_factory=dict)
    points: dict[str, list[list[float]]] = field(default_factory=dict)

    # Writes the report folder afterwards, where none was asked for (api.py keeps what it needs until then).
    report_writer: Callable[[Path], Path] | None = field(default=None, repr=False, compare=False)

    def write_report(self, path: str | Path) -> Path:
        """Write this comparison's report folder at `path`, as `report_dir=` would have (with the inputs, so
        its replay line runs it again); once. Returns the folder."""
        if self.report_dir is not None:
            raise AccudiffError(f"this comparison's report is already written, at '{self.report_dir}'")
        if self.report_writer is None:
            raise AccudiffError("this result holds no comparison to report (it was read back, not run)")
        return self.report_writer(Path(path))

    @property
    def replay(self) -> list[str]:
        """The command that runs this comparison again on the same inputs (none while its given inputs are
        saved nowhere: `write_report` saves them)."""
        return ["accudiff", "compare", *self.settings.arguments()] if self.replayable else []

    @property
    def replayable(self) -> bool:
        """Its inputs (or prompts) are files or generated from the seed (not given in memory), so a command can run it again."""
        return self.settings is not None and all(given is None or isinstance(given, (str, Path)) for given in (self.settings.inputs, self.settings.prompts))

    @property
    def outputs(self) -> pd.DataFrame:
        return self.table[self.table["is_output"]]

    @property
    def deciding_outputs(self) -> list[str]:
        """The graph outputs the verdict is judged by (output_kinds.deciding)."""
        return deciding(self.outputs["tensor"], self.output_kinds)

    @property
    def coverage(self) -> tuple[int, int]:
        """(tensors compared, tensors the model computes on these samples): bodies of If branches not taken
        are not counted, those of Loops and Scans are (they run, but cannot be observed)."""
        compared = int((self.table["status"] != STATUS_MISSING).sum())
        listed = set(self.table["tensor"])
        return compared, len(self.table) + sum(1 for name in self.not_observable if name not in listed)

    @property
    def verdict(self) -> str:
        """"pass", "fail" (a graph output out of tolerance) or "inconclusive" (no graph output failed, but
        less than MIN_COVERAGE of the model's tensors, or no graph output, was compared, or a required figure
        cannot be told from its target with the data; a tensor a candidate's tool computes inside a fused
        node counts as compared at the node's output)."""
        if self.output_failures:
            return "fail"
        return "pass" if self.passed else "inconclusive"

    @property
    def failing_samples(self) -> pd.DataFrame:
        """Rows of `samples` out of tolerance, worst first (by how many tolerances they reach)."""
        return self.samples[self.samples["status"] == STATUS_FAIL].sort_values("tol_ratio", ascending=False)

    def losing_samples(self, outputs: Sequence[str] | None = None) -> list[int]:
        """The failing samples of `outputs` (default: every graph output), by what they lose: each output's
        worst first, then those whose decision changes most (the share of top-1 flips, of detections not
        matched, of a map's elements flipped), then the others by how many tolerances they reach. Taken by the
        worst rows alone, one output's failures could fill them all; and the worst by tolerance may all be
        samples whose decision holds, where neither a keep nor a replay shows what the error does to it."""
        failing = self.failing_samples
        rows = failing if outputs is None else failing[failing["tensor"].isin(outputs)]
        worst = rows.drop_duplicates("tensor")["sample"]
        with np.errstate(divide="ignore", invalid="ignore"):
            lost = pd.concat([(rows["rows"] - rows["top1"]) / rows["rows"], (rows["det_union"] - rows["det_matched"]) / rows["det_union"],
                              rows["flipped"] / rows["map_elements"]], axis=1).fillna(0.0).max(axis=1)
        decided = rows.loc[lost[lost > 0].sort_values(ascending=False, kind="stable").index, "sample"]
        return list(dict.fromkeys(int(s) for s in [*worst, *decided, *failing["sample"]]))

    def class_agreement(self) -> dict[str, dict | None]:
        """Per graph output: top-1 and top-5 agreement of reference and candidate over every sample, for
        outputs that look like class scores (top-5 None over five classes or fewer); None (not applicable)
        for the others."""
        return {
            output: {"rows": found["score_vectors"], "top1": found["top1"], "top5": found.get("top5")} if "top1" in found else None
            for output, found in self.decisions.items()
        }
