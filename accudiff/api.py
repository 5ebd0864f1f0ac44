"""`accudiff.compare`: the main job, as a Python function, in named stages. The CLI and the pytest plugin
call this; each stage is a function in the module that owns it:

    load      model/loading.py       the model's inventory; the settings checked against it
              (transforms/float_form.py: a model that is its own candidate gets its float form as reference;
              transforms/opset.py: a model below the opset its formats need is compared at that opset)
    samples   model/samples.py       inputs loaded, given or generated
    groups    stages/branches.py samples grouped by the If branches they take
    captured  model/run_results.py   tensors captured elsewhere (polygraphy's RunResults), read into stores
    plan      stages/group.py    segments whose tensors fit the memory budget
    transform stages/group.py    the candidate (and its isolated twin) made and saved
    run       stages/group.py    reference and candidate runs in workers, statistics merged
              (save_tensors: the tensors kept, written as RunResults when asked)
    judge     stages/judge.py     table, verdict, the rules' cause of each failing output
    verify    verification/verify.py    each cause tested at the output: kept in higher precision, rerun
    report    report/writer.py       the report folder, written whole or not at all
"""

from __future__ import annotations

import importlib
import shutil
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from accudiff.stages.branches import describe_groups, plan_groups
from accudiff.stages.group import combine, group_model, isolation_notice, make_candidate, plan, run_group, save_tensors
from accudiff.execution.pool import prestart
from accudiff.errors import AccudiffError
from accudiff.execution.shards import default_workers
from accudiff.model.loading import load_model
from accudiff.model.run_results import read_captured
from accudiff.model.prompts import prepare_generation
from accudiff.model.samples import Samples, prepare_samples
from accudiff.report.content import CANDIDATE_MODEL_FILE, INPUTS_FILE, PROMPTS_FILE
from accudiff.atomic import ReportFolder, new_folder
from accudiff.runners import TrtOptions
from accudiff.model.stores import ReferenceCache
from accudiff.transforms.float_form import float_reference
from accudiff.transforms.opset import at_forms_opset
from accudiff.settings import RunSettings, settings_of
from accudiff.workspace import Progress, Workspace, workspace

if TYPE_CHECKING:
    from accudiff.result import CompareResult, TensorFailure

__all__ = ["CompareResult", "RunSettings", "TensorFailure", "TrtOptions", "compare", "run"]

BRANCHES_INLINED_FOR_TRT = ("the TensorRT engine is built from the model with its taken branches inlined, so its tensors can be marked; "
                            "the shipped engine, with conditional layers, may fuse and round differently around them")


def compare(model: str | Path, precision: str = "fp32", *, progress: Progress | None = None, reference_cache: ReferenceCache | None = None,
            **options) -> CompareResult:
    """Compare every tensor of `model` run in FP32 (reference) against the `precision` candidate.

    `options` are the fields of `RunSettings` (inputs, tolerances, keep-list, report folder, budgets...).
    `progress(phase, samples done, samples in all)` is told how far the runs got; a `reference_cache`
    shared between calls runs each model's reference only once per set of inputs.
    Raises AccudiffError (one sentence, naming these keyword arguments) for any problem with the inputs.
    """
    try:
        return run(settings_of(model, precision, options), progress, reference_cache)
    except AccudiffError as exc:  # said in the caller's words, and once: what led to it is no news to a caller
        from accudiff.options import python_words

        raise AccudiffError(python_words(str(exc))) from None


