"""Precision transforms: ONNX in, ONNX out, so every candidate backend runs the identical model."""

from accudiff.transforms.base import KeptNode, NodeSelector, TransformResult
from accudiff.transforms.fp16 import to_fp16
from accudiff.transforms.int8 import to_int8

__all__ = ["KeptNode", "NodeSelector", "TransformResult", "to_fp16", "to_int8"]
