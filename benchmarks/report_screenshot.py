"""Render a report.html in headless Chromium and save what a person sees, as a PNG.

    python benchmarks/report_screenshot.py REPORT_FOLDER_OR_HTML [--out shot.png] [--width 1280] [--height 2400]
    python benchmarks/report_screenshot.py --model ppocr_rec_v4 --out docs/report-ppocr-rec-fp16.png

With --model, the trained model (benchmarks/models.py) is first compared in FP16 on two realistic samples
(benchmarks/realistic_inputs.py) into a temporary report folder. Needs Debian's `chromium` package.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import models, realistic_inputs  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def render(page: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium on a local page, offline (a page that asks for the network fails to show it)."""
    command = [browser(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
               "--disable-background-networking", "--enable-logging=stderr", "--v=0", *args, page.resolve().as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def screenshot(page: Path, out: Path, width: int, height: int) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    render(page, f"--screenshot={out.resolve()}", f"--window-size={width},{height}", "--hide-scrollbars")
    if not out.is_file():
        raise SystemExit(f"Chromium wrote no screenshot of {page}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", type=Path, help="a report folder or its report.html")
    parser.add_argument("--model", choices=sorted(realistic_inputs.FEEDS), help="compare this trained model in FP16 first")
    parser.add_argument("--out", type=Path, default=Path("report.png"))
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args()
    if browser() is None:
        raise SystemExit("no Chromium found (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="accudiff-screenshot-") as scratch:
        page = args.report
        if args.model:
            import accudiff

            result = accudiff.compare(models.MODELS[args.model](Path(scratch)), "fp16", candidate="onnxrt",
                                      inputs=realistic_inputs.dataset(args.model, 2), report_dir=Path(scratch) / "report")
            page = result.report_dir
        if page is None:
            parser.error("give a report folder, or --model")
        page = page / "report.html" if page.is_dir() else page
        print(f"{page.stat().st_size / 1e6:.2f} MB page -> {screenshot(page, args.out, args.width, args.height)}")


if __name__ == "__main__":
    main()
