"""The smallest connected subgraph that fails on its own when fed the reference's values, as a reproducer.

1. One comparison with `isolate`: the first failing tensor `T` and whether its node fails by itself.
2. If it does, that node alone is tried as the reproducer. Otherwise (or if alone, with its inputs
   entering as FP32, it passes) the failing subgraph ends at `T`'s node and
   starts somewhere among its ancestors: with A the ancestors in topological order, "A[k:] fed the
   reference's values fails" holds for k = 0 (that is the full run) and not for the last; bisection finds
   the largest failing k in ceil(log2(len(A))) candidate runs.
3. The subgraph is saved with its reference inputs (.npz) and the `accudiff compare` command that
   reproduces it, and that command is run once more to confirm it fails before anything is reported.
With several input samples a subgraph fails if it fails on any of them (statistics aggregate worst case).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from accudiff.bisect.session import BisectSession
from accudiff.comparison.table import STATUS_FAIL
from accudiff.model.inputs import Feed, save_feeds
from accudiff.model.subgraph import extract

MODEL_FILE, INPUTS_FILE = "subgraph.onnx", "subgraph_inputs.npz"


@dataclass
class SubgraphResult:
    tensor: str | None  # the first failing tensor of the full model; None when nothing fails
    nodes: list[str] = field(default_factory=list)  # ONNX node names of the reproducer, in order
    model_path: Path | None = None
    inputs_path: Path | None = None
    command: str = ""
    confirmed: bool = False
    candidate_runs: int = 0
    bound: int = 0  # the run count promised: ceil(log2(N)) + 3
    interrupted: bool = False
    findings: list[dict] = field(default_factory=list)


def bisect_subgraph(session: BisectSession, out_dir: Path) -> SubgraphResult:
    graph = session.info.proto.graph
    nodes = list(graph.node)
    result = SubgraphResult(tensor=None, bound=math.ceil(math.log2(max(len(nodes), 2))) + 3)
    session.progress("step 1: compare the whole model (with isolated errors)")
    full = session.compare(isolate=True)
    result.candidate_runs = session.candidate_runs
    if full.first_failure is None:
        return result
    target = full.first_failure.tensor
    result.tensor, result.findings = target, [f.__dict__ for f in full.first_failure.findings]
    end = next(i for i, node in enumerate(nodes) if target in node.output)
    ancestors = _ancestors(nodes, end)
    isolated = full.table.set_index("tensor").loc[target, "isolated_status"]
    reference = session.reference_outputs()
    try:
        if isolated == STATUS_FAIL:
            # Its node fails when fed reference values; alone, it must still fail where its inputs enter as
            # FP32 graph inputs (an input's FP16 storage belongs to its producer): the confirmation decides.
            _write_reproducer(session, ancestors[-1:], target, reference, out_dir, result)
        if not result.confirmed:
            start = _bisect(session, nodes, ancestors, target, reference, result)
            _write_reproducer(session, ancestors[start:], target, reference, out_dir, result)
    except KeyboardInterrupt:
        result.interrupted = True
    result.candidate_runs = session.candidate_runs
    return result


def _bisect(session, nodes, ancestors, target, reference, result) -> int:
    """Largest k such that ancestors[k:] fails on its own; ancestors[0:] (the full run) is known to fail."""
    failing, passing = 0, len(ancestors) - 1
    steps = math.ceil(math.log2(max(len(ancestors) - 1, 1)))
    step = 1
    while passing - failing > 1:
        middle = (failing + passing) // 2
        step += 1
        session.progress(f"step {step} of about {steps + 2}: nodes {ancestors[middle]}..{ancestors[-1]} fed the reference's values")
        if _fails(session, nodes, ancestors[middle:], target, reference, Path(session.cache.folder) / "bisect.onnx"):
            failing = middle
        else:
            passing = middle
        result.candidate_runs = session.candidate_runs
    return failing


def _fails(session, nodes, chosen, target, reference, path: Path) -> bool:
    model, feeds = _subgraph(session, chosen, reference)
    onnx.save(model, str(path))
    table = session.compare(path, feeds).table.set_index("tensor")
    return table.loc[target, "status"] == STATUS_FAIL


def _subgraph(session, chosen: list[int], reference) -> tuple[onnx.ModelProto, list[Feed]]:
    """The nodes as a model, and for every sample the reference's values of its inputs."""
    model = extract(session.info.proto, chosen)
    names = [i.name for i in model.graph.input]
    feeds = []
    for iteration, feed in enumerate(session.feeds):
        outputs = reference[iteration]
        feeds.append({name: feed[name] if name in feed else outputs[name].copy() for name in names})
    return model, feeds


def _write_reproducer(session, chosen, target, reference, out_dir: Path, result: SubgraphResult) -> None:
    result.nodes = [session.info.proto.graph.node[i].name for i in chosen]
    model, feeds = _subgraph(session, chosen, reference)
    result.model_path, result.inputs_path = out_dir / MODEL_FILE, out_dir / INPUTS_FILE
    onnx.save(model, str(result.model_path))
    save_feeds(feeds, result.inputs_path)
    flags = {"fp16": ["--fp16"], "int8": ["--int8"]}.get(session.precision, [])
    tolerance_flags = [f"--{key}={value}" for key in ("atol", "rtol", "stol") if (value := session.options.get(key)) is not None]
    candidate = ["--candidate", session.options["candidate"]] if session.options.get("candidate", "auto") != "auto" else []
    result.command = shlex.join(["accudiff", "compare", MODEL_FILE, *flags, "--load-inputs", INPUTS_FILE, *candidate, *tolerance_flags])
    session.progress("confirming that the reproducer fails on its own")
    confirm = session.compare(result.model_path, str(result.inputs_path))
    result.confirmed = confirm.table.set_index("tensor").loc[target, "status"] == STATUS_FAIL


def _ancestors(nodes, end: int) -> list[int]:
    """Indices of `end` and every node it depends on, in topological order."""
    producer = {o: i for i, node in enumerate(nodes) for o in node.output if o}
    found, stack = {end}, [end]
    while stack:
        for name in nodes[stack.pop()].input:
            parent = producer.get(name)
            if parent is not None and parent not in found:
                found.add(parent)
                stack.append(parent)
    return sorted(found)
