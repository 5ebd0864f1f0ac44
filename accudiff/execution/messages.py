"""The messages that cross the process boundary between a run and its workers (local processes or Ray
tasks): a job, the passes it runs, and the result a worker sends back. Plain dataclasses with one encoded
form each (`Job.to_json`/`from_json`; `WorkerResult.encode`/`decode`: its statistics as .npz, no pickle,
the rest as JSON), so a renamed field fails where the message is made, not in another process.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np

from accudiff.judging.decisions import SampleOutcome
from accudiff.judging.metrics import StatsSet, merge_run_time_ranges
from accudiff.memory import HUGE_PAGES_FROM_TENSOR_BYTES

POINTS_PER_OUTPUT = 2048  # (reference, candidate) pairs of each graph output a result keeps, for plots: the first samples'


@dataclass(frozen=True)
class PassSpec:
    """One pass of a job: a model run beside the reference, and how."""

    name: str  # "candidate", "isolated", another backend's name, or a trial's "variant<k>"
    model: str
    backend: str  # "onnxrt", "trt", or "recorded" (tensors captured elsewhere, replayed)
    fed_from_reference: dict[str, str] = field(default_factory=dict)  # input -> the reference tensor it is fed (the isolated run)
    layer_report: bool = False  # TensorRT: ask the engine which layers ran in which format
    samples: int | None = None  # it runs on the samples numbered below this (None: all)
    runs: int | None = None  # how many of the run's samples it compares: its sessions are sized for them (None: all)
    record: str | None = None  # a store folder its tensors are recorded into (--save-candidate)
    recorded: str | None = None  # backend "recorded": the store folder of the captured tensors
    label: str | None = None  # backend "recorded": what captured them, as said in messages
    fixed_inputs: dict[str, bool] = field(default_factory=dict)  # a switchboard's switches for this keep-list
    reuse: bool = False  # its sessions stay open for the worker's next job (a switchboard tried again with other switches)


@dataclass(frozen=True)
class Job:
    """Everything a worker needs, as plain data (it crosses a process or machine boundary as JSON)."""

    reference: str
    passes: list[PassSpec]
    precision: str
    tensors: list[str]
    outputs: list[str]
    segments: list[list[str]]
    tolerances: dict
    quant_ranges: dict[str, dict]  # tensor -> its QuantRange's fields
    samples: list[list[str]]  # this worker's samples: [file, key prefix] (model/samples.py)
    sample_indices: list[int]  # their positions among all samples
    result: str  # where the worker writes its result (<result>.npz and <result>.json)
    trt: dict = field(default_factory=dict)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    shape_values: dict[str, list[int]] = field(default_factory=dict)  # small integer inputs: TensorRT's shape-tensor inputs
    store: str | None = None  # a reference store folder to replay (when complete) or record
    layer_report: str | None = None
    inputs: list[str] = field(default_factory=list)  # graph inputs whose ranges the diagnosis needs
    input_specs: list[list] = field(default_factory=list)  # [name, dtype, shape]: each sample is checked as it is read
    threads: int = 0  # cores this worker may use (0: all); several workers on one machine share them
    # How its ONNX Runtime sessions are made is the same in every worker of a run, whatever the split: an
    # unoptimized session's convolutions and matrix products round by thread count, and an optimized one
    # otherwise than an unoptimized one, so the table would depend on --workers.
    run_samples: int = 0  # samples the whole run compares, over every worker (0: this job's)
    # Sessions it may run at once, each on `threads` cores (engine.py): a dataset's lone worker on several cores
    # runs a candidate pass beside the reference, each session computing as it would alone.
    sessions_at_once: int = 1
    outputs_store: str | None = None  # a store folder where the reference's graph outputs are recorded
    largest_tensor: int = 0  # bytes: how the worker gets memory (memory.py; group.Plan)
    thresholds: dict[str, float] = field(default_factory=dict)  # a probability map's threshold by output ("": the default)
    output_kinds: dict[str, list] = field(default_factory=dict)  # graph output -> [its kind, the axis its entries run along]
    # A decoder's generation (execution/generation.py): {"decoder": Decoder.as_json(), "new_tokens": N, "cache_types": {past: dtype}};
    # its samples are then prompts, each run as a prefill and N decode steps, each step a sample of the engine.
    generation: dict | None = None
    # Sessions made one at a time, each just before its run (else all at once, kept for every sample): weights
    # of a model too large to hold twice (trial.LARGE_MODEL_BYTES). A job generating keeps its one model's session
    # for every step (the trials of such a model replay the reference: see trial.Trials).
    one_session_at_a_time: bool = False
    # Sessions an earlier job kept (`PassSpec.reuse`: a trial's switchboard) closed first when none of this job's
    # passes reuses them: its variants' sessions would otherwise sit beside them (verification's last round).
    release_reused: bool = False
    # Model files made by another tool, checked first to load in ONNX Runtime as they are (a candidate accudiff
    # then aligns and runs in its own form must never stand in for a file ONNX Runtime refuses).
    validate: list[str] = field(default_factory=list)
    points: int = POINTS_PER_OUTPUT  # (reference, candidate) pairs of each graph output kept for plots (a trial's: none)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls.from_fields(json.loads(text))

    @classmethod
    def from_fields(cls, fields: dict) -> Job:
        return cls(**{**fields, "passes": [PassSpec(**p) for p in fields["passes"]]})

    @property
    def large_tensors(self) -> bool:
        """Fresh memory is then what a run costs: huge pages, and one arena for all sessions."""
        return self.largest_tensor >= HUGE_PAGES_FROM_TENSOR_BYTES


@dataclass(frozen=True)
class Probe:
    """A few values of the FP32 model a caller's stage needs before any comparison (the If conditions each
    sample takes, the largest values autokeep must keep out of FP16): computed in a worker, as every backend
    call is, and returned as a summary of each value per sample (`ProbedValue`)."""

    model: str
    outputs: list[str]
    samples: list[list[str]]  # [file, key prefix] (model/samples.py)
    result: str  # where the worker writes its answer (JSON)

    def to_json(self) -> str:
        return json.dumps({"probe": asdict(self)})


@dataclass(frozen=True)
class ProbedValue:
    """One value on one sample: its first element, and its largest finite magnitude (0 if none is finite)."""

    first: float
    largest_finite: float


def read_message(text: str) -> Job | Probe:
    """A message a worker reads (one line): a job, or a probe."""
    fields = json.loads(text)
    return Probe(**fields["probe"]) if "probe" in fields else Job.from_fields(fields)


@dataclass(frozen=True)
class PassResult:
    """What one pass leaves: statistics, and what a reader of the table must know about them. The engine
    fills its containers as samples go; `merged` and `widened` make new ones."""

    stats: StatsSet
    seen: dict[int, tuple[str, str, str]] = field(default_factory=dict)  # tensor row -> (dtype, cand dtype, shape)
    notes: dict[int, str] = field(default_factory=dict)  # tensor row -> why it was not compared
    not_observable: dict[str, str] = field(default_factory=dict)
    label: str = ""
    notices: list[str] = field(default_factory=list)
    outcomes: list[SampleOutcome] = field(default_factory=list)
    points: dict[str, list[list[float]]] = field(default_factory=dict)  # graph output -> sampled [sample, reference, candidate]
    # graph output -> its sketches: of its elements' errors in tolerances ("ratio"), of its positions' KL divergences ("kl")
    sketches: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    def merged(self, other: PassResult) -> PassResult:
        """This pass and the same pass on other samples (another worker's), as one: statistics and sketches
        added, the first word kept on each tensor, the first samples' points."""
        stats = StatsSet.from_arrays(self.stats.arrays())
        stats.merge(other.stats)
        sketches = {output: dict(found) for output, found in self.sketches.items()}
        for output, found in other.sketches.items():
            for figure, sketch in found.items():
                sketches.setdefault(output, {})[figure] = sketches.get(output, {}).get(figure, 0) + sketch
        points = {output: list(found) for output, found in self.points.items()}
        for output, found in other.points.items():  # the first samples' points, however they were sharded
            points[output] = sorted([*points.get(output, []), *found], key=lambda point: point[0])[:POINTS_PER_OUTPUT]
        return replace(self, stats=stats, sketches=sketches, points=points, seen={**other.seen, **self.seen}, notes={**other.notes, **self.notes},
                       not_observable={**other.not_observable, **self.not_observable}, outcomes=[*self.outcomes, *other.outcomes])

    def widened(self, rows: np.ndarray, count: int) -> PassResult:
        """This pass's tensors placed at `rows` of a table of `count` tensors (the union of branch groups')."""
        stats = StatsSet(count)
        stats.values[rows], stats.sketch[rows] = self.stats.values, self.stats.sketch
        return replace(self, stats=stats, seen={int(rows[k]): v for k, v in self.seen.items()}, notes={int(rows[k]): v for k, v in self.notes.items()})


@dataclass(frozen=True)
class Layout:
    """How a comparison ran: how many workers side by side, the threads each session used, and how many
    sessions a worker ran at once."""

    workers: int = 0
    threads: tuple[int, ...] = ()
    sessions_at_once: int = 1


@dataclass(frozen=True)
class WorkerResult:
    """What a worker sends back for one job (or several workers' results merged): each pass's result, the
    graph inputs' statistics, and what the run knew about itself."""

    passes: dict[str, PassResult]
    inputs: StatsSet  # the graph inputs whose ranges the diagnosis needs (Job.inputs)
    reference_not_observable: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, added over workers
    layout: Layout = Layout()
    run_time_ranges: dict[str, list[float]] = field(default_factory=dict)  # tensor quantized as the model runs -> metrics.run_time_range
    steps: list[dict] = field(default_factory=list)  # a decoder's generation: its steps (generation.Step as JSON)
    generations: list[dict] = field(default_factory=list)  # ... and each prompt's continuations

    def encode(self) -> tuple[str, bytes]:
        """Its two files' contents: JSON text, and the statistics as .npz (sketches sparse: mostly empty buckets)."""
        arrays = {"inputs/values": self.inputs.values, **_sparse("inputs/sketch", self.inputs.sketch)}
        passes = {}
        for name, result in self.passes.items():
            arrays.update({f"{name}/values": result.stats.values, **_sparse(f"{name}/sketch", result.stats.sketch)})
            keys = [(output, figure) for output, found in result.sketches.items() for figure in found]
            sketches = np.array([result.sketches[o][f] for o, f in keys], np.int64) if keys else np.zeros((0, 0), np.int64)
            arrays.update(_sparse(f"{name}/sketches", sketches))
            passes[name] = {"sketch_keys": keys, "seen": {str(k): v for k, v in result.seen.items()}, "notes": {str(k): v for k, v in result.notes.items()},
                            "not_observable": result.not_observable, "label": result.label, "notices": result.notices,
                            "outcomes": [vars(o) for o in result.outcomes], "points": result.points}  # flat: no deep copy
        document = {"passes": passes, "reference_not_observable": self.reference_not_observable, "timings": self.timings, "layout": asdict(self.layout),
                    "run_time_ranges": self.run_time_ranges, "steps": self.steps, "generations": self.generations}
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)  # sketches are written sparse: compressing would cost more than it saves
        return json.dumps(document, default=float), buffer.getvalue()

    @classmethod
    def decode(cls, document_text: str, arrays_npz: bytes) -> WorkerResult:
        document = json.loads(document_text)
        passes = {}
        with np.load(io.BytesIO(arrays_npz), allow_pickle=False) as arrays:
            for name, part in document["passes"].items():
                stats = StatsSet.from_arrays({"values": arrays[f"{name}/values"], "sketch": _dense(arrays, f"{name}/sketch")})
                sketches: dict[str, dict[str, np.ndarray]] = {}
                for (output, figure), sketch in zip(part["sketch_keys"], _dense(arrays, f"{name}/sketches")):
                    sketches.setdefault(output, {})[figure] = sketch
                passes[name] = PassResult(
                    stats, {int(k): tuple(v) for k, v in part["seen"].items()}, {int(k): v for k, v in part["notes"].items()}, part["not_observable"],
                    part["label"], part["notices"], [SampleOutcome(**o) for o in part["outcomes"]], part["points"], sketches)
            inputs = StatsSet.from_arrays({"values": arrays["inputs/values"], "sketch": _dense(arrays, "inputs/sketch")})
        layout = document["layout"]
        return cls(passes, inputs, document["reference_not_observable"], document["timings"], Layout(layout["workers"], tuple(layout["threads"]), layout["sessions_at_once"]),
                   document["run_time_ranges"], document["steps"], document["generations"])

    def merged(self, other: WorkerResult, side_by_side: bool = True) -> WorkerResult:
        """This result and another of the same job on other samples (`side_by_side`: another worker at the
        same time; else a branch group run after this one): passes and statistics merged, times added."""
        inputs = StatsSet.from_arrays(self.inputs.arrays())
        inputs.merge(other.inputs)
        passes = dict(self.passes)
        for name, part in other.passes.items():
            passes[name] = passes[name].merged(part) if name in passes else part
        ranges = dict(self.run_time_ranges)
        for tensor, record in other.run_time_ranges.items():
            ranges[tensor] = merge_run_time_ranges(ranges.get(tensor), record)
        workers = self.layout.workers + other.layout.workers if side_by_side else max(self.layout.workers, other.layout.workers)
        return WorkerResult(passes, inputs, {**self.reference_not_observable, **other.reference_not_observable}, added_timings([self.timings, other.timings]),
                            Layout(workers, tuple(sorted({*self.layout.threads, *other.layout.threads})),
                                   max(self.layout.sessions_at_once, other.layout.sessions_at_once)), ranges,
                            [*self.steps, *other.steps], [*self.generations, *other.generations])

    def widened(self, rows: Sequence[int], count: int) -> WorkerResult:
        """This result's tensors placed at `rows` of a table of `count` tensors (see PassResult.widened)."""
        at = np.asarray(rows, dtype=np.intp)
        return replace(self, passes={name: part.widened(at, count) for name, part in self.passes.items()})


