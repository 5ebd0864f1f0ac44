"""What the user asked for one run, validated once. `accudiff.compare`'s keywords, the CLI's options and the
pytest plugin all become one `RunSettings`; `arguments()` writes it back as the command line that runs it
again. The stages are handed its small values, each only those it reads: `Compared` (what is compared and
how the candidate is made and run), `Judging` (tolerances, thresholds, objective, output kinds),
`Diagnosing` (isolation, verification and its budgets), `Running` (memory, workers, Ray) and `Captures`
(tensors read from elsewhere, or saved)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from difflib import get_close_matches
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from accudiff.judging.objective import Objective, parse_requirements
from accudiff.judging.output_kinds import parse_output_kinds
from accudiff.judging.tolerances import Tolerances, parse_named_values
from accudiff.errors import AccudiffError, missing
from accudiff.model.decoder import find_decoder, model_file
from accudiff.model.formats import QUANTIZED_FORMATS, file_formats, formats_of, is_precision_label, model_formats, onnxruntime_only_ops, precision_label
from accudiff.model.segments import memory_budget
from accudiff.run_options import DEFAULT_CAUSE_BUDGET, DEFAULT_VERIFY_BUDGET, SIDE_BACKENDS, replayed_arguments
from accudiff.runners import TrtOptions, resolve_candidate
from accudiff.transforms import NodeSelector
from accudiff.transforms.candidate import CandidateRecipe

if TYPE_CHECKING:
    from accudiff.model.inputs import Feed
    from accudiff.model.samples import Samples
    from accudiff.model.inventory import ModelInfo

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
PRECISION_FLAGS = {"fp16": "--fp16", "bf16": "--bf16", "int8": "--int8"}
DEFAULT_NEW_TOKENS = 16  # a decoder's decode steps after each prompt's prefill (execution/generation.py)


@dataclass(frozen=True)
class Compared:
    """What is compared: the model, the precision its candidate computes in, how the candidate is made
    (`recipe`), the backend that runs it (and `also`, a second one beside it) and how TensorRT builds it."""

    model: Path
    precision: str
    candidate_model: Path | None
    given_alone: bool  # the model is its own candidate: the reference is its float form
    recipe: CandidateRecipe
    backend: str  # "onnxrt", "trt", or "recorded" (captured elsewhere)
    also: str | None
    trt: TrtOptions

    def recipe_for(self, calibration: Samples | None) -> CandidateRecipe:
        """The recipe, calibrated on `calibration` where it is given (a branch group's own samples)."""
        return self.recipe if calibration is None else replace(self.recipe, calib_data=calibration)


@dataclass(frozen=True)
class Judging:
    """How the outputs are judged: tolerances, where a probability map is binarized ("" the default), what
    judges a keep (the tolerance, or required decision figures) and the kinds the user gave outputs."""

    tolerances: Tolerances
    thresholds: dict[str, float]
    objective: Objective
    output_kinds: dict[str, str]


@dataclass(frozen=True)
class Diagnosing:
    """How causes are sought: the isolated run, and verification with its budgets (runs per failing output)."""

    isolate: bool
    verify: bool
    verify_budget: int
    cause_budget: int


@dataclass(frozen=True)
class Running:
    """How the runs are spread: the memory the compared tensors may take, the workers, Ray."""

    max_memory: int | str | None
    workers: int | None
    ray: str | None


@dataclass(frozen=True)
class Captures:
    """Tensors captured elsewhere, read instead of a run, and where this run's tensors are saved."""

    load_candidate: Path | None
    load_reference: Path | None
    candidate_runner: str | None
    save_reference: Path | None
    save_candidate: Path | None


def settings_of(model: str | Path, precision: str, options: Mapping[str, object], call: str = "compare()") -> RunSettings:
    """The settings of a Python call (`call`: compare(), a bisector, the pytest plugin's checks) given these
    keywords. A keyword RunSettings has no field for is one sentence naming it and the call (and the nearest
    field), not RunSettings' own TypeError, which names neither."""
    known = {f.name for f in fields(RunSettings) if f.init} - {"model", "precision"}
    for name in options:
        if name not in known:
            near = get_close_matches(name, sorted(known), n=1)
            raise AccudiffError(f"{call} takes no option '{name}'" + (f": did you mean {near[0]}=?" if near else ""))
    return RunSettings(model, precision, **options)


@dataclass(frozen=True)
class RunSettings:
    """One comparison, as asked.

    Inputs come from `inputs` (an .npz file, a folder of them, a polygraphy JSON file, or a list of feeds;
    files are read one sample at a time) or are generated from `seed` and `val_range` (shapes of dynamic
    inputs from `input_shapes`) for `iterations` iterations. INT8 calibrates on `calib_data` (random
    samples from `seed` otherwise). `keep_fp32` names nodes, op types or regexes left in FP32; `autokeep`
    also keeps nodes whose constants exceed FP16's range. Tolerances are a default and per-tensor
    values ("NAME:VALUE"). With `report_dir`, the report folder is written there atomically.
    `isolate` adds, for every tensor, the error its node makes when fed the reference's values (one extra
    candidate run): without it a cause can be named only from range evidence. `verify` tests every
    suspect at the failing outputs (the candidate run again with it kept in higher precision, graph
    outputs only, at most `verify_budget` runs per failing output). `also` runs the same transformed
    model on a second backend (columns `<also>_*`). `max_memory` (bytes, or a size such as "2G") bounds
    the memory the compared tensors take. `workers` splits the samples over worker processes; `ray`
    runs them as Ray tasks ("local" starts a cluster, an address joins one).
    `load_candidate` / `load_reference` take the candidate's / reference's tensors from a polygraphy
    RunResults file (`polygraphy run ... --save-outputs`; `candidate_runner` picks one runner of several)
    instead of running them: a TensorRT run from another machine is compared here, against an FP32 run on
    the inputs it was made from. `save_reference` / `save_candidate` write this run's tensors as such a file.
    `candidate_model` is a candidate made by another tool (quantized by ModelOpt or ONNX Runtime, converted
    to FP16...) from `model`: the formats it stores values in become the run's precision ("int8+fp16"). A
    model that itself stores values narrow, compared without a precision flag, is its own candidate, against
    its float form. `model` and `candidate_model` may be folders the ONNX Runtime GenAI model builder wrote
    (model/decoder.py): each stands for the model its genai_config.json names.
    A decoder language model is compared on `prompts` (text, or token ids; model/prompts.py) as it is
    deployed: each prompt's prefill, then `new_tokens` decode steps (default DEFAULT_NEW_TOKENS), each side
    carrying its own KV cache (execution/generation.py).
    """

    model: str | Path
    precision: str = "fp32"
    candidate: str = "auto"
    input_shapes: Iterable[str] | dict[str, tuple[int, ...]] = ()
    inputs: str | Path | Sequence[Feed] | None = None
    seed: int = 0
    val_range: Iterable[str] = ()
    iterations: int = 1
    calib_data: str | Path | None = None
    keep_fp32: Sequence[str] = ()
    autokeep: bool = True
    atol: Iterable[str] | float | None = None
    rtol: Iterable[str] | float | None = None
    stol: Iterable[str] | float | None = None
    report_dir: str | Path | None = None
    trt: TrtOptions = field(default_factory=TrtOptions)
    isolate: bool = True
    verify: bool = True
    verify_budget: int = DEFAULT_VERIFY_BUDGET
    cause_budget: int = DEFAULT_CAUSE_BUDGET
    also: str | None = None
    max_memory: int | str | None = None
    workers: int | None = None
    ray: str | None = None
    load_candidate: str | Path | None = None
    load_reference: str | Path | None = None
    candidate_runner: str | None = None
    save_reference: str | Path | None = None
    save_candidate: str | Path | None = None
    candidate_model: str | Path | None = None
    threshold: Iterable[str] | float | None = None
    objective: str = "tolerance"
    require: Sequence[str] = ()
    output_kind: Sequence[str] = ()
    prompts: str | Path | Sequence | None = None  # a file, or from Python a list of prompts (model/prompts.py)
    new_tokens: int | None = None

    def __post_init__(self) -> None:
        """Checks that need no model; `check_against` does the rest once the model is loaded."""
        object.__setattr__(self, "model", model_file(Path(self.model)) if Path(self.model).is_dir() else self.model)
        if self.candidate_model is not None and Path(self.candidate_model).is_dir():
            object.__setattr__(self, "candidate_model", model_file(Path(self.candidate_model)))
        for name in ("keep_fp32", "val_range", "input_shapes", "atol", "rtol", "stol", "threshold", "require", "output_kind"):  # lists and tuples alike compare equal
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, int, float, dict)):
                object.__setattr__(self, name, tuple(value))
        self._resolve_candidate_model()
        if self.precision not in PRECISIONS and not (self.candidate_model is not None and is_precision_label(self.precision)):
            raise AccudiffError(f"unknown precision '{self.precision}'; choose one of: {', '.join(PRECISIONS)}")
        if self.iterations < 1:
            raise AccudiffError("--iterations must be at least 1")
        if self.workers is not None and self.workers < 1:
            raise AccudiffError("--workers must be at least 1")
        if self.seed < 0:
            raise AccudiffError("--seed must be 0 or more")
        if self.max_memory is not None:
            memory_budget(self.max_memory)  # a malformed size is an error now, not after the model is loaded
        if self.verify and self.verify_budget < 1:
            raise AccudiffError("--verify-budget must be at least 1 (or pass --no-verify)")
        if self.verify and self.cause_budget < 0:
            raise AccudiffError("--cause-budget must be 0 or more (0: only the rules' suspects are tried)")
        if self.also is not None and self.also not in SIDE_BACKENDS:
            raise AccudiffError(f"--also takes {' or '.join(SIDE_BACKENDS)}, not '{self.also}'")
        self.tolerances  # noqa: B018 - a malformed tolerance is an error now, not after the runs
        self.thresholds  # noqa: B018 - likewise a threshold
        self.judging  # noqa: B018 - and an objective or a requirement
        self.output_kinds  # noqa: B018 - and an output's kind
        self._check_generation()  # first: with prompts, a captured file's other needs (--load-inputs) cannot be met either
        self._check_captured()
        if self.inputs is not None:
            ignored = [flag for flag, given in (("--input-shapes", self.input_shapes), ("--val-range", self.val_range), ("--iterations", self.iterations != 1)) if given]
            if ignored:
                raise AccudiffError(f"{' and '.join(ignored)} shape random inputs, and the inputs --load-inputs gives have their own shapes and values: "
                                    f"{'it' if len(ignored) == 1 else 'they'} would be ignored")

    def _check_generation(self) -> None:
        """Prompts go with nothing that gives the model other inputs, or the candidate's tensors from elsewhere."""
        if self.prompts is None:
            if self.new_tokens is not None:
                raise AccudiffError("--new-tokens sets the decode steps after each prompt: it needs --prompts")
            return
        if self.new_tokens is not None and self.new_tokens < 0:
            raise AccudiffError("--new-tokens must be 0 or more")
        for given, flag in ((self.inputs, "--load-inputs"), (self.load_candidate, "--load-candidate"), (self.load_reference, "--load-reference"),
                            (self.save_reference, "--save-reference"), (self.save_candidate, "--save-candidate"), (self.trt.engine, "--engine")):
            if given is not None:
                raise AccudiffError(f"--prompts generates from each prompt, each side carrying its own KV cache: {flag} cannot go with it")
        if self.iterations != 1 or self.val_range or self.input_shapes:
            raise AccudiffError("--prompts gives the decoder its inputs: --iterations, --val-range and --input-shapes would be ignored")

    # The small values each stage is handed: a stage reads only the ones it needs.

    @cached_property
    def compared(self) -> Compared:
        given = Path(self.candidate_model) if self.candidate_model is not None else None
        recipe = CandidateRecipe(self.precision, tuple(self.keep_fp32), self.autokeep, self.calib_data, self.seed, self.trt.engine, given)
        return Compared(Path(self.model), self.precision, given, self.given_alone, recipe, self.backend[0], self.also, self.trt)

    @cached_property
    def judging(self) -> Judging:
        objective = Objective(self.objective, parse_requirements(self.require))  # how verification and bisect precision judge a keep
        return Judging(self.tolerances, self.thresholds, objective, self.output_kinds)

    @property
    def diagnosing(self) -> Diagnosing:
        return Diagnosing(self.isolate, self.verify, self.verify_budget, self.cause_budget)

    @property
    def running(self) -> Running:
        return Running(self.max_memory, self.workers, self.ray)

    @property
    def captures(self) -> Captures:
        paths = [Path(p) if p is not None else None for p in (self.load_candidate, self.load_reference, self.save_reference, self.save_candidate)]
        return Captures(paths[0], paths[1], self.candidate_runner, paths[2], paths[3])

    def fed(self, inputs: str | Path | Sequence[Feed], **changes) -> RunSettings:
        """These settings (with `changes`) given `inputs`: the options that shape random inputs go with them, and
        a decoder's prompts (the inputs are what it is fed: a prompt's whole sequence, or a cut's values)."""
        return replace(self, **{"input_shapes": (), "val_range": (), "iterations": 1, "prompts": None, "new_tokens": None, **changes, "inputs": inputs})

    @property
    def decode_steps(self) -> int:
        """A decoder's decode steps after each prompt's prefill."""
        return DEFAULT_NEW_TOKENS if self.new_tokens is None else self.new_tokens

    def _check_captured(self) -> None:
        """Tensors captured elsewhere: what goes with them, and what cannot. A candidate that ran elsewhere
        cannot run again here, so isolation is off; with --fp16/--int8, the ONNX Runtime candidate of that
        precision runs beside it (does the model fail in that precision, or only the captured engine?) and
        stands in for it when causes are verified."""
        if self.candidate_runner is not None and self.load_candidate is None and self.load_reference is None:
            raise AccudiffError("--candidate-runner picks a runner of a --load-candidate or --load-reference file; neither was given")
        if self.load_candidate is None:
            return
        if self.inputs is None:
            raise AccudiffError("--load-candidate needs the inputs its file was made from: give them with --load-inputs (polygraphy's --save-inputs JSON, or .npz)")
        if self.candidate != "auto" or self.trt.engine is not None:
            raise AccudiffError("--load-candidate gives the candidate's tensors: --candidate and --engine would give another candidate")
        if self.save_candidate is not None:
            raise AccudiffError("--save-candidate with --load-candidate would only copy the file it reads")
        object.__setattr__(self, "isolate", False)
        if self.also is None and self.precision != "fp32":
            object.__setattr__(self, "also", "onnxrt")

    def _resolve_candidate_model(self) -> None:
        """A candidate made by another tool: what goes with it, and the precision it computes in. A model
        that stores values narrow itself (Q/DQ pairs, FP16/BF16), with no precision flag, is that candidate."""
        if self.candidate_model is None and self.precision == "fp32" and self.load_candidate is None and self.trt.engine is None:
            if file_formats(self.model):
                object.__setattr__(self, "candidate_model", self.model)
        if self.candidate_model is None:
            return
        if not Path(self.candidate_model).is_file():
            raise missing(self.candidate_model, f"candidate model file '{self.candidate_model}'")
        for given, what in ((self.load_candidate, "--load-candidate gives its tensors"), (self.trt.engine, "--engine gives a built engine"),
                            (self.calib_data, "--calib-data calibrates an INT8 candidate accudiff would make")):
            if given is not None:
                raise AccudiffError(f"--candidate-model gives the candidate, made by another tool: {what}, which is another one")
        if not self.autokeep:
            raise AccudiffError("--no-autokeep changes how accudiff converts a model to FP16; a candidate model (--candidate-model) is compared as it was made")
        label = precision_label(file_formats(self.candidate_model))
        if self.given_alone and label == "fp32":
            raise AccudiffError(
                f"'{Path(self.model).name}' is given as its own candidate, and it stores no value in a narrower format: it is its own float form, "
                f"so there is nothing to compare; give the precision to convert it to (--fp16, --bf16, --int8) or the model another tool made of it (--candidate-model)")
        if self.given_alone and all(f.endswith("-weight") for f in formats_of(label)):
            raise AccudiffError(
                f"'{Path(self.model).name}' quantizes only its weights ({label}): given alone, its float form would hold the same rounded weights, "
                f"so the comparison would measure none of that rounding; compare the float model it was made from against it "
                f"(accudiff compare float.onnx --candidate-model {Path(self.model).name})")
        if self.precision not in ("fp32", label):
            raise AccudiffError(
                f"--candidate-model gives the candidate, made by another tool: --{self.precision} would make another one "
                f"(the formats it stores values in, {label}, are read from it)"
            )
        object.__setattr__(self, "precision", label)

    @cached_property
    def thresholds(self) -> dict[str, float]:
        """Where a probability map's elements are binarized (`--threshold [NAME:]VALUE`): by output, "" for
        the default (decisions.py; 0.5 when not given)."""
        default, named = parse_named_values("threshold", self.threshold)
        for name, value in [("", default), *named.items()]:
            if value is not None and not 0 < value < 1:
                raise AccudiffError(f"--threshold {f'{name}:' if name else ''}{value:g} is not between 0 and 1: a probability map's elements would all fall on one side")
        return {**({"": default} if default is not None else {}), **named}

    @cached_property
    def output_kinds(self) -> dict[str, str]:
        """The kinds the user gave outputs (`--output-kind NAME=KIND`; judging/output_kinds.py)."""
        return parse_output_kinds(self.output_kind)

    @property
    def given_alone(self) -> bool:
        """The model is its own candidate (it stores values narrow): the reference is its float form."""
        return self.candidate_model is not None and Path(self.candidate_model) == Path(self.model)

    @cached_property
    def tolerances(self) -> Tolerances:
        return Tolerances.build(self.precision, self.atol, self.rtol, self.stol)

    @cached_property
    def backend(self) -> tuple[str, str | None]:
        """(the backend that runs the candidate, a notice when `candidate="auto"` chose for the user);
        "recorded" for a candidate captured elsewhere."""
        if self.load_candidate is not None:
            return "recorded", None
        ours = onnxruntime_only_ops(self.candidate_model if self.candidate_model is not None else self.model)
        kind, notice = resolve_candidate(self.candidate, self.trt, self.precision, ours)
        if self.trt.engine is not None and kind != "trt":
            raise AccudiffError("--engine compares a TensorRT engine: it needs --candidate trt (or auto, where TensorRT can run)")
        return kind, notice

    @property
    def uses_trt(self) -> bool:
        return "trt" in (self.backend[0], self.also)

    def check_against(self, info: ModelInfo) -> None:
        """What can only be checked with the model: something to compare, and every keep pattern and
        per-tensor tolerance names something in it (an option that matches nothing is an error)."""
        from accudiff.model.graph import all_nodes

        if not info.tensors:
            reasons = sorted(set(info.not_observable.values()))
            raise AccudiffError(f"'{info.path.name}' computes no tensor accudiff can compare" + (f": {reasons[0]}" if reasons else ""))
        NodeSelector(self.keep_fp32).require_matches(all_nodes(info.proto.graph))
        self.tolerances.require_known_tensors({t.name for t in info.tensors})
        for option, names in (("--threshold", [name for name in self.thresholds if name]), ("--output-kind", list(self.output_kinds))):
            unknown = [name for name in names if name not in info.output_names]
            if unknown:
                raise AccudiffError(f"{option} names '{unknown[0]}', which is not a graph output of the model; its outputs are: {', '.join(info.output_names)}")
        decoder = find_decoder(info.path, info.inputs, info.output_names)
        fed_back = set(decoder.state) if decoder is not None else set()
        stated = [name for name, kind in self.output_kinds.items() if kind == "state" and name not in fed_back]
        if stated:  # nothing would judge it: a state output is judged only through the logits of the steps that read it back
            raise AccudiffError(f"--output-kind names '{stated[0]}' state, but state is a KV-cache output the next step reads back as its past, and "
                                + (f"this model's are {', '.join(sorted(fed_back))}" if fed_back else "this model carries no KV cache"))
        generated = self.prompts is None and self.inputs is None and not self.input_shapes
        if generated and not all(spec.is_static for spec in info.inputs) and decoder is not None:
            raise AccudiffError(f"'{info.path.name}' is a decoder carrying a KV cache: give it prompts with --prompts (text, one a line, tokenized "
                                "with the model's tokenizer.json; or token ids as .npz), or its inputs with --load-inputs")
        quantized = [f for f in model_formats(info.proto.graph) if f in QUANTIZED_FORMATS]
        if self.candidate_model is not None and not self.given_alone and quantized:
            raise AccudiffError(
                f"'{info.path.name}' is quantized itself ({'+'.join(quantized)}): --candidate-model compares a candidate against "
                "the float model it was made from, so give that float model first"
            )

    def target_arguments(self) -> list[str]:
        """What is compared, as command-line arguments: the model and its precision flag, or the candidate
        model made by another tool (none for a model that is its own candidate)."""
        if self.candidate_model is None:
            return [str(self.model), *([PRECISION_FLAGS[self.precision]] if self.precision in PRECISION_FLAGS else [])]
        return [str(self.model)] + ([] if self.given_alone else ["--candidate-model", str(self.candidate_model)])

    def arguments(self, command: str = "compare") -> list[str]:
        """The command-line arguments after `accudiff compare` (`command` "bisect": after `accudiff bisect
        precision`, without what only compare takes) that run this again; options left at their defaults
        are not written. Input data must be files (`inputs`, `calib_data`); the report folder is left to the
        default, so the command never collides with the folder it came from."""
        return self.target_arguments() + replayed_arguments(self, command)
