"""What a runner is given to run: a model file, or a model already in memory that no file may hold.

A comparison runs every segment of every pass (model/segments.py) in a worker, which cuts them from the
pass's model. Saving each segment only for a backend to read it back (and save it again, marked) cost more
than the runs on the PP-OCRv4 recognizer. So a segment stays in memory, its large weights in their data
files (each carries its folder, model/weights.py), until its runner takes it (ONNX Runtime gets the graph
as bytes, runners/onnxrt.py); a model the worker read whole is handed over the same way instead of being
read twice. A backend that reads files (TensorRT) asks for `file()`, and a segment is saved then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx

from accudiff.model.graph import tensor_bytes

from accudiff.model.loading import load_graph

from accudiff.model.saving import save_model
from accudiff.model.weights import is_external

# A model made or read in memory that holds weights of its own (not in data files) up to this size stays
# there until its runner takes it; one holding more is saved, its weights in a side file. Every pass of a
# one-sample comparison holds its segments until their runs.
IN_MEMORY_WEIGHTS_UP_TO = 64 << 20


@dataclass
class ModelSource:
    """The model at `path`; `held`: the model itself, already in memory (then `path` is where it goes if
    a backend needs a file), handed over to the first caller of `take` instead of being read again."""

    path: Path
    held: onnx.ModelProto | None = None
    pending: Callable[[], onnx.ModelProto] | None = None  # makes the model when it is first needed (see `later`)

    @classmethod
    def cut(cls, proto: onnx.ModelProto, path: Path) -> ModelSource:
        """A model made in memory: held, or saved at `path` now when its own weights are large."""
        if own_weight_bytes(proto) < IN_MEMORY_WEIGHTS_UP_TO:
            return cls(Path(path), proto)
        save_model(proto, path, side_file=True)
        return cls(Path(path))

    @classmethod
    def later(cls, make: Callable[[], onnx.ModelProto], path: Path) -> ModelSource:
        """A model made in memory by `make` when its runner first asks for it (a segment cut while the
        segment before it runs); `make` must give one whose own weights are small (see `cut`)."""
        return cls(Path(path), pending=make)

    @classmethod
    def read(cls, path: Path, proto: onnx.ModelProto) -> ModelSource:
        """The model file at `path`, which the caller read as `proto`: held when its own weights are small."""
        return cls(Path(path), proto if own_weight_bytes(proto) < IN_MEMORY_WEIGHTS_UP_TO else None)

    def take(self) -> onnx.ModelProto:
        """The model, for the caller to change: the one held (handed over once: a runner takes its model
        when it is activated, once), else read from `path`, its large weights left in their files."""
        self._make_pending()
        if self.held is not None:
            proto, self.held = self.held, None
            return proto
        return load_graph(self.path)

    def file(self) -> Path:
        """The model as a file: `path`, saved now (its weights copied beside it) if only memory held it."""
        self._make_pending()
        if self.held is not None and not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_model(self.held, self.path, side_file=True)
        return self.path

    def _make_pending(self) -> None:
        if self.pending is not None:
            self.held, self.pending = self.pending(), None


def own_weight_bytes(proto: onnx.ModelProto) -> int:
    """Bytes of the weights a model holds itself, rather than in data files."""
    return sum(tensor_bytes(init) for init in proto.graph.initializer if not is_external(init))
