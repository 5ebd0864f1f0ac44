"""The run options every command shares, in one place: one name for one thing, on every command.

`add_run_options` declares them on a parser and `run_settings` turns parsed arguments into the run's
settings (`RunSettings.arguments` does the reverse, so a saved command says exactly what was run).
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path

from accudiff.judging.objective import OBJECTIVES
from accudiff.runners import CANDIDATES, TrtOptions
from accudiff.runners.trt_build import LEGACY_PRECISIONS, MARK_MODES
from accudiff.runners.trt_env import MODULES
from accudiff.settings import DEFAULT_CAUSE_BUDGET, DEFAULT_VERIFY_BUDGET, SIDE_BACKENDS, RunSettings


def add_run_options(cmd: argparse.ArgumentParser) -> None:
    """The options that say what to compare and how: shared by compare and the bisectors."""
    cmd.add_argument("model", help="ONNX model file, or a folder the ONNX Runtime GenAI model builder wrote")
    precision = cmd.add_mutually_exclusive_group()
    precision.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help="FP16 mixed-precision candidate")
    precision.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="BF16 mixed-precision candidate")
    precision.add_argument("--int8", dest="precision", action="store_const", const="int8", help="explicit INT8 Q/DQ candidate")
    cmd.set_defaults(precision="fp32")
    cmd.add_argument("--candidate-model", metavar="FILE", help="a candidate made from the model by another tool (ModelOpt, ONNX Runtime's quantizer, a converter): compared as it is")
    cmd.add_argument("--candidate", choices=CANDIDATES, default="auto", help="backend that runs the candidate (default: auto)")
    cmd.add_argument("--input-shapes", action="append", default=[], metavar="NAME:DIMS", help="shape of an input with dynamic dimensions, e.g. x:1x3x224x224 (repeatable)")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    cmd.add_argument("--val-range", action="append", default=[], metavar="[NAME:]LO,HI", help="range of random input values (default 0,1; repeatable)")
    cmd.add_argument("--iterations", type=int, default=1, help="number of random input samples (default 1)")
    cmd.add_argument("--load-inputs", metavar="FILE", help="inputs from .npz or polygraphy's --save-inputs JSON instead of random data")
    cmd.add_argument("--calib-data", metavar="FILE", help="INT8 calibration samples (.npz or polygraphy JSON)")
    cmd.add_argument("--prompts", metavar="FILE", help="a decoder's prompts: text (.txt, one a line; .jsonl) tokenized with the model's tokenizer.json, or token ids (.npz)")
    cmd.add_argument("--new-tokens", type=int, metavar="N", help="decode steps after each prompt's prefill, each side carrying its own KV cache (default 16)")
    cmd.add_argument("--keep-fp32", action="append", default=[], metavar="NODE|OP|REGEX", help="keep matching nodes in FP32 / unquantized (repeatable)")
    cmd.add_argument("--no-autokeep", dest="autokeep", action="store_false", help="also convert nodes whose constants exceed the FP16 range")
    cmd.add_argument("--atol", nargs="+", action="extend", metavar="[NAME:]VALUE", help="absolute tolerance, default and per tensor")
    cmd.add_argument("--rtol", nargs="+", action="extend", metavar="[NAME:]VALUE", help="relative tolerance, default and per tensor")
    cmd.add_argument("--stol", nargs="+", action="extend", metavar="[NAME:]VALUE", help="tolerance as a fraction of the tensor's reference absmax")
    cmd.add_argument("--threshold", nargs="+", action="extend", metavar="[OUTPUT:]VALUE", help="where a probability map's elements are binarized, for its flipped share and IoU (default 0.5)")
    cmd.add_argument("--objective", choices=OBJECTIVES, default="tolerance", help="what judges a keep at the outputs: the tolerance ratio, or the decision (top-1 agreement, a map's flipped share)")
    cmd.add_argument("--require", action="append", default=[], metavar="FIGURE=VALUE",
                     help="a decision target an output must meet instead of its tolerance, e.g. top1=0.97, kl=0.01, cosine_min=0.99 or flipped_share=1e-3 (repeatable)")
    cmd.add_argument("--output-kind", action="append", default=[], metavar="NAME=KIND",
                     help="what a graph output is, where the graph does not say: logits, probabilities, embedding, map or values (repeatable)")
    cmd.add_argument("--workers", type=int, metavar="N", help="split the samples over N worker processes or Ray tasks (default: a dataset with 4 samples per core gets one per core, else 1; with --ray, one per CPU of the cluster)")
    cmd.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS", help="run the workers as Ray tasks: 'local' (the default) starts a local cluster, an address joins one")
    cmd.add_argument("--max-memory", metavar="SIZE", help="memory the compared tensors may take, e.g. 512M or 4G (default: 256M, or a quarter of the free memory if less); larger models are compared segment by segment")
    trt = cmd.add_argument_group("TensorRT candidate")
    trt.add_argument("--trt-module", choices=MODULES, help="TensorRT package to use (default: the first importable)")
    trt.add_argument("--trt-mark", choices=MARK_MODES, default="auto", help="what to observe: all layer outputs, unfused debug tensors, or graph outputs")
    trt.add_argument("--trt-legacy-precision", choices=LEGACY_PRECISIONS, help="TensorRT 10 only: weakly typed FP16/INT8 builder flags")
    trt.add_argument("--trt-workspace", type=int, metavar="MB", help="builder workspace limit")
    trt.add_argument("--engine", type=Path, metavar="PLAN", help="compare this pre-built TensorRT engine (graph outputs only)")


def add_compare_options(cmd: argparse.ArgumentParser) -> None:
    """What only `compare` takes (settings.COMPARE_ONLY, and --timings): the bisectors rerun the candidate,
    so they neither skip nor replay runs."""
    cmd.add_argument("--no-isolate", dest="isolate", action="store_false", help="skip the run that measures each node's own error (faster; the cause is then named only from range evidence)")
    cmd.add_argument("--no-verify", dest="verify", action="store_false", help="skip testing each suspect at the failing outputs (the cause is then the rules' hypothesis, not verified)")
    cmd.add_argument("--verify-budget", type=int, default=DEFAULT_VERIFY_BUDGET, metavar="N", help=f"candidate runs per failing output to try the rules' suspects alone and confirm the repair (default {DEFAULT_VERIFY_BUDGET})")
    cmd.add_argument("--cause-budget", type=int, default=DEFAULT_CAUSE_BUDGET, metavar="N",
                     help=f"candidate runs per failing output to search every other node the candidate changes, in groups, for one that repairs it alone (default {DEFAULT_CAUSE_BUDGET})")
    cmd.add_argument("--timings", action="store_true", help="print where the time went: each stage, and the workers' phases (also in summary.json)")
    cmd.add_argument("--also", choices=SIDE_BACKENDS, help="run the same transformed model on a second backend too (three-way table)")
    captured = cmd.add_argument_group("tensors captured elsewhere (polygraphy's RunResults JSON)")
    captured.add_argument("--load-candidate", type=Path, metavar="FILE", help="the candidate's tensors from polygraphy run ... --save-outputs FILE (give --load-inputs too)")
    captured.add_argument("--load-reference", type=Path, metavar="FILE", help="the reference's tensors from such a file, instead of running it")
    captured.add_argument("--candidate-runner", metavar="NAME", help="the runner to read when the file holds several")
    captured.add_argument("--save-reference", type=Path, metavar="FILE", help="write the reference's tensors as RunResults JSON (polygraphy --load-outputs reads it)")
    captured.add_argument("--save-candidate", type=Path, metavar="FILE", help="write the candidate's tensors as RunResults JSON")


def add_report_dir_option(cmd: argparse.ArgumentParser, default: str) -> None:
    """Every command that writes a folder names it the same way."""
    cmd.add_argument("-o", "--report-dir", type=Path, metavar="DIR", help=f"folder to write (default {default}); never overwritten")


def run_settings(args: argparse.Namespace, **only_compare) -> RunSettings:
    """The run the shared options describe (`only_compare`: what compare adds, such as the report folder)."""
    return RunSettings(
        args.model,
        args.precision,
        candidate=args.candidate,
        input_shapes=args.input_shapes,
        inputs=args.load_inputs,
        seed=args.seed,
        val_range=args.val_range,
        iterations=args.iterations,
        calib_data=args.calib_data,
        keep_fp32=args.keep_fp32,
        autokeep=args.autokeep,
        atol=args.atol,
        rtol=args.rtol,
        stol=args.stol,
        max_memory=args.max_memory,
        workers=args.workers,
        ray=args.ray,
        trt=TrtOptions(args.trt_module, args.trt_mark, args.trt_workspace, args.trt_legacy_precision, engine=args.engine),
        candidate_model=args.candidate_model,
        threshold=args.threshold,
        objective=args.objective,
        require=args.require,
        output_kind=args.output_kind,
        prompts=args.prompts,
        new_tokens=args.new_tokens,
        **only_compare,
    )


# Where a run option's keyword differs from its flag's destination, or takes an object: `accudiff.compare`'s word for it.
_KEYWORDS = {"load_inputs": "inputs", "trt_module": "trt", "trt_mark": "trt", "trt_workspace": "trt", "trt_legacy_precision": "trt", "engine": "trt"}
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?: '([^']*)'| ([\w.<>?-]*\d[\w.:=<>?-]*|[\w.<>?-]+[:=][\w.:=<>?-]+))?")


@functools.cache
def _keywords() -> dict[str, tuple[str, bool]]:
    """Each run option's flag -> (its keyword argument as written, e.g. "keep_fp32=" or "precision='fp16'",
    whether it takes a list)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_run_options(parser)
    add_compare_options(parser)
    found = {}
    for action in parser._actions:
        for flag in action.option_strings:
            keyword = _KEYWORDS.get(action.dest, action.dest)
            if isinstance(action, argparse._StoreConstAction) and action.dest == "precision":
                found[flag] = (f"precision={action.const!r}", False)
            elif isinstance(action, argparse._StoreFalseAction):
                found[flag] = (f"{keyword}=False", False)
            else:
                found[flag] = (f"{keyword}=", isinstance(action, (argparse._AppendAction, argparse._ExtendAction)))
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
