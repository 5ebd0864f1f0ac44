"""A mark-all RunResults file of a real model, written and read back: how long, and in how much memory.

    python benchmarks/run_results_io.py [--samples 2]

Writes the recognizer's candidate tensors for drawn text lines with `--save-candidate` (polygraphy's
format, every tensor of every sample), then compares against that file with `--load-candidate`, and
prints the file's size, each command's time and peak memory (process tree), and the captured stage's
share of the second. The file is streamed both ways, so the peak should stay far below the file's size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import models  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.realistic_inputs import ppocr_rec  # noqa: E402
from accudiff.model.inputs import save_feeds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="accudiff-runresults-") as scratch:
        work = Path(scratch)
        model = models.ppocr_rec_v4()
        inputs = work / "lines.npz"
        save_feeds([ppocr_rec(seed=k) for k in range(args.samples)], inputs)
        accudiff = [sys.executable, "-m", "accudiff.cli"]
        captured = work / "candidate.json"
        write = measure([*accudiff, "compare", str(model), "--fp16", "--candidate", "onnxrt", "--no-isolate", "--no-verify",
                         "--load-inputs", str(inputs), "--save-candidate", str(captured), "-o", str(work / "first")])
        read = measure([*accudiff, "compare", str(model), "--fp16", "--load-inputs", str(inputs), "--load-candidate", str(captured),
                        "-o", str(work / "second")])
        size = captured.stat().st_size / 2**20 if captured.exists() else float("nan")
        timings = json.loads((work / "second" / "summary.json").read_text()).get("timings_s", {}) if (work / "second").exists() else {}
    print(f"PP-OCRv4 recognizer, {args.samples} drawn text line(s): RunResults file {size:.0f} MB")
    print(f"  write (compare --save-candidate): {write['seconds']:.1f} s, peak {write['peak_mb']:.0f} MB, exit {write['exit']}")
    print(f"  read  (compare --load-candidate): {read['seconds']:.1f} s, peak {read['peak_mb']:.0f} MB, exit {read['exit']}")
    print(f"  phases of the read: {timings}")


if __name__ == "__main__":
    main()
