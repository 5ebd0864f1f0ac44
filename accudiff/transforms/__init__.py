"""Precision transforms: ONNX in, ONNX out, so every candidate backend runs the identical model."""

from accudiff.transforms.base import KeptNode, NodeSelector, QuantRange, TransformResult
from accudiff.transforms.fp16 import FP16_MAX, to_fp16
from accudiff.transforms.int8 import to_int8

__all__ = ["FP16_MAX", "KeptNode", "NodeSelector", "QuantRange", "TransformResult", "to_fp16", "to_int8"]
