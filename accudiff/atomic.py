"""Files and folders that appear whole or not at all (reports, bisect folders, partitions, baselines, engine
caches), and never replace an existing folder."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from accudiff.errors import AccudiffError
from accudiff.leftovers import claim, release, sweep_staging

DEFAULT_ROOT = Path("reports")


def default_report_dir(model_stem: str, precision: str, root: Path = DEFAULT_ROOT) -> Path:
    """`reports/<model>-<precision>-<YYYYmmdd-HHMMSS>`, with a counter if that name is taken."""
    base = root / f"{model_stem}-{precision}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, counter = base, 1
    while candidate.exists():
        counter += 1
        candidate = base.with_name(f"{base.name}-{counter}")
    return candidate


def write_atomically(path: Path, data: bytes) -> None:
    """Write a file that readers see whole or not at all (a rename within one folder is atomic); a write or
    rename that fails (a full disk, a folder in the way, Ctrl-C) leaves no partial file behind."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class ReportFolder:
    """Files are written into a hidden staging folder beside the target; `commit` renames it into place.

    Without a target (`final=None`) the staging folder is a temporary one that `commit` or `discard` removes.
    """

    def __init__(self, final: Path | None):
        self.final = Path(final) if final is not None else None
        self._made: list[Path] = []  # the folders above the target made for it, deepest first: removed with a discarded report
        if self.final is not None:
            if self.final.exists():
                raise AccudiffError(f"report folder '{self.final}' already exists; choose another with --report-dir")
            self._made = [p for p in [self.final.parent, *self.final.parent.parents] if not p.exists()]
            self.final.parent.mkdir(parents=True, exist_ok=True)
            sweep_staging(self.final.parent)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.partial-", dir=self.final.parent))
            claim(self.path)
        else:
            self.path = Path(tempfile.mkdtemp(prefix="accudiff-"))

    def write_text(self, name: str, text: str) -> Path:
        target = self.path / name
        target.write_text(text, encoding="utf-8")
        return target

    def commit(self) -> Path | None:
        """Move the finished folder into place (atomic on one file system); None when there is no target."""
        if self.final is None:
            self.discard()
            return None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.path, 0o777 & ~umask)  # mkdtemp made it private; a report is an ordinary folder
        release(self.path)
        try:
            os.rename(self.path, self.final)
        except OSError as exc:
            self.discard()
            raise AccudiffError(f"could not move the report into '{self.final}': {exc.strerror}") from exc
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        for folder in self._made:  # a first run's reports/ goes with its report, if nothing else is in it
            try:
                folder.rmdir()
            except OSError:
                break


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C held back for the block: a folder made inside is held by whoever discards it before the
    interrupt arrives, never left between its mkdir and that. The SIGINT handler (Python runs handlers in
    the main thread, whichever thread the signal reached) only notes the signal meanwhile; the one it
    replaced is given it at the end (the default one raises KeyboardInterrupt there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[tuple[int, object]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted and callable(previous):
            previous(*noted[0])
        elif noted and previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


@contextmanager
def new_folder(final: Path) -> Iterator[ReportFolder]:
    """A folder filled inside the `with` block: moved into place at `final` when the block ends, discarded
    (with the parent folders made for it) when it raises or is interrupted."""
    folder = None
    try:
        with interrupts_held():
            folder = ReportFolder(final)
        yield folder
    except BaseException:
        if folder is not None:
            folder.discard()
        raise
    folder.commit()
