"""Command line: a thin layer over the Python API. Exit codes: 0 within tolerance, 1 not, 2 usage/input error,
130 interrupted (Ctrl-C)."""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from accudiff.version import __version__
from accudiff.errors import AccudiffError, out_of_space
from accudiff.leftovers import run_folder, scratch_base
from accudiff.execution.pool import discard_spares, prestart
from accudiff.atomic import default_report_dir
from accudiff.memory import one_heap

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells expect of a command Ctrl-C stopped


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one sentence (and exit code 2), like every other error, and an option is
    taken only by its whole name: a prefix would be read as whatever option it starts (`--output DIR` as
    `--output-kind`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:
        self.exit(EXIT_ERROR, f"accudiff: error: {message} (see {self.prog} --help)\n")


BISECTORS = {
    "subgraph": "the smallest subgraph that fails on its own, saved as a runnable reproducer",
    "precision": "the nodes to keep in FP32 (INT8: unquantized) so the outputs meet tolerance, and a repaired model",
}


def build_parser() -> argparse.ArgumentParser:
    from accudiff.options import add_compare_options, add_option, add_report_dir_option, add_run_options  # (see `main`)

    parser = _Parser(prog="accudiff", description="Find where an ONNX model loses accuracy in FP16, BF16, INT8, FP8 or INT4, and why.")
    parser.add_argument("--version", action="version", version=f"accudiff {__version__}")
    parser.add_argument("--debug", action="store_true", help="show a traceback for internal errors")
    # --debug is also taken after the command, where a user rerunning a failed command adds it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show a traceback for internal errors")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)

    cmp = commands.add_parser("compare", parents=[debug], help="compare every tensor of an FP32 reference against a reduced-precision candidate")
    add_run_options(cmp)
    add_report_dir_option(cmp, "reports/<model>-<precision>-<time>/")
    cmp.set_defaults(parser=cmp)
    add_compare_options(cmp)

    bisect = commands.add_parser("bisect", help="isolate what fails").add_subparsers(dest="bisector", parser_class=_Parser, required=True)
    for name, text in BISECTORS.items():
        sub = bisect.add_parser(name, parents=[debug], help=text)
        add_run_options(sub)
        add_report_dir_option(sub, f"reports/<model>-bisect-{name}-<time>/")
        sub.set_defaults(parser=sub)

    part = commands.add_parser("partition", parents=[debug], help="save the parts of a model TensorRT can and cannot convert")
    part.add_argument("model", help="ONNX model file")
    add_report_dir_option(part, "reports/<model>-partitions-<time>/")
    add_option(part, "--trt-module")
    part.set_defaults(parser=part)

    doctor = commands.add_parser("doctor", parents=[debug], help="check the TensorRT path on this machine (a screen to paste into a bug report)")
    doctor.set_defaults(parser=doctor)
    return parser


def _near_option(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """A hint for a misspelt option, only where one option is a near miss (`--new-token`), never a mere prefix."""
    import difflib

    names = [name for action in parser._actions for name in action.option_strings if name.startswith("--")]
    for given in extras:
        if given.startswith("--") and (near := difflib.get_close_matches(given.split("=")[0], names, n=1, cutoff=0.85)):
            return f": did you mean {near[0]}?"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with run_folder():  # every scratch file of the command and its workers, removed by the next command if this one is killed
            try:
                return _command(argv)
            finally:
                discard_spares()  # the workers end before their folders go
    except AccudiffError as exc:  # no scratch folder could be made
        print(f"accudiff: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _command(argv: Sequence[str] | None) -> int:
    if "compare" in list(sys.argv[1:] if argv is None else argv)[:2]:
        # The comparison worker starts while this process imports what a comparison needs (the options, numpy and
        # onnx, ~0.4 s, are imported after this: the modules this one imports first are light).
        prestart()
    try:
        parser = build_parser()
        args, extras = parser.parse_known_args(argv)
        if extras:  # said by the command's own parser, so the hint names the right --help
            args.parser.error(f"unrecognized arguments: {' '.join(extras)}{_near_option(args.parser, extras)}")
    except SystemExit as exc:  # usage errors, --help, --version: argparse has already printed
        return int(exc.code or 0)
    try:
        return {"compare": _run_compare, "bisect": _run_bisect, "partition": _run_partition, "doctor": _run_doctor}[args.command](args)
    except AccudiffError as exc:
        print(f"accudiff: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("accudiff: interrupted; no report was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug of ours (but a full disk): one sentence by default, the traceback on request
        if isinstance(exc, OSError) and (full := out_of_space(exc, str(scratch_base()), getattr(args, "report_dir", None))) is not None:
            print(f"accudiff: error: {full}", file=sys.stderr)
            return EXIT_ERROR
        if args.debug:
            traceback.print_exc()
            if getattr(exc, "detail", None):
                print(exc.detail, file=sys.stderr)
        print(f"accudiff: internal error: {type(exc).__name__}: {exc} (rerun with --debug for details)", file=sys.stderr)
        return EXIT_ERROR


def _run_compare(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from accudiff.api import run
    from accudiff.options import run_settings
    from accudiff.report.console import ProgressBar, format_summary, format_timings

    settings = run_settings(args)
    settings = replace(settings, report_dir=args.report_dir or default_report_dir(Path(args.model).stem, settings.precision))  # a candidate model's precision is read from it
    result = run(settings, progress=ProgressBar(), import_seconds=time.perf_counter() - started)
    _out(format_summary(result, shutil.get_terminal_size().columns if sys.stdout.isatty() else None))
    if args.timings:
        _out(format_timings(result))
    return EXIT_PASS if result.passed else EXIT_FAIL


def _run_bisect(args: argparse.Namespace) -> int:
    from accudiff.bisect.report import run_bisector
    from accudiff.options import run_settings

    out_dir = args.report_dir or default_report_dir(Path(args.model).stem, f"bisect-{args.bisector}")
    result, summary, found = run_bisector(args.bisector, run_settings(args), out_dir)
    _out(summary)
    return EXIT_INTERRUPTED if result.interrupted else EXIT_FAIL if found else EXIT_PASS


def _run_partition(args: argparse.Namespace) -> int:
    from accudiff.bisect.partition import partition

    out_dir = args.report_dir or default_report_dir(Path(args.model).stem, "partitions")
    parts = partition(args.model, out_dir, args.trt_module)
    _out(f"accudiff partition {Path(args.model).name}: {sum(p.supported for p in parts)} convertible and "
         f"{sum(not p.supported for p in parts)} non-convertible part(s)")
    for part in parts:
        status = "convertible" if part.supported else "NOT convertible"
        reason = f" — {part.reason}" if part.reason else ""
        _out(f"  nodes {part.start}-{part.end}: {status}: {part.op_types}{reason}")
    _out(f"  saved in {out_dir} (partitions.csv lists them)")
    return EXIT_PASS


def _run_doctor(args: argparse.Namespace) -> int:
    from accudiff.doctor import run_doctor

    report = run_doctor()
    _out(report.text())
    return EXIT_PASS if report.verified else EXIT_FAIL


def run_and_exit() -> None:
    """The command as a process (the console script, `python -m accudiff.cli`): `main`, then the exit
    handlers (workers waited for, a Ray cluster shut down) and the output flushed, and the process ends
    without Python freeing every object and module one by one, which took 0.2 s after a comparison."""
    one_heap()  # (memory.py) before any thread starts
    code = main()
    atexit._run_exitfuncs()  # what the interpreter's own exit runs first
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader has gone: what was left to say goes nowhere (`_out`)
        pass
    sys.stderr.flush()
    os._exit(code)


def _out(text: str) -> None:
    """A line of the answer on stdout. When its reader has gone (`accudiff compare ... | head`), the rest goes
    nowhere, as with Unix tools, and the command still ends with its own exit code (never an internal error)."""
    try:
        print(text)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    run_and_exit()
