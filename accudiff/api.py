"""`accudiff.compare`: the main job, as a Python function. The CLI and the pytest plugin call this."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import onnx
import pandas as pd

from accudiff.comparison.metrics import StatsSet
from accudiff.comparison.table import STATUS_FAIL, STATUS_MISSING, STATUS_PASS, build_table, graph_input_table, with_side_run
from accudiff.comparison.branches import BranchGroup, branch_groups, describe_groups, merge_group_results
from accudiff.comparison.shards import run_shards
from accudiff.comparison.worker import Job, discard_spares, prestart
from accudiff.comparison.tolerances import Tolerances
from accudiff.comparison.trial import TrialSetup, Trials
from accudiff.diagnosis.cause import Cause, ancestor_tensors, find_cause
from accudiff.diagnosis.verify import DEFAULT_BUDGET, Repair, verify_causes
from accudiff.diagnosis.rules import DiagnosisContext, Finding, diagnose
from accudiff.errors import AccudiffError
from accudiff.memory import return_freed_memory
from accudiff.model.inputs import Feed, generate_feeds, parse_input_shapes, parse_val_ranges, resolve_shapes, validate_feeds
from accudiff.model.loading import ModelInfo, NodeSummary, all_nodes, describe, load_model, save_model
from accudiff.model.samples import Samples, samples_from_feeds, samples_from_path
from accudiff.model.segments import SEGMENTS_PER_BUDGET, memory_budget, plan_segments, tensor_sizes
from accudiff.options import run_arguments
from accudiff.report.content import CANDIDATE_MODEL_FILE, INPUTS_FILE
from accudiff.report.folder import ReportFolder
from accudiff.runners import TrtOptions, resolve_candidate
from accudiff.runners.outputs import ReferenceCache, ReferenceStore
from accudiff.transforms import KeptNode, NodeSelector, TransformResult
from accudiff.transforms.candidate import CandidateRecipe, CandidateVariants, transform_model
from accudiff.transforms.isolate import isolate_in_place

PRECISIONS = ("fp32", "fp16", "int8")
BRANCHES_INLINED_FOR_TRT = ("the TensorRT engine is built from the model with its taken branches inlined, so its tensors can be marked; "
                            "the shipped engine, with conditional layers, may fuse and round differently around them")
MIN_COVERAGE = 0.5  # below this share of the model's tensors compared, a clean result is not a pass
ENGINE_LAYERS_FILE = "engine_layers.json"


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
    timings: dict[str, float] = field(default_factory=dict)
    report_dir: Path | None = None
    samples: pd.DataFrame | None = None  # one row per sample and graph output (see SAMPLE_COLUMNS)
    inputs: str = ""  # where the samples came from
    candidate_models: list[str] = field(default_factory=list)  # the candidate model files in the report (one per branch group)
    branches: list[dict] = field(default_factory=list)  # per group of samples: {"samples": [...], "taken": {If node: branch}}
    replay: list[str] = field(default_factory=list)  # the command that runs this comparison again on the same inputs
    # For the HTML report: the nodes and weights as written, every failing output's and cause's error
    # sketch (metrics.error_histogram), and sampled [reference, candidate] pairs of each graph output.
    nodes: dict[str, NodeSummary] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)
    error_sketches: dict[str, np.ndarray] = field(default_factory=dict)
    points: dict[str, list[list[float]]] = field(default_factory=dict)

    @property
    def outputs(self) -> pd.DataFrame:
        return self.table[self.table["is_output"]]

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
        less than MIN_COVERAGE of the model's tensors, or no graph output, was compared)."""
        if self.output_failures:
            return "fail"
        return "pass" if self.passed else "inconclusive"

    @property
    def failing_samples(self) -> pd.DataFrame:
        """Rows of `samples` out of tolerance, worst first (by how many tolerances they reach)."""
        return self.samples[self.samples["status"] == STATUS_FAIL].sort_values("tol_ratio", ascending=False)

    def class_agreement(self) -> dict[str, dict | None]:
        """Per graph output: top-1 and top-5 agreement of reference and candidate over every sample, for
        outputs that look like class scores; None (not applicable) for the others."""
        agreement = {}
        for output, rows in self.samples.groupby("tensor", sort=False):
            count = int(rows["rows"].sum())
            agreement[output] = {"rows": count, "top1": rows["top1"].sum() / count, "top5": rows["top5"].sum() / count} if count else None
        return agreement


