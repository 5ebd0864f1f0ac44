"""Trials: run the candidate again with some nodes kept in higher precision, graph outputs only, and say
how far each output is from the reference (its tolerance ratio).

This is the one mechanism behind verified causes (verification/verify.py) and `accudiff bisect precision`:
a keep-list is judged by what it does at the graph outputs, not by what a rule says about one node.
Nothing is marked (these runs are cheap), and every keep-list is closed over precision boundaries first.
An FP16 candidate on ONNX Runtime is tried as one switchboard (transforms/switches.py): built, saved and
loaded once, each keep-list a run with its switches set, in the first worker, which stays up from one
call to the next and keeps its session open. Other candidates (INT8, TensorRT), and the loss split's
variants, get a variant per keep-list; their jobs go to whichever worker (up to one per core) asks first
once it is up. The reference's graph outputs are the ones the comparison recorded, or else recorded by
the first worker of the first call; every later one replays them.
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import onnx

from accudiff.judging.decisions import SampleOutcome, decision_figures, merge_counts
from accudiff.judging.intervals import COLUMNS, Interval, unit_intervals
from accudiff.judging.objective import Objective
from accudiff.judging.output_kinds import deciding, kinds_of
from accudiff.execution.messages import Job, PassSpec, WorkerResult, added_timings, merge_results
from accudiff.execution.pool import Worker, discard_spares, prestart, take_worker, worker_start_seconds
from accudiff.execution.generation import samples_per_prompt
from accudiff.execution.shards import run_shards
from accudiff.model.graph import tensor_bytes
from accudiff.model.inventory import ModelInfo
from accudiff.model.saving import save_model
from accudiff.model.samples import Samples
from accudiff.model.stores import ReferenceStore
from accudiff.settings import Compared, Judging
from accudiff.transforms.candidate import CandidateVariants
from accudiff.verification.boundaries import Boundaries, unfit_for_format
from accudiff.transforms.switches import Switchboard

if TYPE_CHECKING:
    import pandas as pd

MAX_TRIAL_SAMPLES = 8  # trials run on the worst failing samples, at most this many
VARIANTS_PER_WORKER = 8  # every variant's session is open at once in a worker: bound that
WORKER_START_SECONDS = 0.35  # a worker's Python start and imports, on one core, until one has measured it
LARGE_MODEL_BYTES = 1 << 30  # weights from which a model's trials run one variant at a time (see Trials)


@dataclass(frozen=True)
class TrialOutcome:
    """One keep-list tried: each graph output's tolerance ratio (worst over the samples; at most 1 means
    within tolerance) and its decision figures (judging/decisions.py: top-1/top-5 of class scores, a
    probability map's flipped share and IoU) over the samples."""

    keep: list[str]
    tol_ratio: dict[str, float]
    figures: dict[str, dict] = field(default_factory=dict)
    spans: dict[str, dict[str, Interval]] = field(default_factory=dict)  # each output's figures' 95% intervals over the trial's samples

    def passes(self, outputs: Sequence[str], objective: Objective) -> bool:
        """Every output meets what `objective` asks of it (its tolerance, or a required decision figure that
        its interval shows reached: a target the trial's samples cannot tell from the figure is not met)."""
        return all(objective.met(self.tol_ratio.get(name, math.inf), self.figures.get(name, {}), self.spans.get(name)) for name in outputs)


@dataclass
class TrialSetup:
    """What every trial of one comparison shares: the FP32 model, how its candidate is made, the samples
    tried (usually the failing ones), what is compared (its backend, TensorRT options) and how it is judged."""

    info: ModelInfo  # with its proto loaded
    variants: CandidateVariants
    samples: Samples
    compared: Compared
    judging: Judging
    scratch: Path
    shape_values: Mapping[str, list[int]] = field(default_factory=dict)
    # A decoder generating (Job.generation, its "trial" key set): `samples` are then prompts with the tokens the comparison
    # fed after each (model/prompts.replayed_prompts), fed again step by step, each side carrying its own KV cache.
    generation: dict | None = None


class Trials:
    """Counted trials over one setup; `boundaries` closes every keep-list before it is tried. Use it as a
    context manager: its workers stay up until it closes."""

    def __init__(self, setup: TrialSetup, table: pd.DataFrame, recorded: tuple[ReferenceStore, Sequence[int]] | None = None, regions: bool = False,
                 variant_seconds: float | None = None, replayed: bool = True, ray: str | None = None):
        """`table`: the comparison's statistics (ranges of the reference tensors), indexed by tensor.
        `recorded`: the reference's graph outputs as the comparison recorded them, and which of its
        samples (a decoder's prompts, each of its steps recorded) are the setup's (else the first trial records them). `regions`: see Boundaries.
        `variant_seconds`: what a variant is expected to cost a worker (a session and its runs, as the
        comparison measured them), when known: beside a switchboard, more workers start only for
        variants that would keep the first one busier than a worker takes to start. `replayed`: the
        reference's outputs recorded on disk by the first job and replayed by the others; else each job
        runs the reference beside its variants and nothing is stored (one batch on a run's every sample,
        whose outputs could take gigabytes: not for a large model, whose two sessions would not fit). `ray`:
        each call's keep-lists tried in one job, its samples split over Ray tasks as a comparison's are
        (execution/shards.py; not replayed: a task runs the reference beside them; not a decoder of large
        weights, whose trials run here one session at a time)."""
        self.setup = setup
        self.large = large_weights(setup.info)
        # A decoder's trials feed each prompt the tokens the comparison fed, so the reference's steps are the same in every
        # job: replayed where its sessions are made one at a time (large weights). Else its reference runs beside the keeps:
        # a step of a small decoder costs less than reading it back (bisect on a small Llama, medians of five: 12.9 s replayed, 11.8 s run).
        # A large decoder's trials stay here: a Ray task would generate with every keep-list's session open at once.
        self.ray = None if self.large and setup.generation is not None else ray
        self.replayed = replayed and self.ray is None and (setup.generation is None or self.large)
        self.variant_seconds = variant_seconds
        self.runs = 0
        self.kinds = kinds_of(setup.info, setup.judging.output_kinds)  # what each output decides: the figures a keep is judged by
        # A decoder's state (its KV cache) is run and carried, not measured or recorded: the logits of later steps judge it.
        self.judged = deciding(setup.info.output_names, self.kinds)
        setup.scratch.mkdir(parents=True, exist_ok=True)
        self.reference = ReferenceStore(Path(tempfile.mkdtemp(prefix="reference-", dir=setup.scratch)), self.judged)
        if recorded is not None and recorded[0].complete and self.replayed:
            store, samples = recorded
            steps = samples_per_prompt(setup.generation["new_tokens"]) if setup.generation else 1  # a decoder's: each step of its prompts
            for k, sample in enumerate(samples):
                for step in range(steps):
                    self.reference.write(k * steps + step, store.read(sample * steps + step, self.judged))
            self.reference.finish()
        self.boundaries = Boundaries(setup.info.proto.graph, unfit_for_format(table, setup.variants.recipe.precision), setup.variants.base.converted, regions)
        # Every model the trials save is saved in their folder: with the reference's and the candidate's weights
        # referred to where they are (or written there once, those only memory held), a variant or switchboard
        # writes its graph, and refers to them.
        for name, model in (("reference", setup.info.proto), ("candidate", setup.variants.base.model)):
            save_model(model, setup.scratch / f"{name}-weights.onnx", move_weights=True, side_file=True, in_place=True)
        self._workers: list[Worker] = []
        self.timings: dict[str, float] = {}  # the trial workers' seconds per phase, added up
        self._board: tuple[Switchboard, Path] | None = None
        self._expected: list[str] = []  # nodes later calls will keep (`expect`)
        self._tried: dict[tuple[tuple[str, ...], str], TrialOutcome] = {}  # (a keep-list closed, what it undoes) -> its outcome
        # A model whose weights are large is tried in one worker, each session made just before its run (two sessions,
        # or two workers, would map its weights twice), on a gated switchboard (switches.gate_switches: a kept node
        # computed only when its switch is on, its FP32 weights read only then), its other variants one at a time, its
        # reference replayed (a decoder's steps too; a job generating keeps its one session for every step).
        self._switchable = switchable(setup.compared)

    def __enter__(self) -> Trials:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        while self._workers:
            self._workers.pop().let_go()  # their teardown overlaps what the caller does next

    @property
    def tried(self) -> int:
        """How many keep-lists were run (one tried again is answered, not run)."""
        return len(self._tried)

    def expect(self, keep_lists: Sequence[Sequence[str]]) -> None:
        """Keep-lists later calls will try (closed as they will be): the next switchboard built has their nodes
        too, so it is built, saved and opened in a session once rather than again as a search reaches them."""
        self._expected = list(dict.fromkeys(n for keep in keep_lists for n in self.boundaries.close(keep)))

    def run(self, keep_lists: Sequence[Sequence[str]], parts: Sequence[str] | None = None, regions: bool | None = None,
            exact: bool = False) -> list[TrialOutcome]:
        """Each keep-list (closed over boundaries) tried on the setup's samples; outcomes in the same order.
        A switchboard's keep-lists go to the first worker, in one job (its runs on every core when it works
        alone). Variants are shared among as many workers as there are cores, each taking the next one
        built: what a variant costs is mostly single-threaded (preparing its model and creating its
        session); beside a switchboard, only when they are worth a worker's start (`variant_seconds`).
        `parts`, one per keep-list: of a candidate made by
        another tool, what keeping undoes (CandidateVariants.with_kept): "all" (the default), or only its
        "quantization" or its "casts". `regions`: see Boundaries.close. `exact`: the keep-lists as they are,
        not closed (pruning tries what a closure added). A keep-list tried before (closed the same, undoing
        the same) is answered by its outcome: every trial measures every output, and one output's search
        retraces much of another's."""
        keys = self._keys(keep_lists, parts, regions, exact)
        new = list(dict.fromkeys(key for key in keys if key not in self._tried))
        if new:
            self._tried.update(zip(new, self._try([list(keep) for keep, _ in new], [undone for _, undone in new])))
        return [self._tried[key] for key in keys]

    def answered(self, keep: Sequence[str], regions: bool | None = None, exact: bool = False) -> bool:
        """Whether `run` would answer this keep-list (undoing all) from an earlier run, without running it."""
        return self._keys([keep], None, regions, exact)[0] in self._tried

    def _keys(self, keep_lists: Sequence[Sequence[str]], parts: Sequence[str] | None, regions: bool | None, exact: bool) -> list[tuple[tuple[str, ...], str]]:
        """Each keep-list as `run` tries it (closed unless `exact`), with what it undoes: the memo's keys."""
        closed = [list(dict.fromkeys(keep)) if exact else self.boundaries.close(keep, regions) for keep in keep_lists]
        return [(tuple(keep), undone) for keep, undone in zip(closed, parts if parts is not None else ["all"] * len(closed))]

    def _try(self, closed: list[list[str]], parts: list[str]) -> list[TrialOutcome]:
        """`run`'s keep-lists, closed, not tried before."""
        cores = os.cpu_count() or 1
        started = time.perf_counter()
        board = self._switchboard([keep for keep, undone in zip(closed, parts) if undone == "all"])
        if self.ray is not None:
            batch = self._job(list(zip(closed, parts)), None, board)
            self.timings["models (caller)"] = round(self.timings.get("models (caller)", 0.0) + time.perf_counter() - started, 4)
            merged = run_shards(batch.job, batch.job.samples, ray=self.ray, indices=batch.job.sample_indices)
            self.timings = added_timings([self.timings, merged.timings])
            return batch.read(merged)
        # Positions of the keep-lists per worker: those the switchboard serves in one, the others shared.
        on_board = [i for i, undone in enumerate(parts) if board is not None and undone == "all"]
        apart = [i for i in range(len(closed)) if i not in set(on_board)]
        # Variants not worth a worker's start (`variant_seconds`) beside a switchboard, or once a worker is up,
        # go to the workers there are (a cause's parts: two variants, after the screen's).
        light = bool(on_board or self._workers) and self.variant_seconds is not None and not worth_a_worker(len(apart), self.variant_seconds)
        shared = len(self._workers) if light and not on_board else cores
        size = 1 if self.large else min(VARIANTS_PER_WORKER, math.ceil(len(apart) / shared))  # large: a variant a job, one job at a time
        groups = [on_board] * bool(on_board) + [apart[start : start + size] for start in range(0, len(apart), size or 1)]
        chunks = [[(closed[i], parts[i]) for i in group] for group in groups]
        count = min(len(chunks), max(1 if light or self.large else cores, len(self._workers))) if chunks else 0
        # Threads per worker stay as they were for the workers already up: their sessions were made with them.
        threads = max(1, cores // min(cores, max(count, len(self._workers), 1)))
        prestart(count - len(self._workers))  # their start overlaps the building of the models
        self._workers += [take_worker() for _ in range(count - len(self._workers))]
        outcomes: list[TrialOutcome] = []
        if self.large and not self.reference.complete and chunks:  # recorded first, then replayed: one session of its weights at a time
            self._record_reference(threads)
            started = time.perf_counter()  # the caller waited for the worker's runs: not its models' time
        recording = self.replayed and not self.reference.complete
        # Each worker takes the next job built, once it is up: a worker still starting leaves the jobs to one
        # already free (the switchboard's, after its own job).
        # The switchboard's job goes to the first worker, whose session of it later calls reuse.
        built: queue.Queue = queue.Queue()
        batches: list[_Batch] = []

        def build(index: int) -> Job:
            nonlocal started
            batches.append(self._job(chunks[index], self.reference.folder if self.replayed and (not recording or index == 0) else None, board, not on_board))
            self.timings["models (caller)"] = round(self.timings.get("models (caller)", 0.0) + time.perf_counter() - started, 4)
            started = time.perf_counter()
            return batches[-1].job

        def serve(worker: Worker, pinned: Job | None) -> list[tuple[int, dict]]:
            worker.wait_ready()
            # Beside other workers, the switchboard's job is its worker's first; alone, its last: the variants'
            # sessions are let go of before the switchboard's (which later calls reuse) is made, not held beside it.
            last = pinned if count == 1 else None
            done, item = [], (0, pinned) if pinned is not None and last is None else built.get()
            while item is not None:
                index, job = item
                done.append((index, merge_results([worker.run(replace(job, threads=threads))])))
                item = built.get()
            if last is not None:
                done.append((0, merge_results([worker.run(replace(last, threads=threads))])))
            return done

        with ThreadPoolExecutor(max_workers=count or 1) as pool:
            try:
                pinned = build(0) if on_board else None
                serving = [pool.submit(serve, worker, pinned if k == 0 else None) for k, worker in enumerate(self._workers[:count])]
                try:
                    for index in range(len(batches), len(chunks)):  # each job leaves as soon as its models are saved
                        built.put((index, build(index)))
                finally:
                    for _ in serving:
                        built.put(None)
                merged_by_job = dict(item for future in serving for item in future.result())
                found: dict[int, TrialOutcome] = {}
                for index, (group, batch) in enumerate(zip(groups, batches)):
                    merged = merged_by_job[index]
                    self.timings = added_timings([self.timings, merged.timings])
                    found.update(zip(group, batch.read(merged)))
                outcomes = [found[i] for i in range(len(closed))]
            except BaseException:
                discard_spares()
                for worker in self._workers:
                    worker.close(kill=True)
                self._workers = []
                raise
        if recording and batches:
            self.reference.finish()
        return outcomes

    def _record_reference(self, threads: int) -> None:
        """The reference's graph outputs on the setup's samples, recorded by the first worker in a job of their own."""
        job = replace(self._job([], self.reference.folder, None).job, threads=threads)
        self._workers[0].wait_ready()
        merged = merge_results([self._workers[0].run(job)])
        self.timings = added_timings([self.timings, merged.timings])
        self.reference.finish()

    def _switchboard(self, keep_lists: list[list[str]]) -> tuple[Switchboard, Path] | None:
        """The switchboard every keep-list of this call (and of the calls before) can be set on, built and
        saved when the current one lacks a node; None when the candidate needs a variant per keep-list."""
        converted = self.setup.variants.base.converted
        wanted = [n for keep in [*keep_lists, self._expected] for n in keep if n in converted]  # keeping any other node changes nothing
        if not self._switchable:
            return None
        if self._board is not None and set(wanted) <= self._board[0].switches.keys():
            return self._board
        nodes = [*(self._board[0].switches if self._board else []), *wanted]
        board = self.setup.variants.switchboard(nodes, gated=self.large)
        if board is None:
            self._switchable = False
            return None
        path = self.setup.scratch / f"switchboard-{self.runs}.onnx"
        save_model(board.model, path, in_place=True)
        board.model = onnx.ModelProto()
        self._board = board, path
        return self._board

    def _job(self, chosen: list[tuple[list[str], str]], reference: Path | None, board: tuple[Switchboard, Path] | None,
             release_reused: bool = False) -> _Batch:
        """The models of the `chosen` keep-lists (with what each undoes: their switchboard, or a variant each,
        saved), and the worker job that tries them (recording the reference's outputs in `reference`, or
        replaying them from it once complete). `release_reused`: the call tries nothing on the switchboard
        (a cause's parts, verification's last round), so its worker lets go of the switchboard's session
        first; a later call that needs it again makes it again."""
        setup = self.setup
        folder = setup.scratch / f"trials-{self.runs}"
        folder.mkdir(parents=True, exist_ok=True)  # the worker's result; the models beside the weights they refer to
        passes = []
        keep_lists = [keep for keep, _ in chosen]
        for k, (keep, parts) in enumerate(chosen):
            backend = setup.compared.backend
            if board is not None and parts == "all":
                switchboard, path = board
                passes.append(PassSpec(f"variant{k}", str(path), backend, fixed_inputs=switchboard.settings(keep), reuse=True))
            else:
                path = setup.scratch / f"trials-{self.runs}-variant{k}.onnx"
                save_model(setup.variants.with_kept(keep, parts).model, path, in_place=True)
                passes.append(PassSpec(f"variant{k}", str(path), backend))
        self.runs += len(keep_lists)
        info = setup.info
        first = setup.samples[0] if setup.generation is None else {}  # a prompt's feeds are made as it generates
        job = Job(
            reference=str(info.path),
            passes=passes,
            precision=setup.variants.recipe.precision,
            tensors=self.judged,
            outputs=self.judged,
            segments=[[node.name for node in info.proto.graph.node]],
            tolerances=setup.judging.tolerances.as_dict(),
            thresholds=setup.judging.thresholds,
            output_kinds={name: kind.as_json() for name, kind in self.kinds.items()},
            quant_ranges={},
            samples=setup.samples.as_json(),
            sample_indices=list(range(len(setup.samples))),
            result=str(folder / "result"),
            trt=setup.compared.trt.as_json(),
            input_shapes={spec.name: list(first[spec.name].shape) for spec in info.inputs if spec.name in first},
            shape_values=dict(setup.shape_values),
            input_specs=[[spec.name, str(spec.dtype), list(spec.shape)] for spec in info.inputs] if setup.generation is None else [],
            store=str(reference) if reference is not None else None,
            one_session_at_a_time=self.large,
            release_reused=release_reused,
            points=0,  # a trial is judged by its outcomes: no plot shows its values
            generation=setup.generation,
        )
        return _Batch(keep_lists, job, samples_per_prompt(setup.generation["new_tokens"]) if setup.generation else 1)


@dataclass(frozen=True)
class _Batch:
    keep_lists: list[list[str]]
    job: Job
    per_unit: int = 1  # the engine's samples a unit of the intervals takes: a prompt's steps, when a decoder generates

    def read(self, merged: WorkerResult) -> list[TrialOutcome]:
        """Each keep-list's outcome, from the job's merged result."""
        return [_outcome(keep, merged.passes[spec.name].outcomes, self.per_unit) for keep, spec in zip(self.keep_lists, self.job.passes)]


def _outcome(keep: list[str], outcomes: list[SampleOutcome], per_unit: int = 1) -> TrialOutcome:
    ratio: dict[str, float] = {}
    counts: dict[str, dict[str, float]] = {}
    units: dict[str, dict[int, dict[str, float]]] = {}  # each output's counts added per unit (a sample, a prompt's steps), NaN as none (as a table's sum)
    for one in map(vars, outcomes):  # flat dataclasses, read as they are (asdict deep-copies every field)
        name = one["tensor"]
        ratio[name] = max(ratio.get(name, 0.0), float(one["tol_ratio"]))
        merge_counts(counts.setdefault(name, {}), one)
        unit = units.setdefault(name, {}).setdefault(one["sample"] // per_unit, {})
        for column in COLUMNS:
            value = float(one[column])
            unit[column] = unit.get(column, 0.0) + (0.0 if math.isnan(value) else value)
    figures = {name: decision_figures(added) for name, added in counts.items()}
    spans = {name: unit_intervals({column: np.array([added[k][column] for k in sorted(added)]) for column in COLUMNS}, figures[name])
             for name, added in units.items()}
    for name, span in spans.items():  # one probability a sample (a yes/no classifier): its flips are decisions, not a map's elements
        if "flipped_share" in span and span["flipped_share"].positions == span["flipped_share"].units:
            figures[name]["decisions"] = span["flipped_share"].units
    return TrialOutcome(keep, ratio, figures, spans)


def large_weights(info: ModelInfo) -> bool:
    """Whether a model's weights are large enough for its trials to hold one session at a time (see Trials). Read
    from the model as loaded when it was remembered: the transform lets go of `info.proto`'s."""
    proto = info.remembered if info.remembered is not None else info.proto
    return sum(tensor_bytes(init) for init in proto.graph.initializer) >= LARGE_MODEL_BYTES


def switchable(compared: Compared) -> bool:
    """Whether the candidate can be tried as a switchboard: an FP16 or BF16 model, or a candidate made by another
    tool, run by ONNX Runtime (a TensorRT build of a switchboard would fuse differently; accudiff's INT8 and
    pre-built engines need variants, see CandidateVariants.switchboard, which may still refuse nodes inside
    If/Loop/Scan bodies)."""
    return (compared.precision in ("fp16", "bf16") or compared.candidate_model is not None) and compared.backend == "onnxrt" and compared.trt.engine is None


def trial_workers(compared: Compared) -> int:
    """How many workers trials start with: one when the candidate can be tried as a switchboard, else one
    per core (see the module's docstring)."""
    return 1 if switchable(compared) else os.cpu_count() or 1


def worth_a_worker(variants: int, variant_seconds: float) -> bool:
    """Whether `variants` costing `variant_seconds` each are worth starting one more worker for, beside the
    one up. Ready after its start s, it takes half of what is left: (n*v - s) / 2 saved. It must save at
    least half its start: the caller, building the variants' models, shares the cores with the workers,
    and a worker costs its memory (on paraphrase-MiniLM, four variants of 0.08-0.10 s each
    started one at a busy hour, with no time saved and the peak up from 247 to 307 MB)."""
    return variants * variant_seconds >= 2 * worker_start_seconds(WORKER_START_SECONDS)
