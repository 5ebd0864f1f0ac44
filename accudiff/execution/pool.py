"""The caller's side of the process boundary: comparison workers (worker.py) started, handed jobs and ended.

A worker is a child process that runs jobs one after another; `prestart` starts workers ahead of their jobs
so their Python start and imports overlap the caller's own work, and the pool keeps them (and those let go
of, still exiting) until they are used or ended (`discard_spares`, at the latest when the caller exits).
Importing this module imports nothing heavy (the messages and their numpy come with the first job), so the
command line starts its worker before its own imports (0.4 s of numpy, onnx and the options).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from accudiff.errors import AccudiffError
from accudiff.leftovers import WORKER_PREFIX
from accudiff.memory import with_huge_pages

SPAWNED_AT = "ACCUDIFF_WORKER_SPAWNED_AT"  # when the caller started the worker (time.time()), for its start's measure

if TYPE_CHECKING:
    from accudiff.execution.messages import Job, Probe, ProbedValue, WorkerResult


class WorkerBug(RuntimeError):
    """A bug of ours inside the worker; `detail` holds the worker's traceback (shown with --debug)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


class Worker:
    """A worker process that runs jobs one after another: the sessions of passes marked `reuse` stay open
    between its jobs (verification's rounds run one candidate with different switches)."""

    def __init__(self, huge_pages: bool = False) -> None:
        """`huge_pages`: its malloc backs large blocks with huge pages (see memory.py: for large tensors)."""
        self._stderr, self._stderr_text = tempfile.TemporaryFile("w+"), ""
        # The worker's temporary files go in a folder of ours, removed when it ends: a worker killed or
        # crashed leaves nothing behind.
        self._tmp = tempfile.mkdtemp(prefix=WORKER_PREFIX)
        env = {**(with_huge_pages(os.environ) if huge_pages else os.environ), "TMPDIR": self._tmp, SPAWNED_AT: repr(time.time())}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "accudiff.execution.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
        )
        self._ready = False  # its first event says it is up (see `wait_ready`)
        # Closed by the thread that runs its job and, on Ctrl-C, by the caller's: one at a time, or one reads
        # the stderr file the other has just closed.
        self._closing = threading.Lock()

    def wait_ready(self) -> None:
        """Wait until the worker has started and imported what every job uses (its first event); at once
        for one that ran a job. A worker that died meanwhile is left for `run` to report."""
        if not self._ready:
            line = self._process.stdout.readline()
            self._ready = True
            if line and (event := json.loads(line))["event"] != "ready":
                raise WorkerBug("the comparison worker spoke before it was ready", line)
            if line:
                _measured_start(event)

    def run(self, job: Job, progress: Callable[[str, int, int], None] | None = None) -> WorkerResult:
        """Run `job` here and return its result (see `load_result`). After a failure the worker is closed."""
        self._exchange(job, progress)
        return load_result(Path(job.result))

    def probe(self, probe: Probe) -> list[dict[str, ProbedValue]]:
        """Answer `probe` here: each sample's values."""
        from accudiff.execution.messages import ProbedValue

        self._exchange(probe, None)
        return [{name: ProbedValue(**value) for name, value in values.items()} for values in json.loads(Path(probe.result).read_text())]

    def _exchange(self, message: Job | Probe, progress: Callable[[str, int, int], None] | None) -> None:
        """Hand the worker `message` and follow its events until it is done; a failure said in one sentence."""
        step, last = "starting", None
        try:
            self._process.stdin.write(message.to_json() + "\n")
            self._process.stdin.flush()
            for line in self._process.stdout:
                event = json.loads(line)
                if event["event"] == "ready":
                    self._ready = True
                    _measured_start(event)
                elif event["event"] == "step":
                    step = event["text"]
                elif event["event"] == "sample":
                    if progress is not None:
                        progress("compare", event["done"], event["total"])
                else:
                    last = event
                    break
        except BrokenPipeError:
            pass  # the worker died before reading the job: said below
        except BaseException:
            self.close(kill=True)  # interrupted: the worker goes with the caller
            raise
        if last is not None and last["event"] == "done":
            return
        code = self.close()
        if last is None:
            from accudiff.execution.messages import Job
            from accudiff.runners.base import BACKEND_NAMES

            passes = message.passes if isinstance(message, Job) else []
            backend = BACKEND_NAMES.get(passes[0].backend if passes else "onnxrt", "the backend")
            last = next((line.strip() for line in reversed(self._stderr_text.splitlines()) if line.strip()), "")
            raise AccudiffError(
                f"{backend} {_how_it_died(code)} while {step} of '{Path(message.reference if isinstance(message, Job) else message.model).name}'"
                + (f" (last message: {last})" if last else "")
            )
        if last["event"] == "error":
            raise AccudiffError(last["message"])
        raise WorkerBug(f"the comparison worker failed: {last['message']}", self._stderr_text.strip()[-4000:])

    def close(self, kill: bool = False) -> int:
        """End the worker (it exits when its input ends) and wait for it; its exit code."""
        with self._closing:
            if kill and self._process.poll() is None:
                self._process.kill()
            self._end_input()
            code = self._process.wait()
            shutil.rmtree(self._tmp, ignore_errors=True)
            if not self._stderr.closed:
                self._stderr.seek(0)
                self._stderr_text = self._stderr.read()
                self._stderr.close()
            return code

    def let_go(self) -> None:
        """End the worker without waiting for it: it tears its sessions down while the caller goes on (it
        is waited for by `discard_spares`, at the latest when the caller exits)."""
        self._end_input()
        _POOL.ending.append(self)

    def _end_input(self) -> None:
        if not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except BrokenPipeError:
                pass