def compare(
    model: str | Path,
    precision: str = "fp32",
    *,
    candidate: str = "auto",
    input_shapes: Iterable[str] | dict[str, tuple[int, ...]] = (),
    inputs: str | Path | Sequence[Feed] | None = None,
    seed: int = 0,
    val_range: Iterable[str] = (),
    iterations: int = 1,
    calib_data: str | Path | None = None,
    keep_fp32: Iterable[str] = (),
    autokeep: bool = True,
    atol: Iterable[str] | float | None = None,
    rtol: Iterable[str] | float | None = None,
    stol: Iterable[str] | float | None = None,
    report_dir: str | Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    reference_cache: ReferenceCache | None = None,
    trt: TrtOptions = TrtOptions(),
    isolate: bool = True,
    verify: bool = True,
    verify_budget: int = DEFAULT_BUDGET,
    also: str | None = None,
    max_memory: int | str | None = None,
    workers: int | None = None,
    ray: str | None = None,
) -> CompareResult:
    """Compare every tensor of `model` run in FP32 (reference) against the `precision` candidate.

    Inputs come from `inputs` (an .npz file, a folder of them, a polygraphy JSON file, or a list of feeds;
    files are read one sample at a time) or are generated from
    `seed` and `val_range` for `iterations` iterations. With `report_dir`, the report folder is written
    there atomically. A `reference_cache` shared between calls runs each model's reference only once per
    set of inputs. `isolate` (on by default) adds, for every tensor, the error its node makes when fed the
    reference's values (columns `isolated_*`; one extra candidate run): without it, a cause can be named
    only from range evidence. `verify` (on by default) tests every suspect at the failing outputs: the
    candidate runs again with it kept in higher precision, graph outputs only, at most `verify_budget`
    runs per failing output (see diagnosis/verify.py). `also="onnxrt"` runs the same transformed model
    on a second backend too (columns `onnxrt_*`), separating the model's own error from what a TensorRT
    build adds. The cause of each failing output is named from these runs (see diagnosis/cause.py).
    `max_memory` (bytes, or a size such as "2G") bounds the memory the compared tensors take: larger
    models are compared segment by segment (default: see `memory_budget`). `workers` splits the samples
    over that many worker processes (default 1); `ray` runs the shards as tasks on a Ray cluster ("local"
    starts one, an address joins one; default one shard per CPU of the cluster). Either way the statistics
    merge into the same table. Ifs are resolved per sample and their taken branches compared (see
    comparison/branches.py).
    Raises AccudiffError (one sentence) for any problem with the inputs.
    """
    if precision not in PRECISIONS:
        raise AccudiffError(f"unknown precision '{precision}'; choose one of: {', '.join(PRECISIONS)}")
    if iterations < 1:
        raise AccudiffError("--iterations must be at least 1")
    if verify and verify_budget < 1:
        raise AccudiffError("--verify-budget must be at least 1 (or pass --no-verify)")
    step = _Stopwatch()
    tolerances = Tolerances.build(precision, atol, rtol, stol)
    kind, notice = resolve_candidate(candidate, trt)
    if also is not None and also not in ("onnxrt", "trt"):
        raise AccudiffError(f"--also takes onnxrt or trt, not '{also}'")
    if trt.engine is not None and kind != "trt":
        raise AccudiffError("--engine compares a TensorRT engine: it needs --candidate trt (or auto, where TensorRT can run)")
    info = load_model(model)
    if not info.tensors:
        reasons = sorted(set(info.not_observable.values()))
        raise AccudiffError(f"'{info.path.name}' computes no tensor accudiff can compare" + (f": {reasons[0]}" if reasons else ""))
    NodeSelector(keep_fp32).require_matches(all_nodes(info.proto.graph))
    tolerances.require_known_tensors({t.name for t in info.tensors})
    folder = ReportFolder(Path(report_dir) if report_dir is not None else None)
    scratch = Path(tempfile.mkdtemp(prefix="accudiff-compare-"))
    try:
        if ray is None:
            prestart()  # the first worker starts while the samples are read and the candidate is built
        samples = prepare_samples(info, inputs, input_shapes, seed, val_range, iterations, folder.path / INPUTS_FILE)
        groups = branch_groups(info.proto, samples)
        specialized = any(group.taken for group in groups)
        if specialized:  # a pattern that selected only an If (now replaced by its branch) would keep nothing
            NodeSelector(keep_fp32).require_matches([node for group in groups for node in all_nodes(group.model.graph)])
        calibration = calibration_per_group(info, groups, calib_data, scratch) if precision == "int8" and trt.engine is None else {}
        if specialized:
            info.proto = onnx.ModelProto()  # each group has its own specialized copy
        step.lap("load")
        run = _GroupSettings(
            precision, kind, also, trt, keep_fp32, autokeep, seed, isolate, tolerances, max_memory, workers, ray, reference_cache, folder,
            scratch, report_dir is not None, step,
        )
        runs = []
        for k, group in enumerate(groups):
            group_info = info if not group.taken else _specialized(group, scratch / f"specialized-{k}.onnx")
            group.model = onnx.ModelProto()  # the group's inventory holds the model until its candidate is written
            name = CANDIDATE_MODEL_FILE.format(precision=precision, group="" if len(groups) == 1 else f"-group{k}")
            done = sum(len(g.samples) for g in groups[:k])
            report = (lambda phase, finished, total, done=done: progress(phase, done + finished, len(samples))) if progress else None
            runs.append(_compare_group(run, group_info, samples, group.samples, name, report, calibration.get(k, calib_data)))
        info, transformed, outcome = _combine(info.path, runs)
        result, context = _judge(info, precision, outcome, tolerances, transformed, isolate, also, seed if inputs is None else None, samples)
        if len(result.outputs) and not result.outputs["elements"].any():
            raise AccudiffError(f"every graph output of '{info.path.name}' is empty on these inputs: the comparison would cover no element")
        step.lap("diagnose")
        verification_notice = None
        if verify and result.output_failures:
            verification_notice = _verify(result, context, run, runs, samples, verify_budget)
            step.lap("verify")
        _attach_sketches(result, info, outcome)
        candidate_pass = outcome["passes"]["candidate"]
        inlined_engine = BRANCHES_INLINED_FOR_TRT if specialized and "trt" in (kind, also) else None
        result.notices = [n for n in [notice, *describe_groups(groups, len(samples)), inlined_engine, *transformed.warnings, *candidate_pass["notices"], verification_notice] if n]
        result.candidate_models = [r.candidate_model for r in runs]
        result.branches = [{"samples": g.samples, "taken": g.taken} for g in groups if g.taken]
        if folder.final is not None:
            saved = folder.final / INPUTS_FILE if (folder.path / INPUTS_FILE).exists() else inputs  # a dataset stays where it is
            options = {"candidate": candidate, "inputs": saved, "calib_data": calib_data, "seed": seed, "keep_fp32": keep_fp32, "autokeep": autokeep,
                       "atol": atol, "rtol": rtol, "stol": stol, "max_memory": max_memory, "workers": workers, "ray": ray, "trt": trt}
            extra = ["--no-isolate"] * (not isolate) + ["--no-verify"] * (not verify) + (["--also", also] if also else [])
            extra += ["--verify-budget", str(verify_budget)] if verify and verify_budget != DEFAULT_BUDGET else []
            result.replay = ["accudiff", "compare", *run_arguments(model, precision, options), *extra]
        result.timings = step.laps  # the same dict: the report sees every phase before its own
        if report_dir is not None:
            from accudiff.report.writer import write_report

            write_report(result, folder, samples)
        result.report_dir = folder.commit()
        step.lap("report")
    except BaseException:
        folder.discard()
        raise
    finally:
        discard_spares()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


