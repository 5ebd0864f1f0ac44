"""One branch group's comparison, as three stages: its candidate made (transform), its segments planned
(plan), and its samples run in worker processes or Ray tasks (run); then one result from the groups'.

A model without Ifs is one group: the model itself, every sample.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import onnx

from accudiff.stages.branches import BranchGroup, merge_group_results
from accudiff.execution.generation import samples_per_prompt
from accudiff.judging.output_kinds import OutputKind, deciding, kinds_of
from accudiff.execution.messages import WorkerResult
from accudiff.execution.probes import largest_values
from accudiff.execution.shards import run_shards
from accudiff.judging.tolerances import Tolerances
from accudiff.verification.trial import MAX_TRIAL_SAMPLES, large_weights
from accudiff.execution.messages import Job, PassSpec
from accudiff.memory import return_freed_memory
from accudiff.model.inventory import ModelInfo, describe
from accudiff.model.loading import remember_model
from accudiff.model.saving import link_model, save_model
from accudiff.model.inputs import Feed
from accudiff.model.prompts import GenerationPlan
from accudiff.model.run_results import Captured, write_run_results
from accudiff.model.samples import Samples
from accudiff.model.source import own_weight_bytes
from accudiff.model.segments import SEGMENTS_PER_BUDGET, memory_budget, plan_segments, tensor_sizes
from accudiff.model.stores import ReferenceCache, ReferenceStore
from accudiff.transforms import TransformResult
from accudiff.transforms.candidate import transform_model
from accudiff.transforms.isolate import isolate_in_place

if TYPE_CHECKING:
    from accudiff.workspace import Workspace
    from accudiff.settings import Compared, Judging, Running

ENGINE_LAYERS_FILE = "engine_layers.json"
# The isolated run tells where error starts, which a few samples show as well as thousands: it runs on a
# group's first samples only, so each further sample of a dataset costs two marked runs and one statistics pass.
ISOLATED_SAMPLES = 8


@dataclass
class Candidate:
    """A group's candidate as the workers run it: its inventory, how it was made, and its passes (the
    candidate; the same model on a second backend; the isolated run, each node fed the reference's values)."""

    info: ModelInfo
    transformed: TransformResult
    path: Path  # the candidate model the workers run (in the scratch folder; the report holds a link to it)
    passes: list[dict]
    record: ReferenceStore | None = None  # where the candidate's tensors are kept, to be saved (--save-candidate)
    kinds: dict[str, OutputKind] = field(default_factory=dict)  # what each graph output decides (read before the model is let go of)


@dataclass
class GroupRun:
    """One group's comparison: its candidate, the merged statistics of its samples, and the reference's
    tensors when they were kept (replayed from a cache or a captured file, or recorded to be saved)."""

    candidate: Candidate
    measured: WorkerResult
    group_samples: list[int]
    reference: ReferenceStore | None = None
    outputs: ReferenceStore | None = None  # the reference's graph outputs, when recorded for verification


def group_model(info: ModelInfo, group: BranchGroup, scratch: Path) -> ModelInfo:
    """The inventory of the model the group runs: `info`'s, or its specialized model's (saved in
    `scratch` for the workers)."""
    if group.taken:
        path = scratch / f"specialized-{group.before}.onnx"
        save_model(group.model, path, move_weights=True)  # its weights then referenced in that file
        info = describe(path, group.model)
    group.model = onnx.ModelProto()  # from here on the inventory holds the model, until its candidate is written
    return info


@dataclass(frozen=True)
class Plan:
    """How a group's comparison runs: the node names of each segment run at a time, and the bytes of its
    largest tensor, which chooses how its workers get memory (memory.py: large tensors make fresh memory
    what a run costs, and small ones let freed memory serve again)."""

    segments: list[list[str]]
    largest_tensor: int = 0


def plan(info: ModelInfo, first: Feed, max_memory: int | str | None, one_segment: bool) -> Plan:
    """The plan stage: segments sized so that the tensors of a segment fit `max_memory` (one segment when
    everything fits, or when asked: a TensorRT engine is compared whole, as it ships)."""
    names = [node.name for node in info.proto.graph.node]
    shapes = {spec.name: first[spec.name].shape for spec in info.inputs}
    sizes = tensor_sizes(info, shapes)
    weights = {init.name for init in info.proto.graph.initializer}  # loaded once by a session, not made by each run
    largest = max((size for name, size in sizes.items() if name not in weights), default=0)
    if one_segment:
        return Plan([names], largest)
    budget = memory_budget(max_memory) // SEGMENTS_PER_BUDGET
    return Plan([[names[i] for i in segment.nodes] for segment in plan_segments(info, sizes, budget)], largest)


