"""A live compare against the same compare replayed from the files it saved (polygraphy's RunResults):
the table, the verdict, the cause and the repair must be the same, on trained models fed realistic inputs.

    python benchmarks/captured_vs_live.py [magika_v3 ppocr_rec_v4 nudenet_320n ...]

The replayed candidate cannot run again, so its causes are verified on ONNX Runtime's model of the same
precision standing in for it; when the captured run is that model, the stand-in must agree with the live run
(the cause, and the repair where it is verified).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import accudiff  # noqa: E402
from benchmarks import models, realistic_inputs  # noqa: E402

COLUMNS = ["tensor", "status", "max_abs_err", "sqnr_db", "outside_share", "tol_ratio"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["magika_v3", "ppocr_rec_v4"])
    parser.add_argument("--samples", type=int, default=2)
    args = parser.parse_args()
    for name in args.models:
        path, feeds = getattr(models, name)(), realistic_inputs.dataset(name, args.samples)
        for precision in ("fp16", "int8"):
            with tempfile.TemporaryDirectory(prefix="accudiff-captured-") as scratch:
                work = Path(scratch)
                live = accudiff.compare(path, precision, candidate="onnxrt", inputs=feeds, save_candidate=work / "candidate.json", report_dir=work / "live")
                replayed = accudiff.compare(path, precision, inputs=work / "live" / "inputs.npz", load_candidate=work / "candidate.json", report_dir=work / "replayed")
            same_table = live.table[COLUMNS].equals(replayed.table[COLUMNS])
            causes = [(_cause(a), _cause(b)) for a, b in zip(live.output_failures, replayed.output_failures)]
            agree = same_table and live.passed == replayed.passed and all(a == b for a, b in causes)
            print(f"{name} {precision}: {'same' if agree else 'DIFFERENT'} (table identical: {same_table}, "
                  f"verdict {'pass' if live.passed else 'fail'}/{'pass' if replayed.passed else 'fail'})")
            for (was, now), failure in zip(causes, replayed.output_failures):
                print(f"  {failure.tensor}: live {was}; replayed {now}, verified on {failure.cause.stand_in}")


def _cause(failure) -> tuple:
    """What must agree: the cause, and the repair when it was verified (an unverified partial repair of an
    accumulated error depends on which suspects were tried, and the replay has no isolated run to rank them)."""
    repair = failure.repair
    return failure.cause.kind, failure.cause.node, failure.cause.verified, tuple(repair.keep) if repair and repair.verified else ()


if __name__ == "__main__":
    main()