@dataclass
class _GroupSettings:
    """What every branch group's comparison shares (see compare)."""

    precision: str
    kind: str
    also: str | None
    trt: TrtOptions
    keep_fp32: Iterable[str]
    autokeep: bool
    seed: int
    isolate: bool
    tolerances: Tolerances
    max_memory: int | str | None
    workers: int | None
    ray: str | None
    reference_cache: ReferenceCache | None
    folder: ReportFolder
    scratch: Path
    layer_report: bool
    stopwatch: _Stopwatch


@dataclass
class _GroupRun:
    """One group's comparison: its tensor inventory, how its candidate was made, and the merged statistics."""

    info: ModelInfo
    transformed: TransformResult
    outcome: dict
    candidate_model: str


def _compare_group(
    run: _GroupSettings, info: ModelInfo, samples: Samples, indices: list[int], candidate_name: str, progress, calibration: Samples | str | Path | None
) -> _GroupRun:
    """Transform `info`'s model (INT8: calibrated on `calibration`), and compare it on the samples
    `indices` in worker processes or Ray tasks."""
    first = samples[indices[0]]
    shapes = {spec.name: first[spec.name].shape for spec in info.inputs}
    segments = _segments(info, shapes, run.max_memory, single="trt" in (run.kind, run.also))  # one engine: the one that ships
    recipe = CandidateRecipe(run.precision, tuple(run.keep_fp32), run.autokeep, calibration, run.seed, run.trt.engine)
    transformed = transform_model(info, recipe, first, run.scratch)
    candidate_path = run.folder.path / candidate_name
    save_model(transformed.model, candidate_path)
    passes = [{"name": "candidate", "model": str(candidate_path), "backend": run.kind, "fed_from_reference": {}, "layer_report": True}]
    if run.also is not None and run.also != run.kind:  # the same model on a second backend: the model's own error next to what a build adds
        passes.append({"name": run.also, "model": str(candidate_path), "backend": run.also, "fed_from_reference": {}})
    if run.isolate:
        types = {t.name: onnx.helper.np_dtype_to_tensor_dtype(t.dtype) for t in info.tensors if t.dtype is not None}
        fed = isolate_in_place(transformed.model, types, transformed.storage_copies)
        isolated = run.scratch / f"isolated-{candidate_path.stem}.onnx"
        save_model(transformed.model, isolated)
        passes.append({"name": "isolated", "model": str(isolated), "backend": run.kind, "fed_from_reference": fed})
    # From here on the workers read files and the table needs only the tensor inventory: free the
    # weights before any backend loads a model, so at most one copy of them is in memory at a time.
    transformed.model = info.proto = onnx.ModelProto()
    return_freed_memory()
    run.stopwatch.lap("transform")
    entries = [samples.as_json()[i] for i in indices]
    specialized = info.path.parent == run.scratch  # a model specialized for these samples' branches lives only for this call
    store = run.reference_cache.store(info.path, samples, [t.name for t in info.tensors]) if run.reference_cache is not None and not specialized else None
    job = _job(info, samples, segments, run.precision, passes, run.tolerances, transformed.quant_ranges, run.scratch / candidate_path.stem, store)
    job = replace(
        job,
        trt={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run.trt).items()},
        input_shapes={name: list(shape) for name, shape in shapes.items()},
        shape_values={name: first[name].reshape(-1).tolist() for name in shapes if _could_be_a_shape(first[name])},
        layer_report=str(run.folder.path / ENGINE_LAYERS_FILE) if run.layer_report else None,
    )
    outcome = run_shards(job, entries, run.workers, run.ray, progress, indices)
    if store is not None:
        store.finish()
    run.stopwatch.lap("run")
    return _GroupRun(info, transformed, outcome, candidate_name)


