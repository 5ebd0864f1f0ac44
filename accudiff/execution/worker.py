"""The comparison worker's own side: a child process that runs the engine (engine.py) on a list of samples
(pool.py is the caller's side: it starts workers, hands them jobs and reads their results).

Models run here, never in the caller's process (its stages' probes included: probes.py), so a native crash
(seen in ONNX Runtime on converted models) ends the worker, and the caller reports which step it died in.
The one exception is `--int8` calibration, which ONNX Runtime's quantizer runs where it is called. A worker returns statistics, never
arrays: several workers (or Ray tasks) on different samples give results that merge into one table.

Protocol: the job (a JSON object, see `Job`) on stdin; events on stdout, one JSON object per line:
{"event": "ready", "start_seconds": ...} once, when it has started (how long since the caller started it); then per job {"event": "step", "text": ...}, {"event":
"sample", "done": k, "total": n}, and last {"event": "done"} or {"event": "error", "message": ...}. The
result is written next to the job's `result` path (`WorkerResult.encode`: statistics as .npz, no pickle,
the rest as JSON).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from accudiff.errors import AccudiffError, RunFailed, out_of_space
from accudiff.leftovers import scratch_base
from accudiff.memory import SEPARATE_MAPPINGS_FROM_TENSOR_BYTES, map_large_blocks_separately
from accudiff.execution.pool import SPAWNED_AT
from accudiff.execution.messages import Job, Layout, PassSpec, Probe, ProbedValue, WorkerResult, read_message
from accudiff.runners.reused import ReusedRunners


def _work(job: Job, emit: Callable[[dict], None]) -> None:
    """The worker's side: build the engine, reduce every sample, write the result."""
    from accudiff.execution.engine import Engine
    from accudiff.execution.plans import EngineOptions, Measured, PassPlan, ReferencePlan
    from accudiff.judging.tolerances import Tolerances
    from accudiff.model.decoder import model_name
    from accudiff.model.inputs import fed_shapes
    from accudiff.model.inventory import InputSpec
    from accudiff.model.source import ModelSource
    from accudiff.model.samples import Samples
    from accudiff.runners import CpuOptions, EngineShapes, TrtOptions, candidate_runner, reference_runner
    from accudiff.runners.onnxrt import release_shared_arena, require_loadable
    from accudiff.model.stores import ReferenceStore
    from accudiff.runners.recorded import recorded_runner
    from accudiff.model.formats import QuantRange
    from accudiff.judging.output_kinds import OutputKind
    from accudiff.execution.generation import samples_per_prompt

    for path in job.validate:
        require_loadable(Path(path))
    if len(job.segments) > 1 and job.largest_tensor >= SEPARATE_MAPPINGS_FROM_TENSOR_BYTES:
        # Segments drop their tensors as they go; the memory must leave the process (memory.py). A model run
        # whole holds its tensors at once anyway, and malloc's reuse of freed blocks spares the page faults
        # of fresh mappings (a third of the sessions' time on resnet18).
        map_large_blocks_separately()
    trt = TrtOptions(**{k: (Path(v) if k in ("cache_dir", "engine") and v is not None else v) for k, v in job.trt.items()})
    shapes = EngineShapes({name: tuple(dims) for name, dims in job.input_shapes.items()}, job.shape_values)
    layer_report = Path(job.layer_report) if job.layer_report else None

    threads = job.threads or os.cpu_count() or 1
    # How many runs a session makes: a decoder's prompt runs its prefill and each decode step; only the prefills
    # multiply many rows by each weight, which prepacking speeds (CpuOptions).
    steps = samples_per_prompt(job.generation["new_tokens"]) if job.generation else 1
    runs = job.run_samples or len(job.sample_indices)
    cpu = CpuOptions(threads, samples=runs * steps, wide_runs=runs, shared_arena=job.large_tensors)

    def factory(spec: PassSpec):
        if spec.backend == "recorded":
            return lambda model, outputs: recorded_runner(Path(spec.recorded), job.tensors, outputs, job.sample_indices, spec.label)
        layers = layer_report if spec.layer_report else None
        limit = spec.runs if spec.runs is not None else cpu.samples  # the isolated run compares 8 at most
        pass_cpu = replace(cpu, samples=min(cpu.samples, limit), wide_runs=min(cpu.wide_runs, limit))

        def make(model: ModelSource, outputs: list[str]):
            return candidate_runner(spec.backend, model, outputs, job.precision, trt, shapes, layers, pass_cpu)

        if spec.reuse:
            return lambda model, outputs: _REUSED.get((spec.backend, str(model.path), tuple(outputs), job.precision, pass_cpu), lambda: make(model, outputs))
        return make

    def plan(spec: PassSpec) -> PassPlan:
        record = ReferenceStore(Path(spec.record), job.tensors) if spec.record else None
        fixed = {name: np.asarray(value) for name, value in spec.fixed_inputs.items()}
        return PassPlan(spec.name, Path(spec.model), factory(spec), spec.fed_from_reference, record, fixed, spec.samples)

    per_sample = samples_per_prompt(job.generation["new_tokens"]) if job.generation else 1  # a prompt is a prefill and its decode steps
    if (job.one_session_at_a_time or job.release_reused) and not any(p.reuse for p in job.passes):
        _REUSED.close()  # a switchboard kept from an earlier job would hold its weights beside this job's sessions
    first = min(job.sample_indices, default=0) * per_sample
    passes = [plan(p) for p in job.passes if p.samples is None or first < p.samples]  # a pass none of its samples need has no session
    store = ReferenceStore(Path(job.store), job.tensors) if job.store else None
    with tempfile.TemporaryDirectory(prefix="engine-") as scratch:
        measured = Measured(
            job.tensors,
            job.outputs,
            job.segments,
            Tolerances.from_dict(job.tolerances),
            {name: QuantRange(**fields) for name, fields in job.quant_ranges.items()},
            job.inputs,
            job.thresholds,
            {name: OutputKind(kind, "", axis) for name, (kind, axis) in job.output_kinds.items()},
        )
        outputs_store = ReferenceStore(Path(job.outputs_store), job.outputs) if job.outputs_store else None
        reference = ReferencePlan(Path(job.reference), lambda model, outputs: reference_runner(model, outputs, cpu), store, outputs_store)
        one_at_a_time = job.one_session_at_a_time and not job.generation  # a step's session is the next step's
        options = EngineOptions(threads, keep_sessions=len(job.sample_indices) * per_sample > 1 and not one_at_a_time,
                                progress=lambda text: emit({"event": "step", "text": text}), points=job.points, sessions_at_once=job.sessions_at_once)
        engine = Engine(reference, passes, measured, Path(scratch), options)
        generated: dict[str, list] = {"steps": [], "generations": []}
        try:
            if job.generation:
                from accudiff.execution.generation import generate_prompts

                carrying = [p.name for p in passes if not p.fed_from_reference]
                generated = generate_prompts(engine, job.generation, Samples.from_json(job.samples, "the prompts"), job.sample_indices, carrying,
                                             lambda done, total: emit({"event": "sample", "done": done, "total": total}))
            else:
                specs = [InputSpec(name, np.dtype(dtype), tuple(shape)) for name, dtype, shape in job.input_specs]
                samples = Samples.from_json(job.samples, "the inputs", specs)
                for done, (sample, index) in enumerate(zip(samples, job.sample_indices), 1):
                    try:
                        engine.run_sample(index, sample)
                    except RunFailed as exc:  # said of the model and the sample's inputs, not of a segment the user never made
                        raise AccudiffError(f"'{model_name(Path(job.reference))}' does not run on sample {index} ({fed_shapes(sample, specs)}): "
                                            f"{exc.reason}") from None
                    emit({"event": "sample", "done": done, "total": len(samples)})
        finally:
            engine.close()
            release_shared_arena()  # sessions kept for a later job (`reuse`) keep what they hold
    _write_result(engine, Path(job.result), cpu.threads, generated)


