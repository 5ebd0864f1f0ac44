"""What every bisector shares: fixed inputs, one cached reference, counted candidate runs, progress, and a
clean stop on Ctrl-C that keeps what was found so far."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Callable, TextIO

from accudiff.api import run
from accudiff.stages.group import record_reference
from accudiff.verification.trial import TrialSetup, Trials
from accudiff.stages.branches import branch_groups, calibration_per_group
from accudiff.errors import AccudiffError
from accudiff.execution.probes import largest_values
from accudiff.model.decoder import cache_types, find_decoder
from accudiff.model.inventory import ModelInfo
from accudiff.model.prompts import prepare_generation, replayed_prompts, whole_sequences
from accudiff.model.loading import load_model
from accudiff.model.saving import save_model
from accudiff.model.samples import Samples, prepare_samples
from accudiff.result import CompareResult
from accudiff.model.stores import ReferenceCache, ReferenceStore
from accudiff.settings import RunSettings
from accudiff.transforms.base import TransformResult
from accudiff.model.value_file import ValueFile
from accudiff.transforms.candidate import CandidateVariants, calibration_samples, transform_model
from accudiff.transforms.float_form import float_reference
from accudiff.transforms.opset import at_forms_opset


@dataclass
class BisectSession:
    """One model, one set of inputs and one reference, compared again and again under changes."""

    settings: RunSettings
    progress: Callable[[str], None] = lambda message: None
    candidate_runs: int = 0

    def __post_init__(self) -> None:
        if self.settings.precision == "fp32" and self.settings.candidate_model is None and self.settings.backend[0] == "onnxrt":
            raise AccudiffError("bisect looks for what fails in a reduced-precision candidate, and no option chose one: give --fp16, --bf16 or --int8, "
                                "or --candidate-model FILE (in FP32, ONNX Runtime would compare the model with itself)")
        self.info: ModelInfo = load_model(self.settings.model)
        self.settings.check_against(self.info)  # a bad option is one sentence before any step is shown
        self.cache = ReferenceCache()
        try:
            self._prepare()
        except BaseException:  # a bad input file is one sentence, and leaves no folder behind
            self.close()
            raise

    def _prepare(self) -> None:
        if self.settings.given_alone:  # the model is its own candidate: the reference is its float form
            self.info, _ = float_reference(self.info, self.cache.folder)
        self.info, _ = at_forms_opset(self.info, self.settings.precision, self.cache.folder)
        # A decoder generating from prompts: the feeds are its prompts' whole sequences, known after the first comparison.
        self.feeds: Samples | None = prepare_samples(self.info, self.settings.inputs, self.cache.folder / "inputs.npz", input_shapes=self.settings.input_shapes,
                                                         iterations=self.settings.iterations, seed=self.settings.seed, val_range=self.settings.val_range) if self.settings.prompts is None else None
        if self.settings.calib_data is not None and self.feeds is not None:
            self.calibration_feeds  # noqa: B018 - a missing or malformed calibration file is one sentence before any step is shown

    @property
    def model(self) -> Path:
        return Path(self.settings.model)

    @property
    def precision(self) -> str:
        return self.settings.precision

    def compare(self, isolate: bool = False, **changes) -> CompareResult:
        """A comparison with the session's inputs and settings (without the isolated run unless asked: the
        bisection steps only need a verdict) under `changes`; counts the candidate runs it makes."""
        changes = {"report_dir": None, "isolate": isolate, **changes}
        if self.settings.prompts is None or "inputs" in changes:  # a decoder's cut is fed its values, not prompts
            settings = self.settings.fed(changes.pop("inputs", self.feeds), **changes)
        else:
            settings = replace(self.settings, **changes)
        result = run(settings, reference_cache=self.cache)
        self.candidate_runs += 2 if isolate else 1
        if self.feeds is None and result.generations:  # a cut is fed each prompt's whole sequence as one prefill (a subgraph has no cache to carry)
            decoder = find_decoder(self.info.path, self.info.inputs, self.info.output_names)
            self.feeds = whole_sequences(result.generations, decoder, cache_types(self.info.inputs, decoder), self.cache.folder / "inputs.npz", self.info.inputs)
        return result

    def specialize(self) -> None:
        """Continue on the model with the If branches the samples take inlined (names kept), so that every
        node the comparison can name is a node of the graph a bisector cuts. Samples that take different
        branches have no one such graph: one sentence. INT8 calibration keeps the samples that take the
        same branches, as in `compare`. A decoder generating from prompts has no feeds before its first
        comparison: it is taken as it is (a graph whose If conditions come from its prompts is not specialized)."""
        if self.feeds is None:
            return
        groups = branch_groups(self.info.proto, self.feeds)
        if not any(group.taken for group in groups):
            return
        if len(groups) > 1:
            raise AccudiffError(
                f"the samples take {len(groups)} different combinations of the model's If branches, and a subgraph is cut from one: "
                "bisect samples that take the same branches (accudiff compare lists them under 'branches' in summary.json)"
            )
        if self.precision == "int8" and self.settings.calib_data is not None:
            calibration = calibration_per_group(self.info, groups, self.settings.calib_data, self.cache.folder)[0]
            self.settings = replace(self.settings, calib_data=calibration)
        taken = groups[0].taken
        shown = ", ".join(f"If '{node}' its {branch}" for node, branch in list(taken.items())[:2])
        self.progress(f"every sample takes the same branches of {len(taken)} If node(s) ({shown}{', ...' if len(taken) > 2 else ''}): working on the model with them inlined")
        self.settings = replace(self.settings, model=self.cache.folder / "specialized.onnx")
        save_model(groups[0].model, self.model)
        self.info = load_model(self.model)

    def reference_outputs(self, samples: Samples | None = None) -> ReferenceStore:
        """The full model's reference outputs for `samples` (default: the session's), run once and kept on disk."""
        return record_reference(self.info, samples if samples is not None else self.feeds, self.cache, self.settings.max_memory)

    @cached_property
    def calibration_feeds(self) -> Samples:
        """The INT8 calibration samples of the full model, exactly as `compare` uses them."""
        return calibration_samples(self.info, self.feeds[0], self.settings.calib_data, self.settings.seed, self.cache.folder)

    @cached_property
    def candidate(self) -> TransformResult:
        """The candidate exactly as `compare` builds it (a candidate made by another tool: aligned)."""
        return transform_model(self.info, self.settings.compared.recipe, self.feeds, largest_values, self.cache.folder)

    def trials(self, full: CompareResult) -> Trials:
        """Trials of the candidate with nodes kept in higher precision, on every sample of the session,
        built from the same recipe as `compare`'s candidate (so the repaired model is the one verified); a
        kept node's readers that only move its values are kept with it (Boundaries, regions). A decoder's
        generate as `full` did, step by step on the tokens it fed."""
        compared = self.settings.compared
        folder = self.cache.folder / "trials"
        samples, generation = self.feeds, None
        if full.generations:
            folder.mkdir(parents=True, exist_ok=True)
            candidate = Path(self.settings.candidate_model) if self.settings.candidate_model is not None else None
            plan = prepare_generation(self.info, self.settings.prompts, self.settings.decode_steps, folder / "prompts.npz", folder, candidate)
            samples, generation = replayed_prompts(full.generations, folder / "replayed.npz"), plan.as_json(trial=True)
        setup = TrialSetup(self.info, CandidateVariants(self.info, compared.recipe, self.candidate, ValueFile(folder)), samples, compared, self.settings.judging, folder,
                           generation=generation)
        return Trials(setup, full.table.set_index("tensor"), regions=True)

    def close(self) -> None:
        self.cache.close()


def stderr_progress(stream: TextIO | None = None) -> Callable[[str], None]:
    """Progress lines on stderr (looked up at each call, so redirection after start-up is honoured)."""

    def show(message: str) -> None:
        target = stream or sys.stderr
        target.write(f"  {message}\n")
        target.flush()

    return show