def _could_be_a_shape(value: np.ndarray) -> bool:
    """An integer scalar or short vector: what TensorRT may read as a shape (its shapes have at most 8 dims)."""
    return np.issubdtype(value.dtype, np.integer) and value.ndim <= 1 and value.size <= 8


def calibration_per_group(info: ModelInfo, groups: Sequence[BranchGroup], calib_data, scratch: Path) -> dict[int, Samples]:
    """For a model specialized per branch group and calibrated on `calib_data`: each group's calibration
    samples are those that take its branches (a specialized model computes only those)."""
    if calib_data is None or not any(group.taken for group in groups):
        return {}
    calibration = samples_from_path(calib_data, info.inputs, "calibration file", scratch)
    by_branches = {tuple(sorted(g.taken.items())): g.samples for g in branch_groups(info.proto, calibration)}
    chosen = {}
    for k, group in enumerate(groups):
        indices = by_branches.get(tuple(sorted(group.taken.items())))
        if indices is None:
            taken = ", ".join(f"If '{node}' its {branch}" for node, branch in list(group.taken.items())[:3])
            raise AccudiffError(
                f"no calibration sample takes the branches that sample(s) {', '.join(map(str, group.samples[:5]))} take ({taken}): add such samples to --calib-data"
            )
        chosen[k] = calibration.subset(indices)
    return chosen


