"""What every precision transform returns, and how a user's keep-list selects nodes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import onnx


@dataclass(frozen=True)
class KeptNode:
    """A node left in higher precision, and why (so the report can say it)."""

    node: str
    op_type: str
    reason: str


@dataclass(frozen=True)
class QuantRange:
    """The INT8 grid a tensor is quantized onto: values beyond `low..high` clip, steps are `scale` wide."""

    scale: float
    low: float
    high: float


@dataclass
class TransformResult:
    """The candidate model, and what the diagnosis needs to know about how it was made."""

    model: onnx.ModelProto
    precision: str
    kept: list[KeptNode] = field(default_factory=list)
    converted: set[str] = field(default_factory=set)  # nodes that compute in reduced precision (FP16, or INT8 inputs)
    quant_ranges: dict[str, QuantRange] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    constant_overflows: dict[str, str] = field(default_factory=dict)  # converted node -> its constant that became Inf
    # A tensor's copy in another storage type, made for the nodes that read it in that type: {copy: tensor}.
    # The isolated run feeds each copy from the tensor's reference value, so every node reads the reference
    # exactly as it reads its inputs in the candidate.
    storage_copies: dict[str, str] = field(default_factory=dict)


class NodeSelector:
    """Matches nodes by exact name, exact op type, or a regular expression over the full node name."""

    def __init__(self, patterns: Iterable[str]):
        self.patterns = list(patterns)
        self._regexes = []
        for pattern in self.patterns:
            try:
                self._regexes.append(re.compile(pattern))
            except re.error:
                self._regexes.append(None)

    def matches(self, node: onnx.NodeProto) -> str | None:
        """The pattern that selects `node`, or None."""
        for pattern, regex in zip(self.patterns, self._regexes):
            if pattern in (node.name, node.op_type) or (regex is not None and regex.fullmatch(node.name)):
                return pattern
        return None
