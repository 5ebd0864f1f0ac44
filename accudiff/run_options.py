"""Every run option, declared once: its flag, the `RunSettings` keyword it sets, how the parser takes it,
and how a run's settings write it back as the command that runs it again. The parser and the settings a
command line makes (options.py), the replayed command (`RunSettings.arguments`), what only `compare` takes
and the Python words of a message (options.python_words) all read this one table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from accudiff.judging.objective import OBJECTIVES
from accudiff.runners import CANDIDATES
from accudiff.runners.trt_build import LEGACY_PRECISIONS, MARK_MODES
from accudiff.runners.trt_env import MODULES

SIDE_BACKENDS = ("onnxrt", "trt")
DEFAULT_VERIFY_BUDGET = 8  # candidate runs that may test suspects, per failing output (verification/verify.py)
DEFAULT_CAUSE_BUDGET = 48  # runs a failing output's search of every changed node may take (verification/search.py): thousands of nodes that hold no single cause need a few
TRT_GROUP = "TensorRT candidate"
CAPTURED_GROUP = "tensors captured elsewhere (polygraphy's RunResults JSON)"


@dataclass(frozen=True)
class RunOption:
    """One option. `keyword`: the RunSettings field it sets ("trt.<field>": a field of its TrtOptions).
    `action`: how argparse takes it ("store"; "append": repeatable; "extend": one or more values at a time;
    "store_false"). Written back unless its value is `default`, or `written_when(settings)` is false (what
    makes random inputs, when inputs are given), or `replayed` is false (where a run writes, not what it
    compares; the candidate model, written with the model)."""

    flag: str
    keyword: str
    help: str
    action: str = "store"
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default: Any = None
    const: str | None = None  # the value of the flag given without one
    compare_only: bool = False  # the bisectors rerun the candidate: they neither skip nor replay runs
    group: str | None = None  # the --help section it is listed in
    replayed: bool = True
    written_when: Callable[[Any], bool] | None = None
    texts: Callable[[Any], list[str]] | None = None  # a repeated option's value as the texts the flag takes

    @property
    def dest(self) -> str:
        """Its attribute on the parsed arguments."""
        return self.keyword.replace(".", "_")

    @property
    def python_keyword(self) -> str:
        """What `accudiff.compare` calls it (a TrtOptions field is given inside `trt`)."""
        return self.keyword.split(".")[0]

    @property
    def listed(self) -> bool:
        return self.action in ("append", "extend")

    def add_to(self, parser) -> None:
        """Declare it on an argparse parser (or argument group)."""
        if self.action == "store_false":
            parser.add_argument(self.flag, dest=self.dest, action="store_false", help=self.help)
            return
        extra = {"nargs": "+"} if self.action == "extend" else {"nargs": "?", "const": self.const} if self.const is not None else {}
        extra.update({"type": self.type} if self.type is not None else {}, **({"choices": self.choices} if self.choices is not None else {}))
        parser.add_argument(self.flag, dest=self.dest, action=self.action, default=[] if self.action == "append" else self.default,
                            metavar=self.metavar, help=self.help, **extra)

    def written(self, value: Any) -> list[str]:
        """This option as a command line gives `value`: nothing for its default."""
        if self.action == "store_false":
            return [self.flag] if value is False else []
        if value is None or (value == self.default and not self.listed):
            return []
        if self.action == "append":
            return [part for text in (self.texts(value) if self.texts is not None else value) for part in (self.flag, str(text))]
        if self.action == "extend":
            return [self.flag, *(str(v) for v in ([value] if isinstance(value, (int, float)) else value))]
        return [self.flag, str(value)]


def _generated_inputs(settings) -> bool:
    """Random inputs are made (none given, no prompts): the options that shape them count."""
    return settings.inputs is None and settings.prompts is None


def _verifying(settings) -> bool:
    return settings.verify


def _shape_texts(shapes) -> list[str]:
    """--input-shapes as given, or as `accudiff.compare(input_shapes={name: dims})` gives them."""
    return [f"{name}:{'x'.join(map(str, dims))}" for name, dims in shapes.items()] if isinstance(shapes, dict) else list(shapes)


# In the order a replayed command writes them (after the model and its precision flag, or the candidate model).
RUN_OPTIONS = (
    RunOption("--candidate", "candidate", "backend that runs the candidate (default: auto)", choices=CANDIDATES, default="auto"),
    RunOption("--candidate-model", "candidate_model",
              "a candidate made from the model by another tool (ModelOpt, ONNX Runtime's quantizer, a converter): compared as it is",
              metavar="FILE", replayed=False),
    RunOption("--load-inputs", "inputs", "inputs from .npz, polygraphy's --save-inputs JSON or (a model of one input) .npy, instead of random data", metavar="FILE"),
    RunOption("--calib-data", "calib_data", "INT8 calibration samples (.npz, polygraphy JSON or, for a model of one input, .npy; a decoder's: prompts, as --prompts takes them)", metavar="FILE"),
    RunOption("--prompts", "prompts", "a decoder's prompts: text (.txt, one a line; .jsonl) tokenized with the model's tokenizer.json, or token ids (.npz)",
              metavar="FILE"),
    RunOption("--new-tokens", "new_tokens", "decode steps after each prompt's prefill, each side carrying its own KV cache (default 16)", type=int, metavar="N"),
    RunOption("--seed", "seed", "seed of the random inputs (default 0)", type=int, default=0),
    RunOption("--input-shapes", "input_shapes", "shape of an input with dynamic dimensions, e.g. x:1x3x224x224 (repeatable)", action="append",
              metavar="NAME:DIMS", written_when=_generated_inputs, texts=_shape_texts),
    RunOption("--val-range", "val_range", "range of random input values (default 0,1; repeatable)", action="append", metavar="[NAME:]LO,HI",
              written_when=_generated_inputs),
    RunOption("--iterations", "iterations", "number of random input samples (default 1)", type=int, default=1, written_when=_generated_inputs),
    RunOption("--keep-fp32", "keep_fp32", "keep matching nodes in FP32 / unquantized (repeatable)", action="append", metavar="NODE|OP|REGEX"),
    RunOption("--no-autokeep", "autokeep", "also convert nodes whose constants exceed the FP16 range", action="store_false"),
    RunOption("--atol", "atol", "absolute tolerance, default and per tensor", action="extend", metavar="[NAME:]VALUE"),
    RunOption("--rtol", "rtol", "relative tolerance, default and per tensor", action="extend", metavar="[NAME:]VALUE"),
    RunOption("--stol", "stol", "tolerance as a fraction of the tensor's reference absmax", action="extend", metavar="[NAME:]VALUE"),
    RunOption("--threshold", "threshold", "where a probability map's elements are binarized, for its flipped share and IoU (default 0.5), or a detector's "
              "class scores count as a detection (default 0.25)",
              action="extend", metavar="[OUTPUT:]VALUE"),
    RunOption("--max-memory", "max_memory", "memory the compared tensors may take, e.g. 512M or 4G (default: 256M, or a quarter of the free memory "
              "if less); larger models are compared segment by segment", metavar="SIZE"),
    RunOption("--workers", "workers", "split the samples over N worker processes or Ray tasks (default: a dataset with 4 samples per core gets one "
              "per core, else 1; with --ray, one per CPU of the cluster)", type=int, metavar="N"),
    RunOption("--ray", "ray", "run the workers as Ray tasks: 'local' (the default) starts a local cluster, an address joins one",
              metavar="ADDRESS", const="local"),
    RunOption("--also", "also", "run the same transformed model on a second backend too (three-way table)", choices=SIDE_BACKENDS, compare_only=True),
    RunOption("--load-candidate", "load_candidate", "the candidate's tensors from polygraphy run ... --save-outputs FILE (give --load-inputs too)",
              type=Path, metavar="FILE", compare_only=True, group=CAPTURED_GROUP),
    RunOption("--load-reference", "load_reference", "the reference's tensors from such a file, instead of running it", type=Path, metavar="FILE",
              compare_only=True, group=CAPTURED_GROUP),
    RunOption("--candidate-runner", "candidate_runner", "the runner to read when the file holds several", metavar="NAME", compare_only=True,
              group=CAPTURED_GROUP),
    RunOption("--objective", "objective", "what judges a keep at the outputs: the tolerance ratio, or the decision (top-1 agreement, a map's flipped share)",
              choices=OBJECTIVES, default="tolerance"),
    RunOption("--require", "require", "a decision target an output must meet instead of its tolerance, e.g. top1=0.97, kl=0.01, cosine_min=0.99, "
              "flipped_share=1e-3 or detections=0.95 (repeatable)", action="append", metavar="FIGURE=VALUE"),
    RunOption("--output-kind", "output_kind", "what a graph output is, where the graph does not say: logits, probabilities, embedding, map or values "
              "(repeatable)", action="append", metavar="NAME=KIND"),
    RunOption("--no-isolate", "isolate", "skip the run that measures each node's own error (faster; the cause is then named only from range evidence)",
              action="store_false", compare_only=True),
    RunOption("--no-verify", "verify", "skip testing each suspect at the failing outputs (the cause is then the rules' hypothesis, not verified)",
              action="store_false", compare_only=True),
    RunOption("--verify-budget", "verify_budget", f"candidate runs per failing output to try the rules' suspects alone and confirm the repair "
              f"(default {DEFAULT_VERIFY_BUDGET})", type=int, metavar="N", default=DEFAULT_VERIFY_BUDGET, compare_only=True, written_when=_verifying),
    RunOption("--cause-budget", "cause_budget", f"candidate runs per failing output to search every other node the candidate changes, in groups, for one "
              f"that repairs it alone (default {DEFAULT_CAUSE_BUDGET})", type=int, metavar="N", default=DEFAULT_CAUSE_BUDGET, compare_only=True,
              written_when=_verifying),
    RunOption("--trt-module", "trt.module", "TensorRT package to use (default: the first importable)", choices=MODULES, group=TRT_GROUP),
    RunOption("--trt-mark", "trt.mark", "what to observe: all layer outputs, unfused debug tensors, or graph outputs", choices=MARK_MODES, default="auto",
              group=TRT_GROUP),
    RunOption("--trt-legacy-precision", "trt.legacy_precision", "TensorRT 10 only: weakly typed FP16/INT8 builder flags", choices=LEGACY_PRECISIONS,
              group=TRT_GROUP),
    RunOption("--trt-workspace", "trt.workspace_mb", "builder workspace limit", type=int, metavar="MB", group=TRT_GROUP),
    RunOption("--engine", "trt.engine", "compare this pre-built TensorRT engine (graph outputs only)", type=Path, metavar="PLAN", group=TRT_GROUP),
    RunOption("--save-reference", "save_reference", "write the reference's tensors as RunResults JSON (polygraphy --load-outputs reads it)", type=Path,
              metavar="FILE", compare_only=True, group=CAPTURED_GROUP, replayed=False),
    RunOption("--save-candidate", "save_candidate", "write the candidate's tensors as RunResults JSON", type=Path, metavar="FILE", compare_only=True,
              group=CAPTURED_GROUP, replayed=False),
)
COMPARE_ONLY = tuple(option.keyword for option in RUN_OPTIONS if option.compare_only)


def replayed_arguments(settings, command: str = "compare") -> list[str]:
    """Every option of `settings` as the command line that gives it (`command` "bisect": without what only
    compare takes), in RUN_OPTIONS' order; defaults are not written."""
    args = []
    for option in RUN_OPTIONS:
        if not option.replayed or (command == "bisect" and option.compare_only):
            continue
        if option.written_when is None or option.written_when(settings):
            field, _, inner = option.keyword.partition(".")
            value = getattr(settings, field)
            args += option.written(getattr(value, inner) if inner else value)
    return args
