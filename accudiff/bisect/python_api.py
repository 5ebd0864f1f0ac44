"""The bisectors as Python calls: `accudiff.bisect_precision(...)` and `accudiff.bisect_subgraph(...)` take
what `accudiff.compare` takes and write the folder `accudiff bisect precision|subgraph` writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from accudiff.atomic import default_report_dir
from accudiff.bisect.precision import PrecisionResult
from accudiff.bisect.report import run_bisector
from accudiff.bisect.subgraph import SubgraphResult
from accudiff.errors import AccudiffError
from accudiff.options import python_words
from accudiff.settings import settings_of


@dataclass(frozen=True)
class Bisection:
    """What a bisector found, the folder it wrote (result.json, report.html, its models and lists) and its
    answer in the command line's words."""

    found: PrecisionResult | SubgraphResult
    folder: Path
    summary: str


def bisect_precision(model: str | Path, precision: str = "fp32", *, report_dir: str | Path | None = None,
                     progress: Callable[[str], None] | None = None, **options) -> Bisection:
    """The nodes to keep in higher precision (`found.keep`), the repaired model (`folder / found.repaired_model`)
    and the ranking of the nodes, as `accudiff bisect precision` finds them. `progress(line)` is told each
    step; nothing is printed."""
    return _bisect("precision", model, precision, report_dir, progress, options)


def bisect_subgraph(model: str | Path, precision: str = "fp32", *, report_dir: str | Path | None = None,
                    progress: Callable[[str], None] | None = None, **options) -> Bisection:
    """The smallest failing subgraph (`folder / found.model_path`, its inputs `folder / found.inputs_path`),
    as `accudiff bisect subgraph` finds it. `progress(line)` is told each step; nothing is printed."""
    return _bisect("subgraph", model, precision, report_dir, progress, options)


def _bisect(name: str, model, precision: str, report_dir, progress, options: dict) -> Bisection:
    try:
        settings = settings_of(model, precision, options, f"bisect_{name}()")
        folder = Path(report_dir) if report_dir is not None else default_report_dir(Path(settings.model).stem, f"bisect-{name}")
        found, summary, _ = run_bisector(name, settings, folder, progress or (lambda line: None))
    except AccudiffError as exc:  # said in the caller's words, once
        raise AccudiffError(python_words(str(exc))) from None
    return Bisection(found, folder, summary)
