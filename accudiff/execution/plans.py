"""What the comparison engine is asked to do (engine.py): the reference side, the candidate passes, what is
measured and how the machine is spent. Plain data: the worker builds them from its job."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from accudiff.execution.messages import POINTS_PER_OUTPUT
from accudiff.judging.output_kinds import OutputKind
from accudiff.judging.tolerances import Tolerances
from accudiff.model.formats import QuantRange
from accudiff.model.source import ModelSource
from accudiff.runners.base import Runner
from accudiff.model.stores import ReferenceStore

Progress = Callable[[str], None]
RunnerFactory = Callable[[ModelSource, list[str]], Runner]  # (model, tensors to return) -> runner


@dataclass
class PassPlan:
    """One candidate pass: a model to run segment by segment, and its inputs fed from the reference."""

    name: str  # "candidate", "isolated", or a second backend's name
    model: Path
    make_runner: RunnerFactory
    fed_from_reference: dict[str, str] = field(default_factory=dict)  # input -> the reference tensor it is fed
    record: ReferenceStore | None = None  # where its tensors are kept, when the user asked to save them
    fixed_inputs: dict[str, np.ndarray] = field(default_factory=dict)  # inputs of the pass's own (a switchboard's switches)
    samples: int | None = None  # it runs on the samples numbered below this (None: on every sample)


@dataclass(frozen=True)
class Measured:
    """What the engine measures: the compared tensors (and which are graph outputs), the segments that
    produce them (the original model's node names per segment), how they are judged, and the graph inputs
    whose ranges the diagnosis needs (an input beyond FP16 or outside its INT8 range)."""

    tensors: Sequence[str]
    outputs: Sequence[str]
    segments: Sequence[Sequence[str]]
    tolerances: Tolerances
    quant_ranges: Mapping[str, QuantRange]
    inputs: Sequence[str] = ()
    thresholds: Mapping[str, float] = field(default_factory=dict)  # a probability map's threshold: by output, "" the default
    kinds: Mapping[str, OutputKind] = field(default_factory=dict)  # what each graph output decides (output_kinds.py)


@dataclass(frozen=True)
class ReferencePlan:
    """The reference side: its model, how its runner is made, and its stores. `store`: reference outputs
    recorded earlier (then replayed, and the reference never runs) or to record now. `outputs_store`: where
    its graph outputs are recorded (verification replays them instead of running the reference again)."""

    model: Path
    make_runner: RunnerFactory
    store: ReferenceStore | None = None
    outputs_store: ReferenceStore | None = None


@dataclass(frozen=True)
class EngineOptions:
    """How the engine spends the machine. `threads`: the cores a pass's tensors are reduced on.
    `keep_sessions`: every runner is activated at once and kept for every sample; else (one sample:
    nothing to reuse) each is activated while the one before it runs (or, past AHEAD_UP_TO_BYTES of
    weights, just before its own run, so one backend's copy of the weights is in memory at a time) and
    deactivated after its run. (Arrays a runner returned outlive its deactivation: ONNX Runtime's and
    TensorRT's are the process's own, a recorded runner's deactivation does nothing.) `points`: the
    (reference, candidate) pairs of each graph output kept for plots (verification's trials keep none).
    `sessions_at_once`: with every session kept, how many may run at once, each on `threads` cores: a pass
    that reads nothing the reference makes in a segment runs beside it (see Engine.run_sample)."""

    threads: int = 1
    keep_sessions: bool = True
    sessions_at_once: int = 1
    progress: Progress = lambda step: None
    points: int = POINTS_PER_OUTPUT