def _specialized(group: BranchGroup, path: Path) -> ModelInfo:
    """The inventory of a group's specialized model, saved at `path` for the workers."""
    save_model(group.model, path)
    return describe(path, group.model)


def _combine(model: Path, runs: Sequence[_GroupRun]) -> tuple[ModelInfo, TransformResult, dict]:
    """One inventory, one account of the transform and one result from the branch groups' runs (with a
    single group: that group's, under the model's own path)."""
    if len(runs) == 1:
        outcome = runs[0].outcome
        tensors = [t.name for t in runs[0].info.tensors]
    else:
        tensors, outcome = merge_group_results([([t.name for t in r.info.tensors], r.outcome) for r in runs])
    by_name = {t.name: t for r in reversed(runs) for t in r.info.tensors}
    upstream: dict[str, list[str]] = {}
    for r in runs:
        for name, reads in r.info.upstream.items():
            upstream[name] = list(dict.fromkeys([*upstream.get(name, []), *reads]))
    first = runs[0].info
    info = ModelInfo(
        Path(model), onnx.ModelProto(), first.inputs, first.output_names, [by_name[name] for name in tensors], upstream,
        {name: why for r in runs for name, why in r.info.not_observable.items() if name not in by_name},
        {name: node for r in runs for name, node in r.info.nodes.items()},
        {name: text for r in runs for name, text in r.info.weights.items()},
    )
    transforms = [r.transformed for r in runs]
    transformed = TransformResult(
        model=onnx.ModelProto(),
        precision=transforms[0].precision,
        kept=list({k.node: k for t in transforms for k in t.kept}.values()),
        converted=set().union(*(t.converted for t in transforms)),
        quant_ranges={name: q for t in reversed(transforms) for name, q in t.quant_ranges.items()},
        warnings=list(dict.fromkeys(w for t in transforms for w in t.warnings)),
        constant_overflows={node: text for t in transforms for node, text in t.constant_overflows.items()},
    )
    return info, transformed, outcome


def _job(info: ModelInfo, samples: Samples, segments, precision: str, passes: list[dict], tolerances: Tolerances, quant_ranges, scratch: Path, store) -> Job:
    """The worker job for these samples (sharding fills in each worker's part)."""
    return Job(
        reference=str(info.path),
        passes=passes,
        precision=precision,
        tensors=[t.name for t in info.tensors],
        outputs=info.output_names,
        segments=segments,
        tolerances=tolerances.as_dict(),
        quant_ranges={name: [q.scale, q.low, q.high] for name, q in quant_ranges.items()},
        samples=samples.as_json(),
        sample_indices=list(range(len(samples))),
        result=str(scratch / "result"),
        store=str(store.folder) if store is not None else None,
        inputs=[spec.name for spec in info.inputs if np.issubdtype(spec.dtype, np.floating)],
        input_specs=[[spec.name, str(spec.dtype), list(spec.shape)] for spec in info.inputs],
    )


def record_reference(info: ModelInfo, samples: Samples, cache: ReferenceCache, max_memory=None) -> ReferenceStore:
    """The reference's outputs for `samples`, recorded in `cache` (run now unless recorded before)."""
    store = cache.store(info.path, samples, [t.name for t in info.tensors])
    if not store.complete:
        with tempfile.TemporaryDirectory(prefix="accudiff-reference-") as scratch:
            shapes = {spec.name: samples[0][spec.name].shape for spec in info.inputs}
            segments = _segments(info, shapes, max_memory, single=False)
            run_shards(_job(info, samples, segments, "fp32", [], Tolerances.build("fp32"), {}, Path(scratch), store), samples.as_json())
        store.finish()
    return store