_REUSED = ReusedRunners()


def _probe(probe: Probe) -> None:
    """Run the probe's model on its samples; write each output's `ProbedValue` per sample."""
    from dataclasses import asdict

    from accudiff.model.samples import Samples
    from accudiff.model.source import ModelSource
    from accudiff.runners.onnxrt import OnnxrtRunner

    found = []
    with OnnxrtRunner(ModelSource(Path(probe.model)), outputs=probe.outputs) as runner:
        for sample in Samples.from_json(probe.samples):
            values = {}
            for name, value in runner.infer(sample).items():
                flat = np.asarray(value).reshape(-1)
                finite = flat[np.isfinite(flat)] if np.issubdtype(flat.dtype, np.floating) else flat
                values[name] = asdict(ProbedValue(float(flat[0]) if flat.size else 0.0, float(np.abs(finite).max()) if finite.size else 0.0))
            found.append(values)
    Path(probe.result).write_text(json.dumps(found))


def _write_result(engine, path: Path, threads: int, generated: dict[str, list]) -> None:
    result = WorkerResult(engine.results, engine.input_stats, engine.reference_not_observable, engine.timings, Layout(1, (threads,), engine.sessions_at_once),
                          engine.run_time_ranges, generated["steps"], generated["generations"])
    document, arrays = result.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".npz").write_bytes(arrays)
    path.with_suffix(".json").write_text(document)


def _load_what_every_job_uses() -> None:
    """Imported before the job is read: a worker started ahead (`prestart`) does this while its caller
    still prepares the job. The reference always runs in ONNX Runtime."""
    import onnxruntime  # noqa: F401

    import accudiff.execution.engine  # noqa: F401
    import accudiff.runners.onnxrt  # noqa: F401


def main() -> None:
    """Jobs arrive one per line until the input ends; each ends with one "done", "error" or "bug" event."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol

    def emit(event: dict) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    _load_what_every_job_uses()
    spawned = os.environ.get(SPAWNED_AT)
    emit({"event": "ready", "start_seconds": time.time() - float(spawned) if spawned else None})
    try:
        for line in sys.stdin:
            try:
                message = read_message(line)
                _probe(message) if isinstance(message, Probe) else _work(message, emit)
            except AccudiffError as exc:
                emit({"event": "error", "message": str(exc)})
                return
            except Exception as exc:  # a bug of ours (but a full disk): the traceback goes to stderr, one line to the caller
                # (this process's TMPDIR is a folder of the caller's, in the caller's scratch location)
                if isinstance(exc, OSError) and (full := out_of_space(exc, str(scratch_base()))) is not None:
                    emit({"event": "error", "message": str(full)})
                    return
                traceback.print_exc()
                emit({"event": "bug", "message": f"{type(exc).__name__}: {exc}"})
                return
            emit({"event": "done"})
    finally:
        _REUSED.close()


if __name__ == "__main__":
    main()
