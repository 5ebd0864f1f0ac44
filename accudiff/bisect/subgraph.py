"""The smallest connected subgraph that fails on its own when fed the reference's values, as a reproducer.

1. One comparison with the isolated run names the cause of each failing output (diagnosis/cause.py).
2. A local cause is tried first: its node alone, fed the reference's values of its inputs; if that passes
   (the failure needs what feeds it), the node with the producers of its inputs. A one-node fault so
   yields a reproducer of one to three nodes.
3. Accumulated error (or a local reproducer that does not fail) is bisected: the subgraph ends at the
   failing output itself, or below a verified single-node cause at the first tensor out of tolerance
   computed from it (never at a first tensor out of tolerance elsewhere, which is a fact, never the cause:
   a cut failing there, on a few elements, may have nothing to do with the output's failure), and starts
   among its ancestors A (in topological order). "A[k:] fed the reference's values fails at the
   output" holds for k = 0 (the full run) and not for the last node alone; bisection finds the largest
   failing k in ceil(log2(len(A))) candidate runs. A decoder compared from prompts is generated step by
   step, each side carrying its own KV cache, where a cut is fed each prompt's whole sequence as one prefill
   (it carries no cache): the whole model fed so is run first at the tensor the cuts are checked at (a
   single-node cause's too, before its cuts), and is what they are held to; a failure it does not show (one
   of a decode step) no cut reproduces, and that is said instead.
4. The subgraph is saved with its reference inputs (.npz, and for INT8 the reference values of its inputs
   on the calibration samples, so it is quantized exactly as in the full model) and the `accudiff compare`
   command that reproduces it. That command is parsed and run once more to confirm it fails before
   anything is reported.
With several input samples a subgraph fails if it fails on any of them (statistics aggregate worst case).
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from accudiff.bisect.session import BisectSession
from accudiff.errors import AccudiffError
from accudiff.judging.table import STATUS_FAIL
from accudiff.model.graph import GraphIndex
from accudiff.model.inputs import Feed, save_feeds
from accudiff.model.quantized_ops import find_quantized_ops
from accudiff.model.saving import save_model
from accudiff.model.subgraph import extract
from accudiff.transforms.int8 import QUANTIZED_OPS
from accudiff.result import TensorFailure
from accudiff.settings import RunSettings
from accudiff.transforms.base import NodeSelector
from accudiff.transforms.keep_float import STORAGE_OPS

MODEL_FILE, INPUTS_FILE, CALIBRATION_FILE = "subgraph.onnx", "subgraph_inputs.npz", "subgraph_calibration.npz"
CANDIDATE_FILE = "subgraph_candidate.onnx"  # the cut of a candidate made by another tool
GROWN_SIZES = (1, 3)  # a single-node cause's cuts: the node alone, then with the producers of its inputs (at most this many nodes)
REPRODUCED = 0.5  # the share of the whole model's error at the checked tensor a reproducer must show


@dataclass
class SubgraphResult:
    output: str | None = None  # the failing graph output the reproducer explains; None when nothing fails
    cause_kind: str | None = None  # a key of diagnosis/cause.py CAUSE_KINDS
    tensor: str | None = None  # the tensor the reproducer checks
    nodes: list[str] = field(default_factory=list)  # ONNX node names of the reproducer, in order
    model_path: str | None = None  # file names relative to the result folder
    inputs_path: str | None = None
    calibration_path: str | None = None
    candidate_path: str | None = None
    command: str = ""  # runs verbatim from the result folder
    confirmed: bool = False
    tol_ratio: float | None = None  # the reproducer's checked tensor, in its tolerances, when run again
    whole_tol_ratio: float | None = None  # the same tensor's in the whole model
    prefill_tol_ratio: float | None = None  # a decoder's: the same tensor's in the whole model fed as its cuts are (model/prompts.whole_sequences)
    candidate_runs: int = 0
    bound: int = 0  # the run count promised (run_bound)
    interrupted: bool = False
    findings: list[dict] = field(default_factory=list)


SINGLE_NODE_CAUSES = ("local", "several", "dominant")  # a verified cause node to start the cut from


def bisect_subgraph(session: BisectSession, out_dir: Path) -> SubgraphResult:
    session.specialize()  # a cause inside an If body is a node of the graph cut here
    nodes = list(session.info.proto.graph.node)
    result = SubgraphResult(bound=run_bound(len(nodes), session.settings.prompts is not None))
    session.progress("step 1: compare the whole model (with isolated errors) and name the cause")
    full = session.compare(isolate=True)
    result.candidate_runs = session.candidate_runs
    if full.passed:
        return result
    failure = _most_local(full.output_failures, nodes)
    if full.table.set_index("tensor").loc[failure.tensor, "status"] != STATUS_FAIL:  # a cut is checked elementwise
        raise AccudiffError(f"output '{failure.tensor}' fails only its requirement (--require), its elements being within tolerance, and a subgraph "
                            "is checked elementwise: give a tolerance it fails (--atol/--rtol), or find what to keep with accudiff bisect precision")
    cause = failure.cause
    result.output, result.cause_kind = failure.tensor, cause.kind
    result.findings = [vars(f) for f in cause.findings]
    index = {node.name: i for i, node in enumerate(nodes)}
    checked: dict[str, bool] = {}  # a checked tensor -> whether a cut can fail there (a decoder's: see `_checking`)
    try:
        if cause.kind in SINGLE_NODE_CAUSES and _checking(session, full, nodes, result, cause.tensor, checked):
            own = index[cause.node]
            for chosen in dict.fromkeys(tuple(_with_producers(nodes, own, limit)) for limit in GROWN_SIZES):
                _write_reproducer(session, list(chosen), out_dir, result)
                if result.confirmed:
                    break
        if not result.confirmed:
            if not _checking(session, full, nodes, result, _bisection_end(failure, nodes), checked):
                _forget_reproducer(result, out_dir)
                result.candidate_runs = session.candidate_runs
                return result
            ancestors = _ancestors(nodes, result.tensor)
            start = _bisect(session, ancestors, result)
            _write_reproducer(session, ancestors[start:], out_dir, result)
    except KeyboardInterrupt:
        result.interrupted = True
    result.candidate_runs = session.candidate_runs
    return result


def run_bound(nodes: int, prompts: bool) -> int:
    """The most candidate runs any path of the search takes on a graph of `nodes` nodes: the comparison with its
    isolated run (2), a single-node cause's two cuts, a decoder's whole model fed as its cuts are (given
    prompts: at the single-node cause's tensor, then where bisection checks), the bisection of at most all the
    nodes, and the reproducer's confirmation."""
    return 2 + len(GROWN_SIZES) + 2 * prompts + math.ceil(math.log2(max(nodes - 1, 1))) + 1


def _checking(session, full, nodes, result: SubgraphResult, tensor: str, checked: dict[str, bool]) -> bool:
    """Check cuts at `tensor` from now on (`result` holds its figure in the whole model), and whether a cut can
    fail there: always, but for a decoder generated step by step, whose cuts carry no KV cache, only where the
    whole model fed each prompt's whole sequence as one prefill, as they are, fails there (its figure then what
    they are held to). Each tensor is run so once (`checked`)."""
    if tensor != result.tensor:
        result.tensor, result.whole_tol_ratio, result.prefill_tol_ratio = tensor, float(full.table.set_index("tensor").at[tensor, "tol_ratio"]), None
    if tensor not in checked:
        checked[tensor] = not full.generations or _fails_as_one_prefill(session, _ancestors(nodes, tensor), result)
    return checked[tensor]


def _forget_reproducer(result: SubgraphResult, out_dir: Path) -> None:
    """A cut written before the search learned that no cut can fail where it checks: its files go, and the
    result names no reproducer."""
    for name in (MODEL_FILE, INPUTS_FILE, CALIBRATION_FILE, CANDIDATE_FILE):
        for path in (out_dir / name, out_dir / f"{name}.data"):
            path.unlink(missing_ok=True)
    result.nodes, result.model_path, result.inputs_path, result.calibration_path, result.candidate_path = [], None, None, None, None
    result.command, result.confirmed, result.tol_ratio = "", False, None


def _most_local(failures: list[TensorFailure], nodes) -> TensorFailure:
    """The failing output whose cause is a single node, earliest in the graph; else the first failure."""
    order = {node.name: i for i, node in enumerate(nodes)}
    local = [f for f in failures if f.cause.kind in SINGLE_NODE_CAUSES]
    return min(local, key=lambda f: order[f.cause.node]) if local else failures[0]


def _bisection_end(failure: TensorFailure, nodes) -> str:
    """Where a bisected reproducer is checked: the failing output; or, below a verified single-node cause, the
    first tensor out of tolerance where it is the cause's own or computed from it (the failure verification
    tied to the output, cut short). The first tensor out of tolerance elsewhere is a fact, never the cause."""
    cause, first = failure.cause, failure.first_failing_upstream
    if cause.kind not in SINGLE_NODE_CAUSES or not cause.verified or first is None:
        return failure.tensor
    reached = {cause.tensor}
    for node in nodes:
        if reached & set(node.input):
            reached.update(o for o in node.output if o)
    return first if first in reached else failure.tensor


def _with_producers(nodes, own: int, limit: int) -> list[int]:
    """Node `own` and, up to `limit` nodes in all, the producers of its inputs (nearest first)."""
    producer = {o: i for i, node in enumerate(nodes) for o in node.output if o}
    chosen = [own]
    for name in nodes[own].input:
        if len(chosen) >= limit:
            break
        if producer.get(name) is not None and producer[name] not in chosen:
            chosen.append(producer[name])
    return sorted(chosen)


def _bisect(session, ancestors, result) -> int:
    """Largest k such that ancestors[k:] reproduces the failure on its own (`_reproduces`); ancestors[0:] (the
    full run) is known to."""
    failing, passing = 0, len(ancestors) - 1
    total = math.ceil(math.log2(max(len(ancestors) - 1, 1))) + 2
    step = 1
    while passing - failing > 1:
        middle = (failing + passing) // 2
        step += 1
        session.progress(f"step {step} of about {total}: nodes {ancestors[middle]}..{ancestors[-1]} fed the reference's values")
        if _fails(session, ancestors[middle:], result):
            failing = middle
        else:
            passing = middle
        result.candidate_runs = session.candidate_runs
    return failing


def _fails_as_one_prefill(session, ancestors, result: SubgraphResult) -> bool:
    """Whether the whole model fed each prompt's whole sequence as one prefill, as a decoder's cuts are (they
    carry no KV cache), fails as it did generating; its figure is then the one cuts are held to."""
    session.progress(f"the whole model fed each prompt's whole sequence as one prefill, as a cut is (a cut carries no KV cache), checked at '{result.tensor}'")
    checked = _run_cut(session, _save_cut(session, ancestors, _scratch(session, ancestors))).table.set_index("tensor").loc[result.tensor]
    reproduced = _reproduces(checked, result)
    result.prefill_tol_ratio = float(checked["tol_ratio"])
    return reproduced


def _fails(session, chosen, result: SubgraphResult) -> bool:
    if session.precision == "int8" and session.settings.candidate_model is None and not any(
            session.info.proto.graph.node[i].op_type in QUANTIZED_OPS for i in chosen):
        return False  # --int8 quantizes none of its nodes: it computes as the reference does (and to_int8 refuses it)
    cut = _save_cut(session, chosen, _scratch(session, chosen))
    return _reproduces(_run_cut(session, cut).table.set_index("tensor").loc[result.tensor], result)


def _scratch(session, chosen: list[int]) -> Path:
    folder = Path(session.cache.folder) / f"cut-{chosen[0]}-{chosen[-1]}"  # one folder per cut: cached runs never mix
    folder.mkdir(exist_ok=True)
    return folder


def _reproduces(checked, result: SubgraphResult) -> bool:
    """A cut reproduces the failure when its checked tensor fails with at least REPRODUCED of the error it has
    in the whole model (a decoder's: fed as its cuts are, once known): the last two nodes of a drifting chain,
    fed exact values, may fail at 1.8x where the output is at 83x, a failure of their own, not the one asked about."""
    whole = result.prefill_tol_ratio if result.prefill_tol_ratio is not None else result.whole_tol_ratio
    return checked["status"] == STATUS_FAIL and float(checked["tol_ratio"]) >= REPRODUCED * whole


def _write_reproducer(session, chosen: list[int], out_dir: Path, result: SubgraphResult) -> None:
    result.nodes = [session.info.proto.graph.node[i].name for i in chosen]
    cut = _save_cut(session, chosen, out_dir)
    result.model_path, result.inputs_path = MODEL_FILE, INPUTS_FILE
    result.calibration_path = CALIBRATION_FILE if cut.calib_data is not None else None
    result.candidate_path = CANDIDATE_FILE if cut.candidate_model is not None and not cut.given_alone else None
    folder = str(out_dir.resolve())
    relative = [os.path.relpath(arg, folder) if arg.startswith(folder + os.sep) else arg for arg in cut.arguments()]
    result.command = shlex.join(["accudiff", "compare", *relative])
    session.progress(f"confirming that the reproducer ({len(chosen)} node(s)) fails on its own")
    checked = _run_cut(session, cut).table.set_index("tensor").loc[result.tensor]
    result.confirmed, result.tol_ratio = bool(_reproduces(checked, result)), float(checked["tol_ratio"])


def _save_cut(session, chosen: list[int], folder: Path) -> RunSettings:
    """Save the nodes as `subgraph.onnx` with the reference's values of its inputs (and for INT8 its
    calibration samples) in `folder`; return the settings that run it: the session's settings narrowed to
    what applies to this cut. A candidate made by another tool is cut too, at the same nodes with the
    Q/DQ pairs and Casts they read through (`subgraph_candidate.onnx`; for a model that is its own
    candidate, the cut of the candidate is the subgraph itself)."""
    folder = folder.resolve()
    model = extract(session.info.proto, chosen)
    outputs = [o.name for o in model.graph.output]
    settings = session.settings
    candidate = None
    if settings.candidate_model is not None:
        names = {session.info.proto.graph.node[i].name for i in chosen}
        candidate = folder / (MODEL_FILE if settings.given_alone else CANDIDATE_FILE)
        save_model(_candidate_cut(session.candidate.model, session.info.proto, names, outputs), candidate)
    if not settings.given_alone:
        save_model(model, folder / MODEL_FILE)
    inputs = [i.name for i in model.graph.input]
    save_feeds(_values_at(inputs, session.feeds, session.reference_outputs()), folder / INPUTS_FILE)
    calibration = None
    if session.precision == "int8" and settings.candidate_model is None:
        # Calibrated on the values its inputs take on the full model's calibration samples, the cut's
        # quantized tensors get exactly the ranges, and so the scales, they have in the full model.
        samples = session.calibration_feeds
        save_feeds(_values_at(inputs, samples, session.reference_outputs(samples)), folder / CALIBRATION_FILE)
        calibration = folder / CALIBRATION_FILE
    nodes = list(model.graph.node)
    keep = [p for p in settings.keep_fp32 if any(NodeSelector([p]).matches(n) for n in nodes)]
    tensors = {o for n in nodes for o in n.output}
    tolerances = {}
    for key in ("atol", "rtol", "stol"):
        value = getattr(settings, key)
        if value is not None:
            items = [value] if isinstance(value, (int, float)) else list(value)
            tolerances[key] = [v for v in map(str, items) if ":" not in v or v.rpartition(":")[0] in tensors]
    precision = settings.precision if candidate is None else "fp32"  # a cut of a candidate holds the formats it holds: read from it again
    return settings.fed(folder / INPUTS_FILE, model=folder / MODEL_FILE, calib_data=calibration, keep_fp32=keep, report_dir=None,
                   candidate_model=candidate, precision=precision, **tolerances)


def _candidate_cut(candidate: onnx.ModelProto, reference: onnx.ModelProto, names: set[str], outputs: list[str]) -> onnx.ModelProto:
    """The candidate's nodes of these names (a quantized op under the name of the `reference` node it
    stands for: a MatMulNBits for its MatMul), with the Q/DQ, Cast and Constant nodes the tool added that
    they read through (back to values the cut is fed, or weights; a Cast the reference has too is a node of
    its own, in the cut or not as the reference's is) or that write the cut's outputs, as a model with the
    reference cut's outputs."""
    nodes = list(candidate.graph.node)
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    standing_in = {member for op in find_quantized_ops(GraphIndex.of(candidate.graph), GraphIndex.of(reference.graph)) if names & set(op.names)
                   for member in op.members}
    chosen = {i for i, node in enumerate(nodes) if node.name in names or node.name in standing_in}
    theirs = {node.name for node in reference.graph.node}

    def added(i: int | None) -> bool:  # a node the tool added that moves values, not yet in the cut
        return i is not None and i not in chosen and nodes[i].op_type in STORAGE_OPS and nodes[i].name not in theirs

    chosen |= {producer[name] for name in outputs if added(producer.get(name))}  # writing a cut's output (a KV cache quantized on its way out)
    stack = list(chosen)
    while stack:
        for name in nodes[stack.pop()].input:
            i = producer.get(name)
            if added(i):
                chosen.add(i)
                stack.append(i)
    return extract(candidate, sorted(chosen), outputs=outputs)


def _run_cut(session, cut: RunSettings):
    """Compare a saved cut (only its verdicts are needed: no verification)."""
    narrowed = {"keep_fp32": cut.keep_fp32, "atol": cut.atol, "rtol": cut.rtol, "stol": cut.stol}
    return session.compare(model=cut.model, inputs=str(cut.inputs), calib_data=cut.calib_data, candidate_model=cut.candidate_model,
                           precision=cut.precision, verify=False, **narrowed)


def _values_at(names: list[str], feeds: list[Feed], reference) -> list[Feed]:
    """For every sample, the value of each name: a graph input as fed, anything else from the reference."""
    values = []
    for sample, feed in enumerate(feeds):
        recorded = reference.read(sample, [name for name in names if name not in feed])
        values.append({name: feed[name] if name in feed else np.array(recorded[name]) for name in names})
    return values


def _ancestors(nodes, tensor: str) -> list[int]:
    """Indices of the node writing `tensor` and every node it depends on, in topological order."""
    producer = {o: i for i, node in enumerate(nodes) for o in node.output if o}
    end = producer[tensor]
    found, stack = {end}, [end]
    while stack:
        for name in nodes[stack.pop()].input:
            parent = producer.get(name)
            if parent is not None and parent not in found:
                found.add(parent)
                stack.append(parent)
    return sorted(found)
