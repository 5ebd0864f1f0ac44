"""Where one run works: the report folder it writes (whole or not at all), a scratch folder, the reference
cache shared between runs, and whom it tells how far it got."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from accudiff.execution.pool import discard_spares
from accudiff.atomic import ReportFolder, interrupts_held
from accudiff.model.stores import ReferenceCache

Progress = Callable[[str, int, int], None]  # (phase, samples done, samples in all)


@dataclass
class Workspace:
    folder: ReportFolder  # the report being written: its staging folder is `folder.path`
    scratch: Path  # removed when the run ends
    reference_cache: ReferenceCache | None = None
    progress: Progress | None = None

    def progress_from(self, done: int, total: int) -> Progress | None:
        """Progress of a part of the samples (a branch group's), counted over all of them."""
        if self.progress is None:
            return None
        return lambda phase, finished, _: self.progress(phase, done + finished, total)


@contextmanager
def workspace(report_dir: str | Path | None, progress: Progress | None, reference_cache: ReferenceCache | None) -> Iterator[Workspace]:
    """A workspace for one run; on any error its report folder is discarded (nothing half-written is left),
    and in any case its scratch folder and spare worker processes go."""
    folder, scratch, failed = None, None, False
    try:
        with interrupts_held():
            folder = ReportFolder(Path(report_dir) if report_dir is not None else None)
        scratch = Path(tempfile.mkdtemp(prefix="accudiff-compare-"))
        yield Workspace(folder, scratch, reference_cache, progress)
    except BaseException:
        failed = True
        raise
    finally:
        discard_spares()
        if failed and folder is not None:  # once the workers let go of have ended: one still writing into it (Ctrl-C reaches them too) is done now
            folder.discard()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
