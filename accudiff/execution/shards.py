"""A comparison's samples split over several workers: local processes, or Ray tasks across machines.

Each worker (worker.py) compares a contiguous shard of the samples and returns statistics, never arrays;
`merge_results` adds them up in shard order. Counts, minima and maxima are the same for any number of
workers; float64 sums agree up to the order of addition (documented in metrics.py).

With Ray (an optional extra, imported only here), every shard is a task. Its files (the models and the
sample files it reads) travel through Ray's object store as bytes, so workers on other machines need no
shared file system; a task writes them to a temporary folder and runs the same worker code there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import onnx

from accudiff.execution.messages import Job, WorkerResult, merge_results
from accudiff.execution.pool import result_files, run_job
from accudiff.errors import AccudiffError, first_line
from accudiff.model.graph import all_initializers
from accudiff.model.weights import FOLDER_KEY, external_entries, is_external, weight_folder

Progress = Callable[[str, int, int], None]
RAY_LOG_LEVEL = 40  # logging.ERROR: Ray's own log lines stay off the console
# A worker's start (its Python and imports, overlapped with the caller's work) and its sessions are paid
# back after about this many samples (benchmarks/dataset_scaling.py): a dataset gets a worker per core
# once each has that many.
SAMPLES_PER_WORKER = 4


def worker_cores(samples: int) -> int:
    """The cores each worker of a comparison of `samples` samples uses, for its ONNX Runtime sessions
    (intra-op threads) and its statistics. One sample runs on every core. A dataset's worker uses one,
    whatever the number of workers and wherever they run (local processes, Ray tasks): ONNX Runtime splits
    some sums by thread count, so one rule for every layout keeps the table the same, and N workers use
    N cores, never more."""
    return 1 if samples > 1 else os.cpu_count() or 1


def default_workers(samples: int) -> int:
    """Local workers when --workers is not given: one per core for a dataset large enough to pay for
    them (SAMPLES_PER_WORKER samples each), else one."""
    return max(1, min(os.cpu_count() or 1, samples // SAMPLES_PER_WORKER))


def run_shards(
    job: Job,
    entries: Sequence[Sequence[str]],
    workers: int | None = None,
    ray: str | None = None,
    progress: Progress | None = None,
    indices: Sequence[int] | None = None,
    keep_warm: bool = False,
) -> WorkerResult:
    """Compare the samples `entries` (model/samples.py) in shards; their merged result.

    `workers`: how many shards (default: `default_workers` locally; with Ray, one per CPU of the cluster). `indices`: the
    samples' numbers in the whole dataset, which the per-sample results carry (default 0, 1, ...).
    `keep_warm`: local workers stay up for the jobs that may follow (pool.run_job)."""
    indices = list(indices) if indices is not None else list(range(len(entries)))
    if ray is not None:
        with _ray_cluster(ray) as cpus:
            return merge_results(_run_on_ray(_split(job, entries, indices, workers or cpus, cores=1), progress))
    jobs = _split(job, entries, indices, workers or default_workers(len(entries)), cores=os.cpu_count() or 1)
    done = [0] * len(jobs)

    def report(k: int):
        def step(phase: str, finished: int, total: int) -> None:
            done[k] = finished
            if progress is not None:
                progress(phase, sum(done), len(entries))

        return step

    if len(jobs) == 1:
        return merge_results([run_job(jobs[0], report(0), keep_warm)])
    results: list[WorkerResult | None] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = run_job(jobs[k], report(k), keep_warm)
        except BaseException as exc:  # raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return merge_results(results)


def _split(job: Job, entries: Sequence[Sequence[str]], indices: list[int], workers: int, cores: int) -> list[Job]:
    """`workers` shards of the samples, one job each, dealt out in turn: the first samples, which alone get
    the isolated run (group.py), go to every worker. Every shard's sessions are made alike, whatever their
    number (`worker_cores`, at most the `cores` a job may use: this machine's, or the one CPU a Ray task
    gets; optimized or not by the whole run's number of samples)."""
    count = len(entries)
    shards = [list(range(k, count, workers)) for k in range(min(workers, count))]
    threads = min(worker_cores(count), cores)
    at_once = max(1, cores // (len(shards) * threads)) if shards else 1  # the cores the workers leave over, used by sessions side by side
    return [
        replace(job, samples=[list(entries[i]) for i in shard], sample_indices=[indices[i] for i in shard], result=f"{job.result}-{k}",
                threads=threads, run_samples=count, sessions_at_once=at_once)
        for k, shard in enumerate(shards)
    ]


@contextmanager
def _ray_cluster(address: str) -> Iterator[int]:
    """Ray started or joined (`address`: "local" starts a local cluster), for the duration; yields its CPUs."""
    try:
        import ray
    except ImportError:
        raise AccudiffError("--ray needs Ray: install it with pip install 'accudiff[ray]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=None if address == "local" else address, logging_level=RAY_LOG_LEVEL, log_to_driver=False,
                     include_dashboard=False, configure_logging=True)
        except Exception as exc:  # connection errors of many kinds
            raise AccudiffError(f"could not start or join the Ray cluster '{address}': {first_line(exc)}") from exc
    try:
        yield max(1, int(ray.cluster_resources().get("CPU", 1)))
    finally:
        if started:
            ray.shutdown()


def _run_on_ray(jobs: list[Job], progress: Progress | None) -> Iterator[WorkerResult]:
    """Every shard as a Ray task; the files each reads go through the object store once. Results are
    yielded in shard order as they finish (a shard that finishes early waits, decoded, for its elders)."""
    import ray

    shipped = [_files_of(job) for job in jobs]
    payloads = {path: ray.put(Path(path).read_bytes()) for path in sorted({path for files in shipped for path in files})}
    task = ray.remote(max_retries=0)(_ray_task)
    pending = {task.remote(job.to_json(), {path: payloads[path] for path in files}): k
               for k, (job, files) in enumerate(zip(jobs, shipped))}
    early: dict[int, WorkerResult] = {}
    next_shard, finished = 0, 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        k = pending.pop(ready[0])
        try:
            early[k] = WorkerResult.decode(*ray.get(ready[0]))
        except ray.exceptions.RayError as exc:
            raise AccudiffError(_ray_failure(exc, jobs[k])) from exc
        finished += len(jobs[k].sample_indices)
        if progress is not None:
            progress("compare", finished, sum(len(job.sample_indices) for job in jobs))
        while next_shard in early:
            yield early.pop(next_shard)
            next_shard += 1


def _files_of(job: Job) -> list[str]:
    """The files a worker reads: the models, the files their weights are in (where each weight says its
    file lies: a model accudiff saved refers to the user's weights where they are, and a candidate's
    isolated twin to the candidate's own file) and the sample files."""
    models = [job.reference, *(p.model for p in job.passes), *job.validate]
    weights = {path for model in models for path in _weight_files(onnx.load(model, load_external_data=False), model).values()}
    return list(dict.fromkeys([*models, *sorted(weights), *(entry[0] for entry in job.samples)]))


def _weight_files(proto: onnx.ModelProto, model: str) -> dict[int, str]:
    """The file each external weight of `proto` (the model file `model`) lies in, by the weight's index
    among the model's initializers (bodies included)."""
    return {index: str((weight_folder(init) or Path(model).parent) / external_entries(init)["location"])
            for index, init in enumerate(all_initializers(proto)) if is_external(init)}


def _pointed_here(model: str, local: dict[str, str]) -> str:
    """The local copy of the model `model`, or, where its weights say which folder their files lie in (a
    model accudiff saved: weights.py), a copy of it beside it whose weights refer to the local copies of
    those files (`local`: each shipped file's local path). The model's own copy is left as it was: another
    model's weights may lie in it at their offsets."""
    proto = onnx.load(local[model], load_external_data=False)
    initializers = all_initializers(proto)
    placed = {index: original for index, original in _weight_files(proto, model).items() if weight_folder(initializers[index]) is not None}
    if not placed:
        return local[model]
    for index, original in placed.items():
        here = Path(local[original])
        for entry in initializers[index].external_data:
            if entry.key in ("location", FOLDER_KEY):
                entry.value = here.name if entry.key == "location" else str(here.parent)
    target = Path(local[model]).with_suffix(".here.onnx")
    onnx.save(proto, str(target))
    return str(target)


def _ray_task(job: str, payloads: dict) -> tuple[str, bytes]:
    """A Ray task: the job's files written locally, the worker's code run here, its result files returned.
    Files of one folder land in one local folder under their own names, files of another in another (two
    models' data files may share a name: a GenAI folder's `model.onnx.data`), so a model finds its data
    files beside it as ONNX Runtime expects; a model accudiff saved, whose weights say which folder their
    files lie in, is pointed at the local copies. The task reads nothing from the caller's file system."""
    import ray

    folder = Path(tempfile.mkdtemp(prefix="accudiff-ray-"))
    try:
        folders: dict[str, Path] = {}  # the caller's folder -> its local copy
        local = {}
        for path, ref in payloads.items():
            here = folders.setdefault(str(Path(path).parent), folder / str(len(folders)))
            here.mkdir(exist_ok=True)
            (here / Path(path).name).write_bytes(ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref)
            local[path] = str(here / Path(path).name)
        moved = Job.from_json(job)
        models = {path: _pointed_here(path, local) for path in [moved.reference, *(p.model for p in moved.passes), *moved.validate]}
        moved = replace(
            moved,
            reference=models[moved.reference],
            passes=[replace(p, model=models[p.model]) for p in moved.passes],
            validate=[models[path] for path in moved.validate],
            samples=[[local[file], prefix] for file, prefix in moved.samples],
            result=str(folder / "result"),
            store=None,
            layer_report=None,
        )
        from accudiff.execution.worker import _work

        _work(moved, lambda event: None)
        return result_files(Path(moved.result))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _ray_failure(exc: BaseException, job: Job) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, AccudiffError):
        return str(cause)
    first = first_line(exc)
    return f"a Ray task comparing samples {job.sample_indices[0]}-{job.sample_indices[-1]} of '{Path(job.reference).name}' failed: {first}"