def _segments(info: ModelInfo, shapes, max_memory, single: bool) -> list[list[str]]:
    """The node names of each segment the comparison runs at a time (one, when everything fits)."""
    names = [node.name for node in info.proto.graph.node]
    if single:
        return [names]
    budget = memory_budget(max_memory)
    plan = plan_segments(info, tensor_sizes(info, shapes), budget // SEGMENTS_PER_BUDGET)
    return [[names[i] for i in segment.nodes] for segment in plan]


class _Stopwatch:
    """Seconds spent in each phase, reported in the summary (speed is a feature: it is measured)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Time since the last lap goes to `phase` (added up, for phases that recur: one per branch group)."""
        now = time.perf_counter()
        self.laps[phase] = round(self.laps.get(phase, 0.0) + now - self._last, 4)
        self._last = now


def prepare_samples(
    info: ModelInfo, inputs=None, input_shapes=(), seed: int = 0, val_range=(), iterations: int = 1, path: Path | None = None
) -> Samples:
    """The samples `compare` uses: loaded (a file or a folder of files, read one at a time), given (a list of
    feeds), or generated from seed and ranges; given and generated feeds are written to `path`."""
    if isinstance(inputs, Samples):
        return inputs
    if isinstance(inputs, (str, Path)):
        return samples_from_path(inputs, info.inputs, "input file", path.parent if path is not None else None)
    if inputs is not None:
        feeds = [dict(feed) for feed in inputs]
        validate_feeds(feeds, info.inputs, "the given inputs")
    else:
        shapes = input_shapes if isinstance(input_shapes, dict) else parse_input_shapes(input_shapes)
        resolved = resolve_shapes(info.inputs, shapes)
        feeds = generate_feeds(info.inputs, resolved, seed, parse_val_ranges(val_range), iterations)
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="accudiff-inputs-")) / INPUTS_FILE
    return samples_from_feeds(feeds, path, info.inputs)


def _judge(info, precision, outcome: dict, tolerances, transformed, isolate: bool, also, seed, samples: Samples) -> CompareResult:
    """Tables from the worker's statistics; verdict from the graph outputs; the first failing tensor, and
    the failing outputs with their causes."""
    def table_of(name: str) -> pd.DataFrame:
        result = outcome["passes"][name]
        seen = {int(k): v for k, v in result["seen"].items()}
        notes = {int(k): v for k, v in result["notes"].items()}
        return build_table(info.tensors, StatsSet.from_arrays(result), seen, notes, tolerances, transformed.quant_ranges)

    table = table_of("candidate")
    if isolate:
        table = with_side_run(table, table_of("isolated"), "isolated")
    if also is not None and also in outcome["passes"]:
        table = with_side_run(table, table_of(also), also)
    float_inputs = [spec for spec in info.inputs if np.issubdtype(spec.dtype, np.floating)]
    context = DiagnosisContext(
        precision,
        info.upstream,
        frozenset(transformed.converted),
        {k.node: k.reason for k in transformed.kept},
        transformed.constant_overflows,
        graph_input_table(float_inputs, StatsSet.from_arrays(outcome["inputs"]), transformed.quant_ranges),
    )
    indexed = table.set_index("tensor", drop=False)
    failing = table.loc[table["status"] == STATUS_FAIL, "tensor"].tolist()

    def output_failure(name: str) -> TensorFailure:
        row = indexed.loc[name]
        upstream = ancestor_tensors(name, info.upstream)
        first = next(t for t in failing if t in upstream)
        return TensorFailure(name, row["node"], row["op_type"], diagnose(name, indexed, context), first, find_cause(name, indexed, context))

    first_failure = None
    if failing:
        row = indexed.loc[failing[0]]
        first_failure = TensorFailure(failing[0], row["node"], row["op_type"], diagnose(failing[0], indexed, context))
    failing_outputs = table.loc[(table["status"] == STATUS_FAIL) & table["is_output"], "tensor"].tolist()
    observed_outputs = table.loc[(table["status"] != STATUS_MISSING) & table["is_output"], "tensor"].tolist()
    candidate_pass = outcome["passes"]["candidate"]
    not_observable = {**info.not_observable, **outcome["reference_not_observable"], **candidate_pass["not_observable"]}
    result = CompareResult(
        model=info.path,
        precision=precision,
        candidate=candidate_pass["label"],
        table=table,
        passed=False,
        first_failure=first_failure,
        output_failures=[output_failure(name) for name in failing_outputs],
        tolerances=tolerances,
        kept=transformed.kept,
        converted=frozenset(transformed.converted),
        not_observable=not_observable,
        iterations=len(samples),
        seed=seed,
        samples=_sample_table(candidate_pass["outcomes"]),
        inputs=samples.source,
    )
    compared, computed = result.coverage
    result.passed = bool(observed_outputs) and not failing_outputs and compared >= MIN_COVERAGE * computed
    result.points = candidate_pass.get("points", {})
    result.nodes, result.weights = info.nodes, info.weights
    return result, context


