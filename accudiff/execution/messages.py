"""The messages that cross the process boundary between a run and its workers (local processes or Ray
tasks): a job, and the passes it runs. Plain dataclasses with one JSON form each (`Job.to_json`,
`Job.from_json`), so a renamed field fails where the message is made, not in another process.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from accudiff.memory import HUGE_PAGES_FROM_TENSOR_BYTES


@dataclass(frozen=True)
class PassSpec:
    """One pass of a job: a model run beside the reference, and how."""

    name: str  # "candidate", "isolated", another backend's name, or a trial's "variant<k>"
    model: str
    backend: str  # "onnxrt", "trt", or "recorded" (tensors captured elsewhere, replayed)
    fed_from_reference: dict[str, str] = field(default_factory=dict)  # input -> the reference tensor it is fed (the isolated run)
    layer_report: bool = False  # TensorRT: ask the engine which layers ran in which format
    samples: int | None = None  # it runs on the samples numbered below this (None: all)
    runs: int | None = None  # how many of the run's samples it compares: its sessions are sized for them (None: all)
    record: str | None = None  # a store folder its tensors are recorded into (--save-candidate)
    recorded: str | None = None  # backend "recorded": the store folder of the captured tensors
    label: str | None = None  # backend "recorded": what captured them, as said in messages
    fixed_inputs: dict[str, bool] = field(default_factory=dict)  # a switchboard's switches for this keep-list
    reuse: bool = False  # its sessions stay open for the worker's next job (a switchboard tried again with other switches)


@dataclass
class Job:
    """Everything a worker needs, as plain data (it crosses a process or machine boundary as JSON)."""

    reference: str
    passes: list[PassSpec]
    precision: str
    tensors: list[str]
    outputs: list[str]
    segments: list[list[str]]
    tolerances: dict
    quant_ranges: dict[str, dict]  # tensor -> its QuantRange's fields
    samples: list[list[str]]  # this worker's samples: [file, key prefix] (model/samples.py)
    sample_indices: list[int]  # their positions among all samples
    result: str  # where the worker writes its result (<result>.npz and <result>.json)
    trt: dict = field(default_factory=dict)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    shape_values: dict[str, list[int]] = field(default_factory=dict)  # small integer inputs: TensorRT's shape-tensor inputs
    store: str | None = None  # a reference store folder to replay (when complete) or record
    layer_report: str | None = None
    inputs: list[str] = field(default_factory=list)  # graph inputs whose ranges the diagnosis needs
    input_specs: list[list] = field(default_factory=list)  # [name, dtype, shape]: each sample is checked as it is read
    threads: int = 0  # cores this worker may use (0: all); several workers on one machine share them
    # How its ONNX Runtime sessions are made is the same in every worker of a run, whatever the split: an
    # unoptimized session's convolutions and matrix products round by thread count, and an optimized one
    # otherwise than an unoptimized one, so the table would depend on --workers.
    run_samples: int = 0  # samples the whole run compares, over every worker (0: this job's)
    outputs_store: str | None = None  # a store folder where the reference's graph outputs are recorded
    largest_tensor: int = 0  # bytes: how the worker gets memory (memory.py; group.Plan)
    thresholds: dict[str, float] = field(default_factory=dict)  # a probability map's threshold by output ("": the default)
    output_kinds: dict[str, list] = field(default_factory=dict)  # graph output -> [its kind, the axis its entries run along]
    # A decoder's generation (execution/generation.py): {"decoder": Decoder.as_json(), "new_tokens": N, "cache_types": {past: dtype}};
    # its samples are then prompts, each run as a prefill and N decode steps, each step a sample of the engine.
    generation: dict | None = None
    # Sessions made one at a time, each just before its run (else all at once, kept for every sample): weights
    # of a model too large to hold twice (trial.LARGE_MODEL_BYTES).
    one_session_at_a_time: bool = False
    # Model files made by another tool, checked first to load in ONNX Runtime as they are (a candidate accudiff
    # then aligns and runs in its own form must never stand in for a file ONNX Runtime refuses).
    validate: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.passes = [p if isinstance(p, PassSpec) else PassSpec(**p) for p in self.passes]  # as read from JSON

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls(**json.loads(text))

    @property
    def large_tensors(self) -> bool:
        """Fresh memory is then what a run costs: huge pages, and one arena for all sessions."""
        return self.largest_tensor >= HUGE_PAGES_FROM_TENSOR_BYTES
