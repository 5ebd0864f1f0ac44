"""Values a transform computes (a quantized weight dequantized) written to a data file as they are made: a
model refers to them there, so none is held in memory beside the model, and a value asked for again (the
same weight in the next variant) is the one already written."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from accudiff.model.weights import refer_to


class ValueFile:
    """A data file in `folder` that computed values are appended to, each once per key."""

    def __init__(self, folder: Path, name: str = "computed-values.data"):
        self.folder, self.name = Path(folder), name
        self._written: dict[str, onnx.TensorProto] = {}

    def value(self, key: str, name: str, compute: Callable[[], np.ndarray]) -> onnx.TensorProto:
        """A reference, named `name`, to the value `compute` makes for `key` (computed and written the first
        time it is asked for)."""
        if key not in self._written:
            values = np.ascontiguousarray(compute())
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / self.name, "ab") as data:
                offset = data.tell()
                data.write(memoryview(values).cast("B"))
            tensor = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(values.dtype), dims=values.shape)
            refer_to(tensor, self.name, offset, values.nbytes, self.folder)
            self._written[key] = tensor
        reference = onnx.TensorProto()
        reference.CopyFrom(self._written[key])
        reference.name = name
        return reference
