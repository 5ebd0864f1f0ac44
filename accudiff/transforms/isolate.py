"""Isolated error: what each node gets wrong by itself, when fed the reference's values.

One model does it for every node at once: in a copy of the candidate model, every read of a compared
tensor is redirected to a new graph input `<tensor>__reference`, fed with the reference's value in the
type that node reads it in (an FP16 node reads it rounded to FP16, an FP32 node reads it exact; an INT8
node reads it through its Q/DQ pair). Each node then computes from exact inputs, so its output's error is
its own, as if it alone ran in reduced precision — one extra candidate run, not one per node.
Accumulated error (the normal run) next to isolated error tells inherited error from local error.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import onnx

from accudiff.model.inputs import Feed
from accudiff.model.loading import infer_shapes_in_place

SUFFIX = "__reference"


def isolated_model(
    candidate: onnx.ModelProto, tensors: Iterable[str], storage_copies: Mapping[str, str] | None = None
) -> tuple[onnx.ModelProto, dict[str, tuple[str, np.dtype]]]:
    """The candidate with node inputs redirected to reference-fed graph inputs.

    A node reads each compared tensor as it does in the candidate: directly (in the tensor's own storage
    type), or through a copy the transform made in another type (`storage_copies`, e.g. the FP16 copy of
    a value an FP32 node produced), which is then fed from the same reference value in the copy's type.
    Returns the model and, for each new input, the reference tensor it is fed from and its dtype.
    """
    model = onnx.ModelProto()
    model.CopyFrom(candidate)
    infer_shapes_in_place(model)
    graph = model.graph
    wanted = set(tensors)
    source_of = {name: name for name in wanted}
    source_of.update({copy: source for copy, source in (storage_copies or {}).items() if source in wanted})
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.value_info, *graph.output, *graph.input]}
    fed: dict[str, tuple[str, np.dtype]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in source_of and types.get(name):
                node.input[index] = name + SUFFIX
                fed[name + SUFFIX] = (source_of[name], np.dtype(onnx.helper.tensor_dtype_to_np_dtype(types[name])))
    for name, (_, dtype) in fed.items():
        graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(dtype), None))
    return model, fed


class IsolatedFeeds(Sequence):
    """Feeds for the isolated model, made on demand from the stored reference outputs of each iteration."""

    def __init__(self, feeds: Sequence[Feed], reference: Sequence[Mapping[str, np.ndarray]], fed: Mapping[str, tuple[str, np.dtype]]):
        self._feeds, self._reference, self._fed = feeds, reference, fed

    def __getitem__(self, iteration: int) -> Feed:
        feed = dict(self._feeds[iteration])
        outputs = self._reference[iteration]
        with np.errstate(over="ignore"):  # a reference value beyond FP16 is Inf in FP16 storage, as on the device
            for name, (source, dtype) in self._fed.items():
                feed[name] = np.asarray(outputs[source], dtype=dtype)
        return feed

    def __len__(self) -> int:
        return len(self._feeds)