class _Pool:
    """The workers of this process not at work: started ahead of their jobs (`spares`), and let go of, maybe
    still exiting (`ending`); and how long the last one to say so took to start."""

    def __init__(self) -> None:
        self.spares: list[Worker] = []
        self.ending: list[Worker] = []
        self.start_seconds: float | None = None


_POOL = _Pool()


def _measured_start(ready: dict) -> None:
    if ready.get("start_seconds") is not None:
        _POOL.start_seconds = float(ready["start_seconds"])


def worker_start_seconds(default: float) -> float:
    """How long a worker takes to start on this machine (Python and the imports every job uses: 0.35 s on
    one machine, 0.9 s on another whose ml_dtypes registers its types slowly), as the last worker to be up
    measured it; `default` before any has."""
    return default if _POOL.start_seconds is None else _POOL.start_seconds


def idle_workers() -> int:
    """How many workers wait for a job (started ahead, or kept warm)."""
    return len(_POOL.spares)


def prestart(count: int = 1) -> None:
    """Have `count` workers started now (those already waiting count); the next jobs are handed to them.
    A worker's Python start and imports (`worker_start_seconds`) then overlap the caller's own work (importing,
    loading the model, building variants) instead of following it. Those left unused are ended by
    `discard_spares` (and at exit)."""
    _POOL.spares.extend(Worker() for _ in range(count - len(_POOL.spares)))


def take_worker(huge_pages: bool = False) -> Worker:
    """A worker for the next job: one started ahead, or a new one. Workers are started ahead without huge
    pages; a job that wants them ends those (an idle Python process takes ~60 MB) and starts its own."""
    if huge_pages:
        discard_spares()
        return Worker(huge_pages=True)
    return _POOL.spares.pop(0) if _POOL.spares else Worker()  # the one started first: the likeliest to be up (or warm)


def discard_spares() -> None:
    """End the workers started ahead and not used, and wait for those let go of."""
    while _POOL.spares:
        _POOL.spares.pop().close(kill=True)
    while _POOL.ending:
        _POOL.ending.pop().close()


atexit.register(discard_spares)


def run_job(job: Job, progress: Callable[[str, int, int], None] | None = None, keep_warm: bool = False) -> WorkerResult:
    """Run `job` in a worker process of its own (one started ahead by `prestart`, if any; one with huge pages
    for large tensors) and return its result. `keep_warm`: the worker stays up after the job, among those
    started ahead, for a job that may follow (verification's trials after a comparison: its Python start
    and imports are then paid once)."""
    worker = take_worker(job.large_tensors)
    try:
        result = worker.run(job, progress)
    except BaseException:
        worker.let_go()
        raise
    if keep_warm and not job.large_tensors:
        keep_warm_worker(worker)
    else:
        worker.let_go()  # its teardown overlaps the caller's next stage
    return result


def keep_warm_worker(worker: Worker) -> None:
    """`worker`, done with its job, waits among those started ahead for a job that may follow."""
    _POOL.spares.append(worker)


def load_result(path: Path) -> WorkerResult:
    """A worker's result, from the two files it wrote beside `path` (see `result_files`)."""
    from accudiff.execution.messages import WorkerResult

    return WorkerResult.decode(*result_files(path))


def result_files(path: Path) -> tuple[str, bytes]:
    """A worker's result as it was written (its JSON text and its arrays, sketches sparse): what a Ray task
    sends back, far smaller than the decoded arrays (the sketches are mostly empty buckets)."""
    return path.with_suffix(".json").read_text(), path.with_suffix(".npz").read_bytes()


def _how_it_died(code: int) -> str:
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"crashed (signal {-code})"
    return f"exited unexpectedly (code {code})"
