"""What a killed command leaves behind, removed by the next one.

A command cleans up after itself, even after Ctrl-C; one killed where it cannot (SIGKILL, the kernel's
out-of-memory killer, a lost terminal) leaves its scratch and its report's staging folder, which hold
gigabytes for a large model (its converted weights, a decoder's recorded logits): on a /tmp held in memory,
what makes the next run run out of memory too. So the command line puts all its scratch, and its workers',
in one folder of its own (`run_folder`), locked while the command lives, and a report's staging folder names
that folder (`claim`). The next command removes the folders whose lock no process holds (`sweep`), and a
staging folder whose command's folder is gone (`sweep_staging`); a command running beside it keeps its own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from accudiff.errors import AccudiffError

try:
    import fcntl
except ImportError:  # Windows: the folder is used, not locked, and nothing is swept
    fcntl = None

RUN_PREFIX = "accudiff-run-"
WORKER_PREFIX = "accudiff-worker-"  # a worker's own folder, inside its caller's (execution/pool.py)
LOCK = ".lock"
OWNER = ".accudiff-owner"  # in a report's staging folder: the host and run folder of the command writing it


@contextmanager
def run_folder() -> Iterator[Path]:
    """A folder in the temporary folder (TMPDIR) that every temporary file of this process and of the
    workers it starts goes into while the block runs (tempfile's folder and TMPDIR point into it), locked
    until it is removed at the end; folders of killed commands found there are removed first."""
    base = Path(tempfile.gettempdir())
    sweep(base)
    try:
        folder = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=base))
    except OSError as exc:
        raise AccudiffError(f"could not make a scratch folder in {base} ({exc.strerror}): point TMPDIR to a folder accudiff can write to") from exc
    lock = _locked(folder)
    previous = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = str(folder), str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = previous[0]
        if previous[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous[1]
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            lock.close()


def scratch_base() -> Path:
    """Where scratch goes as the user set it (TMPDIR), above the folders of a run and of its workers."""
    folder = Path(tempfile.gettempdir())
    while folder.name.startswith((RUN_PREFIX, WORKER_PREFIX)) and folder.parent != folder:
        folder = folder.parent
    return folder


def sweep(base: Path) -> None:
    """Remove the run folders in `base` whose lock no process holds: their commands were killed."""
    if fcntl is None:
        return
    try:
        found = [entry.path for entry in os.scandir(base) if entry.name.startswith(RUN_PREFIX) and entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for path in found:
        _remove_if_abandoned(Path(path))


def claim(staging: Path) -> None:
    """Name this command's run folder in a report's `staging` folder, so a later command can tell whether
    the command writing it still lives; nothing outside a run folder (the Python API) is claimed."""
    folder = _current_run_folder()
    if folder is not None:
        (staging / OWNER).write_text(json.dumps({"host": socket.gethostname(), "run": str(folder)}))


def release(staging: Path) -> None:
    """Take the claim out of a finished report before it is moved into place."""
    (staging / OWNER).unlink(missing_ok=True)


def sweep_staging(parent: Path) -> None:
    """Remove the reports' staging folders in `parent` claimed on this host by commands whose run folder is
    gone, or no longer locked: they were killed while writing them."""
    if fcntl is None:
        return
    try:
        found = [Path(entry.path) for entry in os.scandir(parent) if entry.name.startswith(".") and ".partial-" in entry.name and entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for staging in found:
        try:
            owner = json.loads((staging / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours, or made by the Python API, or just made: left alone
        if owner.get("host") != socket.gethostname():
            continue
        run = Path(owner.get("run", ""))
        if not run.is_dir() or _remove_if_abandoned(run):
            shutil.rmtree(staging, ignore_errors=True)


def _locked(folder: Path):
    """The run folder's lock, held: made under another name and renamed into place once held, so a sweep
    never finds it free while its command lives."""
    if fcntl is None:
        return None
    handle = open(folder / f"{LOCK}.{os.getpid()}", "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    os.replace(folder / f"{LOCK}.{os.getpid()}", folder / LOCK)
    return handle


def _remove_if_abandoned(folder: Path) -> bool:
    """Remove a run folder whose lock can be taken (its command is dead); whether it was removed. One
    without its lock yet (just made) is left alone."""
    try:
        handle = open(folder / LOCK, "r+")
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        shutil.rmtree(folder, ignore_errors=True)
    return True


def _current_run_folder() -> Path | None:
    folder = Path(tempfile.gettempdir())
    while folder.parent != folder:
        if folder.name.startswith(RUN_PREFIX):
            return folder
        folder = folder.parent
    return None