def _attach_sketches(result: CompareResult, info: ModelInfo, outcome: dict) -> None:
    """The error sketches the report plots: every failing output's and its cause's."""
    row_of = {t.name: k for k, t in enumerate(info.tensors)}
    shown = {f.tensor for f in result.output_failures} | {f.cause.tensor for f in result.output_failures if f.cause.tensor}
    sketch = np.asarray(outcome["passes"]["candidate"]["sketch"])
    result.error_sketches = {name: sketch[row_of[name]] for name in shown if name in row_of}


MAX_TRIAL_SAMPLES = 8  # verification runs on the worst failing samples, at most this many


def _verify(result: CompareResult, context: DiagnosisContext, run: _GroupSettings, runs: Sequence[_GroupRun], samples: Samples, budget: int) -> str | None:
    """The verify stage: each failing output's suspects tested at the output (diagnosis/verify.py) on the
    worst failing samples; returns a notice when verification could not run."""
    if len(runs) > 1:
        return (f"causes were not verified: the samples take {len(runs)} different combinations of If branches "
                "(compare each group's samples on their own to verify)")
    if run.trt.engine is not None:
        return "causes were not verified: a pre-built engine (--engine) cannot be rebuilt with nodes kept in higher precision"
    group = runs[0]
    failing = result.samples[result.samples["status"] == STATUS_FAIL].sort_values("tol_ratio", ascending=False)
    chosen = list(dict.fromkeys(int(s) for s in failing["sample"]))[:MAX_TRIAL_SAMPLES] or [0]
    info = load_model(group.info.path)
    base = replace(group.transformed, model=onnx.load(str(run.folder.path / group.candidate_model)))
    recipe = CandidateRecipe(run.precision, tuple(run.keep_fp32), run.autokeep, seed=run.seed)
    first = samples[chosen[0]]
    setup = TrialSetup(
        info, CandidateVariants(info, recipe, base=base), samples.subset(chosen), run.tolerances, run.kind, run.scratch / "verify", run.trt,
        {name: first[name].reshape(-1).tolist() for name in first if _could_be_a_shape(first[name])},
    )
    indexed = result.table.set_index("tensor", drop=False)
    trials = Trials(setup, indexed)
    ratios = {f.tensor: float(indexed.loc[f.tensor, "tol_ratio"]) for f in result.output_failures}
    verdicts = verify_causes(ratios, indexed, context, trials, budget, run.tolerances.default.rtol)
    result.output_failures = [
        replace(f, cause=verdicts[f.tensor][0], repair=replace(verdicts[f.tensor][1], samples=chosen)) for f in result.output_failures
    ]
    return None


SAMPLE_COLUMNS = ["sample", "tensor", "status", "max_abs_err", "tol_ratio", "outside_share", "sqnr_db", "rows", "top1", "top5"]


def _sample_table(outcomes: list[dict]) -> pd.DataFrame:
    """One row per sample and graph output, in sample order."""
    table = pd.DataFrame(outcomes, columns=[c for c in SAMPLE_COLUMNS if c != "status"])
    table.insert(2, "status", np.where(table["outside_share"] > 0, STATUS_FAIL, STATUS_PASS))
    return table.sort_values("sample", kind="stable").reset_index(drop=True)
