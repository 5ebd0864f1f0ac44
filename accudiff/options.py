"""The run options every command shares, in one place: one name for one thing, on every command.

Each option is declared once (run_options.RUN_OPTIONS); `add_run_options` and `add_compare_options` put them on
a parser, `run_settings` turns parsed arguments into the run's settings (`RunSettings.arguments` does the
reverse, so a saved command says exactly what was run), and `python_words` says a message in the words of a
Python caller.
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path

from accudiff.run_options import RUN_OPTIONS, RunOption
from accudiff.runners import TrtOptions
from accudiff.settings import PRECISION_FLAGS, RunSettings


def add_run_options(cmd: argparse.ArgumentParser) -> None:
    """The options that say what to compare and how: shared by compare and the bisectors."""
    cmd.add_argument("model", help="ONNX model file, or a folder the ONNX Runtime GenAI model builder wrote")
    precision = cmd.add_mutually_exclusive_group()
    for name, text in (("fp16", "FP16 mixed-precision candidate"), ("bf16", "BF16 mixed-precision candidate"), ("int8", "explicit INT8 Q/DQ candidate")):
        precision.add_argument(PRECISION_FLAGS[name], dest="precision", action="store_const", const=name, help=text)
    cmd.set_defaults(precision="fp32")
    _add(cmd, [option for option in RUN_OPTIONS if not option.compare_only])


def add_compare_options(cmd: argparse.ArgumentParser) -> None:
    """What only `compare` takes (RunOption.compare_only, and --timings): the bisectors rerun the candidate,
    so they neither skip nor replay runs."""
    _add(cmd, [option for option in RUN_OPTIONS if option.compare_only])
    cmd.add_argument("--timings", action="store_true", help="print where the time went: each stage, and the workers' phases (also in summary.json)")


def add_option(cmd: argparse.ArgumentParser, flag: str) -> None:
    """One run option on a command that takes only it (partition's --trt-module)."""
    next(option for option in RUN_OPTIONS if option.flag == flag).add_to(cmd)


def _add(cmd: argparse.ArgumentParser, options: list[RunOption]) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        option.add_to(groups.setdefault(option.group, cmd.add_argument_group(option.group)) if option.group else cmd)


def add_report_dir_option(cmd: argparse.ArgumentParser, default: str) -> None:
    """Every command that writes a folder names it the same way."""
    cmd.add_argument("-o", "--report-dir", type=Path, metavar="DIR", help=f"folder to write (default {default}); never overwritten")


def run_settings(args: argparse.Namespace) -> RunSettings:
    """The run the parsed options describe (those a command does not take keep their defaults)."""
    values: dict = {}
    trt: dict = {}
    for option in RUN_OPTIONS:
        if hasattr(args, option.dest):
            field, _, inner = option.keyword.partition(".")
            (trt if inner else values)[inner or field] = getattr(args, option.dest)
    return RunSettings(args.model, args.precision, trt=TrtOptions(**trt), **values)


_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?: '([^']*)'| ([\w.<>?-]*\d[\w.:=<>?-]*|[\w.<>?-]+[:=][\w.:=<>?-]+))?")


@functools.cache
def _keywords() -> dict[str, tuple[str, bool]]:
    """Each run option's flag -> (its keyword argument as written, e.g. "keep_fp32=" or "precision='fp16'",
    whether it takes a list)."""
    found = {flag: (f"precision={name!r}", False) for name, flag in PRECISION_FLAGS.items()}
    for option in RUN_OPTIONS:
        found[option.flag] = (f"{option.python_keyword}=False", False) if option.action == "store_false" else (f"{option.python_keyword}=", option.listed)
    return found


def python_words(message: str) -> str:
    """A message in the words of `accudiff.compare`'s keyword arguments instead of the command line's flags,
    for a Python caller: "--require 'top1=2' is not ..." -> "require=['top1=2'] is not ...", "--iterations"
    -> "iterations=". Flags of other tools (polygraphy's --save-inputs) stay as they are."""
    keywords = _keywords()

    def said(match: re.Match) -> str:
        flag, quoted, bare = match.groups()
        if flag not in keywords:
            return match.group(0)
        keyword, listed = keywords[flag]
        value = quoted if quoted is not None else bare
        if value is None or not keyword.endswith("="):
            return keyword + match.group(0)[len(flag):]
        written = value if quoted is None and re.fullmatch(r"-?\d+(\.\d*)?", value) else repr(value)
        return keyword + (f"[{written}]" if listed else written)

    # A command quoted in the message ("accudiff compare float.onnx --candidate-model x.onnx") stays a command.
    parts = re.split(r"(accudiff (?:compare|bisect)[^()]*)", message)
    return "".join(part if k % 2 else _FLAG.sub(said, part) for k, part in enumerate(parts))
