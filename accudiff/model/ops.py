"""What kinds of ops do to values, as the diagnosis and the keep-lists need to know."""

from __future__ import annotations

# Ops that only move, select or compare values: they add no rounding of their own, so they are never
# blamed for it (they can still be where an input stored in reduced precision overflows).
VALUE_PRESERVING_OPS = frozenset(
    {
        "ArgMax", "ArgMin", "Clip", "Compress", "Concat", "DepthToSpace", "Expand", "Flatten", "Gather",
        "GatherElements", "GatherND", "Identity", "Max", "MaxPool", "Min", "Pad", "ReduceMax", "ReduceMin",
        "Relu", "Reshape", "Resize", "ScatterElements", "ScatterND", "Slice", "SpaceToDepth", "Split", "Squeeze",
        "Tile", "TopK", "Transpose", "Unsqueeze", "Upsample", "Where",
    }
)