def worker_reference(info: ModelInfo, scratch: Path) -> Path:
    """The FP32 model file a worker reads: its graph as loaded (types inferred), saved in `scratch` with its
    weights referred to where they are (save_model's `in_place`), so the worker reads a graph, not the
    weights again (MiniLM: 0.2 MB for 69 MB), and cuts segments without inferring types; the model's own
    file where its graph was not kept."""
    light = info.remembered
    if light is None:
        return info.path
    target = scratch / "reference" / info.path.name  # under its own name: the worker's messages name the model
    target.parent.mkdir(parents=True, exist_ok=True)
    save_model(light, target, in_place=True)
    return target


# Weights let go of are given back to the system past this (a collection and a trim: 0.03 s); less than
# this, malloc serves them again to what the caller does next.
RETURN_FREED_FROM_BYTES = 256 << 20


def make_candidate(
    info: ModelInfo, group: BranchGroup, samples: Samples, compared: Compared, judging: Judging, isolate: bool, path: Path, scratch: Path,
    captured: Captured, record: bool = False,
) -> Candidate:
    """The transform stage: the group's candidate (INT8: calibrated on its samples) saved once, in
    `scratch/models`, and put in the report at `path` (a hard link, or a copy across file systems); its
    isolated twin beside it, sharing its data file. The weights are let go of as they are written, before
    any backend loads a model, so at most one copy of them is in memory at a time (from here on the
    workers read files). A candidate captured elsewhere is replayed from its store instead of run; `record`:
    the candidate's tensors are kept to be saved (--save-candidate)."""
    remember_model(info)  # verification reads it again
    kinds = kinds_of(info, judging.output_kinds)
    transformed = transform_model(info, compared.recipe_for(group.calibration), samples.subset(group.samples), largest_values, scratch)
    working = scratch / "models" / path.name
    working.parent.mkdir(exist_ok=True)
    save_model(transformed.model, working, move_weights=True)
    link_model(working, path)
    kind = compared.backend
    if captured.candidate is not None:
        label = f"polygraphy runner '{captured.candidate.runner}' ({captured.candidate.file.name}), captured elsewhere"
        candidate = {"model": str(info.path), "recorded": str(captured.candidate.store.folder), "label": label}
    else:
        candidate = {"model": str(working), "layer_report": True}
    record = ReferenceStore(scratch / f"record-{path.stem}", [t.name for t in info.tensors]) if record else None
    passes = [PassSpec("candidate", backend=kind, record=str(record.folder) if record else None, **candidate)]
    if compared.also is not None and compared.also != kind:  # the model's own error next to what a build adds
        passes.append(PassSpec(compared.also, str(working), compared.also))
    if isolate:
        # every compared tensor the candidate has a partner for (a value of the same name that is another value is not fed)
        types = {t.name: onnx.helper.np_dtype_to_tensor_dtype(t.dtype) for t in info.tensors if t.dtype is not None and t.name not in transformed.unmatched}
        fed = isolate_in_place(transformed.model, types, transformed.storage_copies)
        isolated = working.with_name(f"isolated-{path.stem}.onnx")
        save_model(transformed.model, isolated)  # its graph: the weights are the candidate's, in the same folder
        up_to = group.samples[ISOLATED_SAMPLES] if len(group.samples) > ISOLATED_SAMPLES else None  # the group's first ones
        runs = min(len(group.samples), ISOLATED_SAMPLES)  # how its sessions are made (worker.Job)
        passes.append(PassSpec("isolated", str(isolated), kind, fed_from_reference=fed, samples=up_to, runs=runs))
    freed = own_weight_bytes(info.proto)
    transformed.model = info.proto = onnx.ModelProto()
    if freed > RETURN_FREED_FROM_BYTES:
        return_freed_memory()
    return Candidate(info, transformed, working, passes, record, kinds)