def run(
    settings: RunSettings, progress: Progress | None = None, reference_cache: ReferenceCache | None = None, import_seconds: float | None = None
) -> CompareResult:
    """`compare`, stage by stage (see the module's docstring for where each lives). `import_seconds`: what
    importing the pipeline took the caller (the command line), reported first among the timings."""
    laps = _Stopwatch({"import": round(import_seconds, 4)} if import_seconds is not None else {})
    _, chosen_backend = settings.backend  # an unusable backend is an error before anything is loaded
    info = load_model(settings.model)
    settings.check_against(info)
    with workspace(settings.report_dir, progress, reference_cache) as where:
        if settings.ray is None:
            prestart()  # the first worker starts while the samples are read and the candidate is built
        reference_notices = []
        if settings.given_alone:  # the model is its own candidate: the reference is its float form
            info, reference_notices = float_reference(info, where.scratch)
        info, upgraded = at_forms_opset(info, settings.precision, where.scratch)  # an old opset has no BF16 Conv
        reference_notices += upgraded
        generation = None
        if settings.prompts is not None:  # a decoder generating from prompts: a sample is a prompt's prefill
            generation = prepare_generation(info, settings.prompts, settings.decode_steps, where.folder.path / PROMPTS_FILE, where.scratch,
                                            Path(settings.candidate_model) if settings.candidate_model is not None else None)
            samples = generation.prefills
        else:
            samples = prepare_samples(info, settings.inputs, where.folder.path / INPUTS_FILE, input_shapes=settings.input_shapes, iterations=settings.iterations,
                                      seed=settings.seed, val_range=settings.val_range)
        if settings.ray is None:
            prestart(min(settings.workers or default_workers(len(samples)), len(samples)))  # a dataset's other workers start now too
        compared, judging, diagnosing, captures = settings.compared, settings.judging, settings.diagnosing, settings.captures
        groups = plan_groups(info, samples, compared.recipe, where.scratch)
        laps.lap("load")
        captured = read_captured([t.name for t in info.tensors], settings.load_candidate, settings.load_reference, settings.candidate_runner, len(samples), where.scratch)
        laps.lap("captured")
        runs = []
        # The diagnosis (and pandas, ~0.35 s to import) is imported while this thread waits for the first
        # group's workers: started before the plan, it held the GIL against the plan and the transform (on
        # the recognizer 0.57 -> 0.39 s for the two, medians of 18 interleaved runs).
        diagnosis_import = threading.Thread(target=_import_diagnosis, daemon=True)
        for k, group in enumerate(groups):
            group_info = group_model(info, group, where.scratch)
            planned = plan(group_info, samples[group.samples[0]], settings.max_memory, settings.uses_trt)
            laps.lap("plan")
            name = CANDIDATE_MODEL_FILE.format(precision=settings.precision, group="" if len(groups) == 1 else f"-group{k}")
            candidate = make_candidate(group_info, group, samples, compared, judging, diagnosing.isolate, where.folder.path / name, where.scratch, captured,
                                       record=captures.save_candidate is not None)
            laps.lap("transform")
            if k == 0:
                diagnosis_import.start()
            runs.append(run_group(candidate, planned, group, samples, compared, judging, settings.running, diagnosing.verify, where, captured, generation,
                                  record_reference=captures.save_reference is not None))
            laps.lap("run")
        save_tensors(captures.save_reference, captures.save_candidate, compared, runs, len(samples))
        from accudiff.stages.judge import attach_sketches, judge, side_run_notices
        from accudiff.verification.verify import verify_outputs

        info, transformed, measured = combine(info.path, runs)
        result, context = judge(info, transformed, measured, compared, judging, diagnosing.isolate, samples, runs[0].candidate.kinds)
        result.settings, result.seed = settings, settings.seed if settings.inputs is None else None  # what was asked: the commands a report prints
        result.worker_timings["comparison"], result.layout = measured.timings, {"workers": measured.layout.workers, "threads": list(measured.layout.threads),
                                                                             "sessions_at_once": measured.layout.sessions_at_once}
        laps.lap("diagnose")
        unverified = []
        if settings.verify and result.output_failures:
            report = where.folder.path if where.folder.final is not None else None
            unverified = verify_outputs(result, context, compared, judging, diagnosing, runs, samples, where.scratch, report, settings.ray, generation)
            laps.lap("verify")
        attach_sketches(result, info, measured)
        inlined_engine = BRANCHES_INLINED_FOR_TRT if any(g.taken for g in groups) and settings.uses_trt else None
        notices = [*reference_notices, *captured.notices, *describe_groups(groups, len(samples)), inlined_engine, isolation_notice(diagnosing.isolate, groups, generation),
                   *side_run_notices(result.table),
                   *transformed.warnings, *measured.passes["candidate"].notices]
        result.notices = [n for n in [chosen_backend, *notices, *unverified] if n]
        result.candidate_models = [r.candidate.path.name for r in runs]
        result.branches = [{"samples": g.samples, "taken": g.taken} for g in groups if g.taken]
        _report(result, settings, where, samples, laps)
    return result


def _report(result: CompareResult, settings: RunSettings, where: Workspace, samples: Samples, laps: _Stopwatch) -> None:
    """The report stage: the timings, and the report folder written and put in place; without one asked
    for, what it needs is kept until the result writes it (`CompareResult.write_report`) or is dropped."""
    folder = where.folder
    result.timings = laps.laps  # the same dict: the report sees every phase before its own
    if folder.final is None:
        weakref.finalize(result, folder.discard)
        result.report_writer = lambda path: _write_later(result, settings, folder, samples, path)
    else:
        _write(result, settings, folder, samples, folder.final)
        result.report_dir = folder.commit()
    laps.lap("report")


def _write(result: CompareResult, settings: RunSettings, folder: ReportFolder, samples: Samples, final: Path) -> None:
    """The report's files, written in `folder`'s staging folder, which becomes `final`: the settings as saved
    there (the inputs and prompts it holds: the commands it prints run them again)."""
    from accudiff.report.writer import write_report

    saved = final / INPUTS_FILE if (folder.path / INPUTS_FILE).exists() else settings.inputs  # a dataset stays where it is
    prompts = final / PROMPTS_FILE if (folder.path / PROMPTS_FILE).exists() else settings.prompts  # as token ids: the same whatever the tokenizer
    changes = {"prompts": prompts, "report_dir": None}
    result.settings = settings.fed(saved, **changes) if saved is not None else replace(settings, **changes)
    write_report(result, folder, samples)


def _write_later(result: CompareResult, settings: RunSettings, kept: ReportFolder, samples: Samples, path: Path) -> Path:
    """`CompareResult.write_report`: the kept staging folder's files (inputs, candidate models) and the
    report's, moved into a report folder at `path`, which appears whole or not at all."""
    with new_folder(path) as folder:
        _write(result, settings, kept, samples, folder.final)
        for item in kept.path.iterdir():
            shutil.move(str(item), folder.path / item.name)
    kept.discard()
    result.report_writer = None
    result.report_dir = folder.final
    return result.report_dir


def _import_diagnosis() -> None:
    for module in ("accudiff.stages.judge", "accudiff.verification.verify"):
        importlib.import_module(module)


def __getattr__(name: str):
    """`CompareResult` and `TensorFailure` are re-exported here, imported when first asked for (they bring
    pandas with them)."""
    if name in ("CompareResult", "TensorFailure"):
        import accudiff.result

        return getattr(accudiff.result, name)
    raise AttributeError(f"module 'accudiff.api' has no attribute {name!r}")


class _Stopwatch:
    """Seconds spent in each phase, reported in the summary (speed is a feature: it is measured)."""

    def __init__(self, laps: dict[str, float]) -> None:
        self.laps = laps
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Time since the last lap goes to `phase` (added up, for phases that recur: one per branch group)."""
        now = time.perf_counter()
        self.laps[phase] = round(self.laps.get(phase, 0.0) + now - self._last, 4)
        self._last = now
