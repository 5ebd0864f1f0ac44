"""What every precision transform returns, and how a user's keep-list selects nodes."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import onnx

from accudiff.errors import AccudiffError
from accudiff.model.formats import QuantRange


@dataclass(frozen=True)
class KeptNode:
    """A node left in higher precision, and why (so the report can say it)."""

    node: str
    op_type: str
    reason: str
    autokept: bool = False  # kept by autokeep (a constant or an input beyond the format's range), not asked for


@dataclass
class TransformResult:
    """The candidate model, and what the diagnosis needs to know about how it was made."""

    model: onnx.ModelProto
    precision: str
    kept: list[KeptNode] = field(default_factory=list)
    converted: set[str] = field(default_factory=set)  # nodes that compute in reduced precision (FP16, or INT8 inputs)
    quant_ranges: dict[str, QuantRange] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    constant_findings: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # converted node -> (kind, what its constants became: Inf, 0)
    # A tensor's copy in another storage type, made for the nodes that read it in that type: {copy: tensor}.
    # The isolated run feeds each copy from the tensor's reference value, so every node reads the reference
    # exactly as it reads its inputs in the candidate.
    storage_copies: dict[str, str] = field(default_factory=dict)
    unmatched: dict[str, str] = field(default_factory=dict)  # a reference tensor -> why a candidate given by the user has no partner for it
    inside: dict[str, str] = field(default_factory=dict)  # ... of those, one computed inside a node the user's tool fused -> that node, in words
    weight_findings: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # node -> (kind, what its weight's quantization scale zeroes; deferred.py: measured on a thread)
    quantized_by: dict[str, str] = field(default_factory=dict)  # a node another tool quantized with ops of its own -> that tool (quantized_ops.py)
    reads_constant_weights: set[str] = field(default_factory=set)  # nodes reading a float weight a Constant node holds (a converter's block list rounds it all the same)
    given: onnx.ModelProto | None = None  # a candidate made by another tool as the user gave it, its weights referenced in its file


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

    def require_matches(self, nodes: Iterable[onnx.NodeProto]) -> None:
        """A pattern that selects no node would make the keep-list silently do nothing: refuse it, and
        suggest the node names or op types it was probably meant to be."""
        nodes = list(nodes)
        for pattern in self.patterns:
            if any(NodeSelector([pattern]).matches(node) for node in nodes):
                continue
            names = sorted({n.name for n in nodes} | {n.op_type for n in nodes})
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else " (patterns match a node name, an op type, or a regex over the whole node name)"
            raise AccudiffError(f"--keep-fp32 '{pattern}' matches no node of the model{hint}")