def merge_results(results: Iterable[WorkerResult], side_by_side: bool = True) -> WorkerResult:
    """One result from several (same job, other samples), added up in their order, each as it comes: only the
    running total is held, whatever their number."""
    merged = None
    for result in results:
        merged = result if merged is None else merged.merged(result, side_by_side)
    if merged is None:
        raise ValueError("no result to merge")
    return merged


def added_timings(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """Seconds per phase, added over workers (or branch groups, or rounds)."""
    total: dict[str, float] = {}
    for part in parts:
        for phase, seconds in part.items():
            total[phase] = round(total.get(phase, 0.0) + seconds, 4)
    return total


def _sparse(key: str, sketch: np.ndarray) -> dict[str, np.ndarray]:
    """A sketch as its nonzero buckets (most of its buckets are empty): flat positions, counts, shape."""
    flat = sketch.reshape(-1)
    at = np.flatnonzero(flat)
    return {f"{key}/at": at, f"{key}/count": flat[at], f"{key}/shape": np.asarray(sketch.shape, np.int64)}


def _dense(arrays, key: str) -> np.ndarray:
    sketch = np.zeros(int(np.prod(arrays[f"{key}/shape"])), np.int64)
    sketch[arrays[f"{key}/at"]] = arrays[f"{key}/count"]
    return sketch.reshape(tuple(arrays[f"{key}/shape"]))
