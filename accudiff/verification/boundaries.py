"""Which nodes must join a keep-list before it is tried: a kept node whose output the run's half format cannot
hold brings the converted nodes that read it (they would read it in that format), and, for bisect's regions,
the readers that only move its values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import onnx

from accudiff.model.formats import FP16_MAX, formats_of
from accudiff.model.ops import VALUE_PRESERVING_OPS
from accudiff.transforms.fp16 import BF16

if TYPE_CHECKING:
    import pandas as pd

UNDERFLOW_SHARE = 0.01  # as diagnosis/rules.py: a smaller share of tiny values is noise


def unfit_for_format(table: pd.DataFrame, precision: str) -> set[str]:
    """Tensors whose reference values the run's half format cannot hold: in FP16, beyond 65504, or a
    significant share of them nonzero below its normal range (where they lose their bits or become 0); in
    BF16, beyond its largest finite value (FP32's extremes: a mask's fill)."""
    formats = formats_of(precision)
    if "fp16" in formats:
        elements = table["elements"].where(table["elements"] > 0)
        tiny = (table["below_fp16_normal"] / elements).fillna(0) >= UNDERFLOW_SHARE
        return set(table.index[(table["ref_absmax"] > FP16_MAX) | tiny])
    if "bf16" in formats:
        return set(table.index[table["ref_absmax"] > BF16.maximum])
    return set()


class Boundaries:
    """Which converted nodes must join a keep-list. A node kept in FP32 whose output the half format cannot
    hold (unfit_for_format) would break where a converted consumer reads it in that format, so that
    consumer is kept too (transitively). With `regions` (bisect precision), a kept node's converted readers
    that only move or select values (Relu, Reshape, Concat, Resize, MaxPool...) are kept with it: left
    reduced, they would round again what it computed in FP32."""

    def __init__(self, graph: onnx.GraphProto, unfit: set[str], converted: set[str], regions: bool = False):
        self.overflowing = {node.name: [o for o in node.output if o in unfit] for node in graph.node}
        self.consumers: dict[str, list[str]] = {}
        for node in graph.node:
            if node.name in converted:
                for name in node.input:
                    self.consumers.setdefault(name, []).append(node.name)
        moving = {node.name for node in graph.node if node.op_type in VALUE_PRESERVING_OPS}
        self.passed_on = {node.name: [c for o in node.output for c in self.consumers.get(o, []) if c in moving] for node in graph.node}
        self.regions = regions

    def close(self, keep: Sequence[str], regions: bool | None = None) -> list[str]:
        """`keep` and the nodes it needs; `regions` (default: as made) adds the value-moving readers too
        (pruning goes without them: a repair may hold without a reader kept for company)."""
        closed, queue = list(dict.fromkeys(keep)), list(dict.fromkeys(keep))
        regions = self.regions if regions is None else regions
        while queue:
            node = queue.pop()
            overflowing = [c for tensor in self.overflowing.get(node, []) for c in self.consumers.get(tensor, [])]
            for consumer in [*overflowing, *(self.passed_on.get(node, []) if regions else [])]:
                if consumer not in closed:
                    closed.append(consumer)
                    queue.append(consumer)
        return closed