def run_group(
    candidate: Candidate, plan: Plan, group: BranchGroup, samples: Samples, compared: Compared, judging: Judging, running: Running, verify: bool,
    where: Workspace, captured: Captured, generation: GenerationPlan | None = None, record_reference: bool = False,
) -> GroupRun:
    """The run stage: the group's samples through the reference and the candidate's passes, in worker
    processes or Ray tasks, their statistics merged. The reference is replayed from a captured file or
    the reference cache, or recorded there (or kept to be saved: `record_reference`) as it runs. With a
    decoder's `generation`, each sample is a prompt generated from (execution/generation.py); with `verify`,
    the outputs of a few samples are kept for verification to replay."""
    info, first = candidate.info, samples[group.samples[0]]
    specialized = info.path.parent == where.scratch  # a model specialized for these samples' branches lives only for this call
    cache, tensors = where.reference_cache, [t.name for t in info.tensors]
    if generation is not None:  # each step's feed depends on the last: nothing to replay
        store = None
    elif captured.reference is not None:
        store = ReferenceStore(captured.reference.store.folder, tensors)
    elif cache is not None and not specialized:
        store = cache.store(info.path, samples, tensors)
    else:
        store = ReferenceStore(where.scratch / f"reference-{candidate.path.stem}", tensors) if record_reference else None
    job = job_for(info, samples, plan.segments, compared.precision, judging.tolerances, where.scratch / candidate.path.stem, store)
    job = replace(
        job,
        largest_tensor=plan.largest_tensor,
        reference=str(worker_reference(info, where.scratch)),
        passes=candidate.passes,
        quant_ranges=quant_ranges_json(candidate.transformed),
        trt=compared.trt.as_json(),
        input_shapes={spec.name: list(first[spec.name].shape) for spec in info.inputs},
        shape_values={name: first[name].reshape(-1).tolist() for name in first if could_be_a_shape(first[name])},
        layer_report=str(where.folder.path / ENGINE_LAYERS_FILE) if where.folder.final is not None else None,
        thresholds=judging.thresholds,
        output_kinds={name: kind.as_json() for name, kind in candidate.kinds.items()},
        validate=[str(compared.candidate_model)] if compared.candidate_model is not None else [],
    )
    if generation is not None:  # the workers read the prompts; each step of a prompt is a sample of the engine, the isolated run takes the first
        steps = len(group.samples) * samples_per_prompt(generation.new_tokens)
        passes = [replace(p, samples=ISOLATED_SAMPLES if steps > ISOLATED_SAMPLES else None, runs=min(steps, ISOLATED_SAMPLES)) if p.name == "isolated" else p
                  for p in job.passes]
        job = replace(job, passes=passes, generation=generation.as_json())
    outputs = None
    # Few enough to keep: verification replays them (a decoder's steps only where its trials replay them: large weights).
    if verify and len(group.samples) <= MAX_TRIAL_SAMPLES and (generation is None or large_weights(info)):
        outputs = ReferenceStore(where.scratch / f"outputs-{candidate.path.stem}", deciding(info.output_names, candidate.kinds))
        job = replace(job, outputs_store=str(outputs.folder))
    progress = where.progress_from(group.before, len(samples))
    entries = [(generation.prompts if generation is not None else samples).as_json()[i] for i in group.samples]
    # Verification's trials (one group only, no pre-built engine: see verify.py) would run in these workers, already warm.
    warm = verify and compared.trt.engine is None and group.samples == list(range(len(samples)))
    measured = run_shards(job, entries, running.workers, running.ray, progress, group.samples, warm)
    for recorded in (store, outputs):
        if recorded is not None:
            recorded.finish()
    return GroupRun(candidate, measured, group.samples, store, outputs)


def save_tensors(save_reference: Path | None, save_candidate: Path | None, compared: Compared, runs: Sequence[GroupRun], samples: int) -> None:
    """--save-reference / --save-candidate: the tensors kept during the runs written as polygraphy
    RunResults, every sample in order (each from the branch group that compared it)."""
    for path, runner, stores in (
        (save_reference, "accudiff-reference-onnxrt-fp32", [r.reference for r in runs]),
        (save_candidate, f"accudiff-candidate-{compared.backend}-{compared.precision}", [r.candidate.record for r in runs]),
    ):
        if path is None:
            continue
        group_of = {sample: k for k, r in enumerate(runs) for sample in r.group_samples}
        tensors = [[t.name for t in r.candidate.info.tensors] for r in runs]
        iterations = (stores[group_of[s]].read(s, tensors[group_of[s]]) for s in range(samples))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_run_results(Path(path), runner, iterations)


def isolation_notice(isolate: bool, groups: Sequence[BranchGroup], generation: GenerationPlan | None = None) -> str | None:
    """What a reader must know when the isolated run skipped samples (see ISOLATED_SAMPLES)."""
    if isolate and generation is not None and sum(len(g.samples) for g in groups) * samples_per_prompt(generation.new_tokens) > ISOLATED_SAMPLES:
        return (f"the isolated run (each node's error when fed the reference's values) ran on the first {ISOLATED_SAMPLES} steps of the first "
                "prompt's generation (its prefill first); every other figure covers every step of every prompt")
    if not isolate or all(len(g.samples) <= ISOLATED_SAMPLES for g in groups):
        return None
    where = "of each branch group's samples" if len(groups) > 1 else f"of the {len(groups[0].samples)} samples"
    return f"the isolated run (each node's error when fed the reference's values) ran on the first {ISOLATED_SAMPLES} {where}; every other figure covers them all"


def could_be_a_shape(value: np.ndarray) -> bool:
    """An integer scalar or short vector: what TensorRT may read as a shape (its shapes have at most 8 dims)."""
    return np.issubdtype(value.dtype, np.integer) and value.ndim <= 1 and value.size <= 8


def combine(model: Path, runs: Sequence[GroupRun]) -> tuple[ModelInfo, TransformResult, WorkerResult]:
    """One inventory, one account of the transform and one result from the branch groups' runs (with a
    single group: that group's, under the model's own path)."""
    infos = [r.candidate.info for r in runs]
    if len(runs) == 1:
        measured = runs[0].measured
        tensors = [t.name for t in infos[0].tensors]
    else:
        tensors, measured = merge_group_results([([t.name for t in info.tensors], r.measured) for info, r in zip(infos, runs)])
    by_name = {t.name: t for info in reversed(infos) for t in info.tensors}
    upstream: dict[str, list[str]] = {}
    for each in infos:  # a node reading one value twice (x * x) keeps both reads: that makes it a square
        for name, reads in each.upstream.items():
            upstream[name] = [*upstream[name], *(r for r in reads if r not in upstream[name])] if name in upstream else list(reads)
    info = ModelInfo(
        Path(model), onnx.ModelProto(), infos[0].inputs, infos[0].output_names, [by_name[name] for name in tensors], upstream,
        {name: why for each in infos for name, why in each.not_observable.items() if name not in by_name},
        {name: node for each in infos for name, node in each.nodes.items()},
        {name: text for each in infos for name, text in each.weights.items()},
    )
    transforms = [r.candidate.transformed for r in runs]
    transformed = TransformResult(
        model=onnx.ModelProto(),
        precision=transforms[0].precision,
        kept=list({k.node: k for t in transforms for k in t.kept}.values()),
        converted=set().union(*(t.converted for t in transforms)),
        quant_ranges={name: q for t in reversed(transforms) for name, q in t.quant_ranges.items()},
        warnings=list(dict.fromkeys(w for t in transforms for w in t.warnings)),
        constant_findings={node: found for t in transforms for node, found in t.constant_findings.items()},
        unmatched={name: why for t in transforms for name, why in t.unmatched.items()},
        inside={name: node for t in transforms for name, node in t.inside.items()},
        weight_findings={node: text for t in transforms for node, text in t.weight_findings.items()},
        quantized_by={node: tool for t in transforms for node, tool in t.quantized_by.items()},
        reads_constant_weights=set().union(*(t.reads_constant_weights for t in transforms)),
    )
    return info, transformed, measured


def quant_ranges_json(transformed: TransformResult) -> dict[str, dict]:
    return {name: asdict(q) for name, q in transformed.quant_ranges.items()}


def job_for(info: ModelInfo, samples: Samples, segments, precision: str, tolerances: Tolerances, scratch: Path, store: ReferenceStore | None) -> Job:
    """The worker job for these samples, reference only (sharding fills in each worker's part; a
    comparison adds its passes)."""
    return Job(
        reference=str(info.path),
        passes=[],
        precision=precision,
        tensors=[t.name for t in info.tensors],
        outputs=info.output_names,
        segments=segments,
        tolerances=tolerances.as_dict(),
        quant_ranges={},
        samples=samples.as_json(),
        sample_indices=list(range(len(samples))),
        result=str(scratch / "result"),
        store=str(store.folder) if store is not None else None,
        inputs=[spec.name for spec in info.inputs if np.issubdtype(spec.dtype, np.floating)],
        input_specs=[[spec.name, str(spec.dtype), list(spec.shape)] for spec in info.inputs],
    )


def record_reference(info: ModelInfo, samples: Samples, cache: ReferenceCache, max_memory: int | str | None = None) -> ReferenceStore:
    """The reference's outputs for `samples`, recorded in `cache` (run now unless recorded before)."""
    store = cache.store(info.path, samples, [t.name for t in info.tensors])
    if not store.complete:
        with tempfile.TemporaryDirectory(prefix="accudiff-reference-") as scratch:
            planned = plan(info, samples[0], max_memory, one_segment=False)
            job = job_for(info, samples, planned.segments, "fp32", Tolerances.build("fp32"), Path(scratch), store)
            run_shards(replace(job, largest_tensor=planned.largest_tensor), samples.as_json())
        store.finish()
    return store
