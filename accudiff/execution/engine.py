"""The comparison as a reduction over streamed units of work: sample x segment.

For every sample, the graph runs one segment at a time (model/segments.py): the reference segment first,
then each candidate pass of the same segment (beside the reference's run, when the pass reads nothing it
makes there and the worker has cores to spare), whose tensors are reduced into mergeable statistics
(judging/metrics.py) as soon as they exist, and dropped unless a later segment reads them. A pass is
fed its own earlier segments' values, so a candidate's error accumulates exactly as in a full run; the
isolated pass also reads the reference's value of every compared tensor (`fed_from_reference`). What
leaves the engine is statistics, never arrays: merged over samples, processes or machines they give the
same table.

Everything here runs in the comparison worker process (worker.py) and knows backends only through the
runner interface.
"""

from __future__ import annotations

import functools
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Collection, Iterator, Mapping, Sequence

import numpy as np

from accudiff.judging.decisions import SampleOutcome, decide, threshold_for
from accudiff.execution.messages import PassResult
from accudiff.execution.plans import EngineOptions, Measured, PassPlan, ReferencePlan, RunnerFactory
from accudiff.execution.remembered import remember_whole_model, whole_model
from accudiff.judging.metrics import (EMPTY_ROW, F, PART_ELEMENTS, SKETCH_BUCKETS, PartMap, StatsSet, finish_rows, merge_run_time_ranges, range_rows,
                                         reduce_tensor, reference_range, run_time_range, sample_points)
from accudiff.judging.output_kinds import UNKNOWN
from accudiff.model.inputs import Feed
from accudiff.model.graph import tensor_bytes
from accudiff.model.loading import load_graph
from accudiff.model.shapes import infer_shapes_unless_typed
from accudiff.model.source import IN_MEMORY_WEIGHTS_UP_TO, ModelSource, own_weight_bytes
from accudiff.model.segments import place_nodes
from accudiff.model.subgraph import cut_inputs, extract
from accudiff.runners.base import Runner

PARALLEL_ELEMENTS = 1 << 18  # tensors this large are reduced on several cores at once
# With one sample, each session is made while the one before it runs when the models' weights are below
# this; else one session at a time (see `keep_sessions`). A session made ahead holds its weights (and ONNX
# Runtime's packed copies) beside the running one's: the recognizer's 10 MB save 0.4 s of its 9 sessions,
# resnet18's 45 MB cost 60 MB more at the peak and saved no time.
AHEAD_UP_TO_BYTES = 32 << 20


@dataclass
class _Segment:
    make: Callable[[], Runner] | None  # its runner, not yet activated (None: the reference replayed from a store)
    inputs: set[str]  # what the segment model reads (graph inputs and earlier segments' values)
    compared: list[str]  # the compared tensors it produces
    wanted: list[str]  # what it returns: those, and what later segments read
    runner: Runner | None = None  # made on first use
    active: bool = False
    ahead: Future | None = None  # its activation, under way while the segment before it runs


class Engine:
    """Runs the reference and the candidate passes over samples, segment by segment, into statistics."""

    def __init__(self, reference: ReferencePlan, passes: Sequence[PassPlan], measured: Measured, scratch: Path, options: EngineOptions = EngineOptions()):
        store, threads, progress = reference.store, options.threads, options.progress
        self.outputs_store, self.keep_sessions, self.points = reference.outputs_store, options.keep_sessions, options.points
        self.tensors, self.outputs = list(measured.tensors), set(measured.outputs)
        self.inputs = list(measured.inputs)
        tolerances, quant_ranges, segments = measured.tolerances, measured.quant_ranges, measured.segments
        self.thresholds, self.kinds = dict(measured.thresholds), dict(measured.kinds)
        self.input_stats = StatsSet(len(self.inputs))
        self.row = {name: index for index, name in enumerate(self.tensors)}
        self.tolerances, self.quant_ranges, self.progress, self.store = tolerances, quant_ranges, progress, store
        self.passes = list(passes)
        self.results = {p.name: PassResult(StatsSet(len(self.tensors))) for p in self.passes}
        self.reference_not_observable: dict[str, str] = {}
        self._active: list[Runner] = []
        self.timings: dict[str, float] = {}  # seconds per phase: where a worker's time goes (summary.json)
        self._ranges: dict[int, dict[str, tuple[float, float]]] = {}  # each sample's reference tensors' ranges, found once
        self._inputs_counted: set[int] = set()  # samples whose inputs are in input_stats (one run again for other passes is not counted again)
        self.run_time_ranges: dict[str, list[float]] = {}  # a tensor quantized as the model runs -> what sets its ranges (metrics.run_time_range)
        # A pass's tensors are reduced on every core the worker may use at once, between backend runs (which use
        # them too); each tensor's statistics are its own, so the order they finish in changes nothing.
        cores = threads * max(1, options.sessions_at_once)
        self._reducer, self._threads = ThreadPoolExecutor(max_workers=cores, thread_name_prefix="accudiff-reduce"), cores
        self._following: dict[int, _Segment] = {}  # a segment -> the next one the sample runs
        self._ahead: ThreadPoolExecutor | None = None  # where the next session is made while one runs
        self._weight_bytes = 0  # the largest weights of a model run (reference or pass)
        self._produced_in: dict[str, int] = {}  # a value -> the segment the reference makes it in
        node_segment = {name: k for k, names in enumerate(segments) for name in names}
        self._later_reference_reads: list[set[str]] = []
        try:
            replay = store is not None and store.complete
            self.reference = self._segments(reference.model, node_segment, len(segments), None if replay else reference.make_runner, scratch / "reference")
            self.pass_segments = {
                p.name: self._segments(p.model, node_segment, len(segments), p.make_runner, scratch / re.sub(r"[^A-Za-z0-9_.-]+", "_", p.name)) for p in self.passes
            }
        except BaseException:
            self.close()
            raise
        if not self.keep_sessions and self._weight_bytes < AHEAD_UP_TO_BYTES:
            self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accudiff-session")
        # Where a pass runs beside the reference (`run_sample`): every session is kept, and cores are left over.
        beside = [p for p in self.passes if any(s.runner is not None and s.runner.runs_beside_others for s in self.pass_segments[p.name])]
        self.sessions_at_once = min(options.sessions_at_once, 1 + len(beside)) if self.keep_sessions else 1  # at most
        self._beside = ThreadPoolExecutor(max_workers=self.sessions_at_once - 1, thread_name_prefix="accudiff-beside") if self.sessions_at_once > 1 else None
        for k in range(len(segments)):  # reference values later segments read, as inputs or fed to a pass
            later = {n for s in self.reference[k + 1 :] for n in s.inputs}
            for plan in self.passes:
                later |= {plan.fed_from_reference[n] for s in self.pass_segments[plan.name][k + 1 :] for n in s.inputs if n in plan.fed_from_reference}
            self._later_reference_reads.append(later)

    def _segments(self, path: Path, node_segment: Mapping[str, int], count: int, make: RunnerFactory | None, folder: Path) -> list[_Segment]:
        """One runner per segment of the model at `path` (its nodes placed by name; nodes a transform added
        go with their first reader), each returning its compared tensors and what later segments read. A
        reference replayed whole needs no model: its store answers for every compared tensor (verification's
        trials replay it on every call)."""
        if make is None and count == 1:
            return [_Segment(None, set(), list(self.tensors), list(self.tensors))]
        known = whole_model(path, self.tensors) if count == 1 else None
        if known is not None:
            # The same file run before (verification's switchboard, its switches set per pass, in this job or an
            # earlier one): what it reads and returns is known, and the file is read only if this pass's runner
            # needs it (a reused runner is made once).
            inputs, own, wanted, weight_bytes = known
            self._weight_bytes = max(self._weight_bytes, weight_bytes)
            return [self._segment(make, ModelSource(path), inputs, own, wanted)]
        compared = set(self.tensors)
        with self.clock("segments"):
            model = load_graph(path)  # weights stay in their files, and a segment refers to them there
            weight_bytes = sum(tensor_bytes(init) for init in model.graph.initializer)
            self._weight_bytes = max(self._weight_bytes, weight_bytes)
            if count > 1:
                infer_shapes_unless_typed(model)  # the cut models' inputs and outputs need their types
        nodes = list(model.graph.node)
        placed = place_nodes(nodes, node_segment, count, self._produced_in)
        for index, node in enumerate(nodes):  # the reference's (the first model cut): where each value is made
            self._produced_in.update((out, placed[index]) for out in node.output if out and out not in self._produced_in)
        # One sample: a segment is cut when its runner is made, and the model stays in memory until the last
        # is. A model holding large weights itself is cut now instead (a segment holding large ones is saved).
        cut_later = not self.keep_sessions and make is not None and own_weight_bytes(model) < IN_MEMORY_WEIGHTS_UP_TO
        graph_outputs = {o.name for o in model.graph.output}
        segments = []
        for k in range(count):
            indices = [i for i, segment in enumerate(placed) if segment == k]
            later_reads = {n for i, segment in enumerate(placed) if segment > k for n in nodes[i].input}
            produced = [o for i in indices for o in nodes[i].output if o]
            own = [o for o in produced if o in compared]
            wanted = own + [o for o in produced if o not in compared and (o in later_reads or o in graph_outputs)]
            if count == 1:
                source, inputs = ModelSource.read(path, model), {i.name for i in model.graph.input}
                remember_whole_model(path, self.tensors, (inputs, own, wanted, weight_bytes))
            elif not indices:  # none of this model's nodes falls in the segment (a tool fused or dropped them): nothing to run
                segments.append(_Segment(None, set(), [], []))
                continue
            elif cut_later:  # cut when its runner is made: for all but the first, while the segment before it runs
                with self.clock("segments"):
                    inputs = cut_inputs(model, indices)
                    source = ModelSource.later(functools.partial(extract, model, indices, outputs=wanted), folder / f"segment{k}.onnx")
            else:
                with self.clock("segments"):
                    sub = extract(model, indices, outputs=wanted)
                    inputs = {i.name for i in sub.graph.input}
                    folder.mkdir(parents=True, exist_ok=True)
                    source = ModelSource.cut(sub, folder / f"segment{k}.onnx")
                    del sub
            segments.append(self._segment(make, source, inputs, own, wanted))
        return segments

    def _segment(self, make: RunnerFactory | None, source: ModelSource, inputs: set[str], compared: list[str], wanted: list[str]) -> _Segment:
        segment = _Segment(None if make is None else functools.partial(make, source, wanted), inputs, compared, wanted)
        if self.keep_sessions and make is not None:
            self._activate(segment)
        return segment

    def _activate(self, segment: _Segment) -> Runner:
        if not segment.active:
            with self.clock("sessions"):  # what the caller waits for, when it was made ahead
                if segment.ahead is not None:
                    segment.ahead.result()
                    segment.ahead = None
                else:
                    _make_active(segment)
            segment.active = True
            if segment.runner not in self._active:
                self._active.append(segment.runner)
        return segment.runner

    def _run(self, segment: _Segment, feed: Feed, phase: str) -> Mapping[str, np.ndarray]:
        runner = self._activate(segment)
        following = self._following.get(id(segment))
        if self._ahead is not None and following is not None and not following.active and following.ahead is None:
            following.ahead = self._ahead.submit(_make_active, following)
        with self.clock(phase):
            out = runner.infer(feed)
        if not self.keep_sessions:
            with self.clock("sessions"):
                runner.deactivate()
            segment.active = False
        return out

    def run_sample(self, sample: int | Sequence[int], feed: Feed, own_inputs: Mapping[str, Feed] | None = None, targets: Mapping[str, np.ndarray] | None = None,
                   keep: Collection[str] = (), only: Collection[str] | None = None, also: Callable[[], object] | None = None,
                   held: Mapping[str, tuple[slice, ...]] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """Reduce one sample into the statistics, one segment at a time. `own_inputs`: the graph inputs a pass
        is fed its own values of (a decoder's KV cache, which each side carries); `targets`: per graph output
        of token scores, the token each of its positions is scored on (decisions.decide). Returns the graph
        outputs named in `keep`, by side: "reference" and each pass that ran. `only`: the passes to run (the
        sample run again for others: its inputs are counted once, when every pass runs or the first time).
        `sample` may be several, one per row of a batch: every value fed and returned then has its rows first
        (a decoder's prompts of one length, generated together), and `targets` a row per sample; each row is
        reduced as its sample alone. `also`: more work for a core left over beside the reference (a decoder's candidate
        generating on its own), done there while the reference runs, or after the sample's runs where none is.
        `held`: the part of an output that holds values (a windowed KV cache's resident rows; the rest is left
        unspecified by the op that writes it), compared there alone."""
        samples = [sample] if isinstance(sample, int) else list(sample)
        rows = (lambda values, r: values) if isinstance(sample, int) else _row
        self._ranges = {s: {} for s in samples}
        for r, s in enumerate(samples):
            if s not in self._inputs_counted:
                self._inputs_counted.add(s)
                fed = rows(feed, r)
                self.input_stats.add_rows(range(len(self.inputs)), *range_rows([fed[n] for n in self.inputs], [self.quant_ranges.get(n) for n in self.inputs], s))
        own_inputs = own_inputs or {}
        reference_values: dict[str, np.ndarray] = dict(feed)
        passes = [p for p in self.passes if (p.samples is None or max(samples) < p.samples) and (only is None or p.name in only)]
        pass_values = {p.name: {**feed, **own_inputs.get(p.name, {})} for p in passes}
        kept: dict[str, dict[str, np.ndarray]] = {side: {} for side in ["reference", *(p.name for p in passes)]}
        order = [s for k, reference in enumerate(self.reference) for s in [reference, *(self.pass_segments[p.name][k] for p in passes)]]
        order = [s for s in order if s.make is not None]
        self._following = {id(a): b for a, b in zip(order, order[1:])}  # the next session to make ahead
        extra = self._beside.submit(also) if also is not None and self._beside is not None else None
        for k, reference in enumerate(self.reference):
            # A pass that reads nothing the reference makes in this segment (a candidate carrying its own values)
            # runs beside it, on cores left over: each session on its own threads computes as it would alone.
            beside = {plan.name: self._beside.submit(self._pass_run, plan, k, pass_values[plan.name], reference_values)
                      for plan in passes if self._beside is not None and self._reads_before(plan, k, reference_values)}
            try:
                out = self._reference_outputs(samples, rows, reference, reference_values)
            finally:
                wait(beside.values())  # a failure leaves no run under way
            kept["reference"].update((name, out[name]) for name in keep if name in out)
            reference_values.update(out)
            for plan in passes:
                values = pass_values[plan.name]
                if plan.name in beside:
                    out = beside[plan.name].result()
                else:
                    self.progress(f"running the {plan.name} pass on sample {samples[0]}")
                    out = self._pass_run(plan, k, values, reference_values)
                kept[plan.name].update((name, out[name]) for name in keep if name in out)
                for r, s in enumerate(samples):
                    if plan.record is not None:
                        plan.record.write(s, rows(out, r))
                    with self.clock("statistics"):
                        self._reduce(plan.name, s, rows(reference_values, r), rows(out, r), reference.compared, rows(targets or {}, r), held or {})
                later = self.pass_segments[plan.name][k + 1 :]
                needed = {n for s in later for n in s.inputs}
                pass_values[plan.name] = {name: value for name, value in {**values, **out}.items() if name in needed or name in feed}
                del out, values
            reference_values = {n: v for n, v in reference_values.items() if n in self._later_reference_reads[k] or n in feed}
        if also is not None:
            also() if extra is None else extra.result()
        return kept

    def rows_apart(self, feed: Feed) -> bool:
        """Whether every session computes the rows of the batch `feed` each as it would alone, bit for bit, as
        measured here: run together and one row at a time (graph outputs only, nothing reduced). Kernels choose by
        rows: ONNX Runtime multiplies one row otherwise than several where a GEMM's weights are not prepacked (the 1.1B
        Llama's logits 1e-5 apart), and in MatMulNBits at accuracy_level 0 (its figures up to 2e-6 apart), not at level 4. A
        reference replayed from its store runs nothing; a model in several segments is not asked."""
        if not self.keep_sessions or len(self.reference) != 1:
            return False
        sides = [(self.reference[0], {}), *((self.pass_segments[p.name][0], p.fixed_inputs) for p in self.passes)]
        rows = next(iter(feed.values())).shape[0]
        for segment, fixed in sides:
            if segment.runner is None:
                continue
            if not segment.active:
                return False
            with self.clock("rows apart"):
                together = segment.runner.infer({**feed, **fixed})
                for r in range(rows):
                    alone = segment.runner.infer({**_row(feed, r), **fixed})
                    if not all(np.array_equal(together[name][r : r + 1], value, equal_nan=True) for name, value in alone.items()):
                        return False
        return True

    def _pass_run(self, plan: PassPlan, k: int, values: dict[str, np.ndarray], reference_values: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The pass's segment `k` run on its `values`, the reference's values it is fed set among them."""
        segment = self.pass_segments[plan.name][k]
        for name in segment.inputs & plan.fed_from_reference.keys():
            values[name] = reference_values[plan.fed_from_reference[name]]
        return self._run(segment, {**values, **plan.fixed_inputs} if plan.fixed_inputs else values, f"runs: {plan.name}") if segment.wanted else {}

    def _reads_before(self, plan: PassPlan, k: int, reference_values: Mapping[str, np.ndarray]) -> bool:
        """Whether the pass's segment `k` can run beside the reference's: its runner may (Runner.runs_beside_others),
        and it reads only reference values made before it."""
        segment = self.pass_segments[plan.name][k]
        return (segment.runner is not None and segment.runner.runs_beside_others
                and all(plan.fed_from_reference[name] in reference_values for name in segment.inputs & plan.fed_from_reference.keys()))

    def run_alone(self, name: str, feed: Feed, keep: Collection[str]) -> dict[str, np.ndarray]:
        """The pass `name`'s model run on `feed`, segment by segment, nothing compared (a decoder's candidate
        generating on its own): its graph outputs named in `keep`."""
        values, kept = dict(feed), {}
        segments = self.pass_segments[name]
        for k, segment in enumerate(segments):
            out = self._run(segment, values, f"runs: {name}") if segment.wanted else {}
            kept.update((n, out[n]) for n in keep if n in out)
            needed = {n for s in segments[k + 1 :] for n in s.inputs}
            values = {n: v for n, v in {**values, **out}.items() if n in needed}
        return kept

    def _reference_outputs(self, samples: Sequence[int], rows: Callable, segment: _Segment, values: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The reference's values of `segment` on `samples` (a batch's rows, `rows` their slices): run, or read from its store."""
        if not segment.wanted:
            return {}
        if segment.make is None:
            read = [self.store.read(s, segment.wanted) for s in samples]
            out = read[0] if len(read) == 1 else {name: np.concatenate([one[name] for one in read]) for name in read[0]}
        else:
            self.progress(f"running the reference on sample {samples[0]}")
            out = self._run(segment, values, "runs: reference")
            if self.store is not None:
                for r, s in enumerate(samples):
                    self.store.write(s, rows(out, r))
        if self.outputs_store is not None:
            for r, s in enumerate(samples):
                self.outputs_store.write(s, rows(out, r))  # only the graph outputs are kept
        return out

    def _reduce(self, name: str, sample: int, reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], tensors: Sequence[str],
                targets: Mapping[str, np.ndarray], held: Mapping[str, tuple[slice, ...]]) -> None:
        result, ranges = self.results[name], self._ranges[sample]
        pairs = []
        for tensor in tensors:
            row = self.row[tensor]
            if tensor not in reference or tensor not in candidate:
                result.notes.setdefault(row, "not returned by the reference" if tensor not in reference else "not returned by the candidate")
                continue
            ref, cand = reference[tensor], candidate[tensor]
            if tensor in held:
                ref, cand = ref[held[tensor]], cand[held[tensor]]
            if row not in result.seen:  # as the first sample has it (naming a dtype costs more than it seems)
                result.seen[row] = (str(ref.dtype), str(cand.dtype), "x".join(map(str, ref.shape)))
            if ref.shape != cand.shape:
                result.notes[row] = f"shape differs: reference {ref.shape}, candidate {cand.shape}"
                continue
            pairs.append((tensor, ref, cand))

        values = np.tile(EMPTY_ROW, (len(pairs), 1))
        # The kernel adds each tensor's sketch straight into the pass's (a sample's sketches of every tensor,
        # made apart and added after, were 9 MB of zeros and a 9 MB gather-add a pass on the recognizer);
        # a graph output's is kept apart too, for its per-sample figures.
        own = {index: np.zeros(SKETCH_BUCKETS, np.int64) for index, (tensor, _, _) in enumerate(pairs) if tensor in self.outputs}

        def reduce_one(index: int, map_parts: PartMap = map) -> None:
            tensor, ref, cand = pairs[index]
            tolerance, quant = self.tolerances.for_tensor(tensor), self.quant_ranges.get(tensor)
            if tensor not in ranges:  # the same range serves every pass of this sample
                ranges[tensor] = reference_range(np.asarray(ref).reshape(-1), map_parts)
                if quant is not None and quant.levels:
                    self.run_time_ranges[tensor] = merge_run_time_ranges(self.run_time_ranges.get(tensor), run_time_range(ref, quant.levels))
            if quant is not None and quant.levels:  # quantized as the model runs: this sample's own grid
                quant = quant.of_sample(*ranges[tensor])
            sketch = own[index] if index in own else result.stats.sketch[self.row[tensor]]
            reduce_tensor(ref, cand, tolerance, quant, sample, ranges[tensor], (values[index], sketch), map_parts)

        # The largest tensors one at a time, each in parts on every core; the other large ones one by one on
        # every core; small ones in one batch per core (one by one, handing each over would cost more than
        # reducing it), or here when they hold fewer than PARALLEL_ELEMENTS // 4 in all (a decode step's: handing them over costs more).
        split = [i for i, (_, ref, _) in enumerate(pairs) if ref.size >= 2 * PART_ELEMENTS]
        for index in split:
            reduce_one(index, self._reducer.map)
        large = [i for i, (_, ref, _) in enumerate(pairs) if PARALLEL_ELEMENTS <= ref.size < 2 * PART_ELEMENTS]
        small = sorted(set(range(len(pairs))) - set(large) - set(split))
        few = sum(pairs[i][1].size for i in small) < PARALLEL_ELEMENTS // 4
        batches = [] if few else [small[k :: self._threads] for k in range(self._threads)]
        list(self._reducer.map(lambda batch: [reduce_one(index) for index in batch], [[i] for i in large] + batches))
        list(map(reduce_one, small if few else []))
        result.stats.add_rows([self.row[tensor] for tensor, _, _ in pairs], values, None)
        finished = finish_rows(values[list(own)], None) if own else {}  # the outputs' rows at once (one by one: most of a decoder's statistics)
        for at, index in enumerate(own):
            tensor = pairs[index][0]
            result.stats.sketch[self.row[tensor]] += own[index]
            sketches = result.sketches.setdefault(tensor, {figure: np.zeros(SKETCH_BUCKETS, np.int64) for figure in ("ratio", "kl")})
            low, high = ranges[tensor]
            absmax = max(abs(low), abs(high)) if low <= high else 0.0
            kind = self.kinds.get(tensor, UNKNOWN)
            threshold = threshold_for(tensor, kind.kind, self.thresholds)
            _, ref, cand = pairs[index]
            decision = decide(ref, cand, kind, self.tolerances.for_tensor(tensor), threshold, absmax, sketches, targets.get(tensor))
            result.outcomes.append(
                SampleOutcome(sample=sample, tensor=tensor, **{name: finished[name][at].item() for name in ("max_abs_err", "tol_ratio", "outside_share", "sqnr_db")},
                              **vars(decision))  # its fields as they are: asdict deep-copies each of its ~40 scalars
            )
            kept = result.points.setdefault(tensor, [])
            if len(kept) < self.points:
                kept += sample_points(sample, ref, cand, int(values[index][F["worst_index"]]), self.points - len(kept))

    @contextmanager
    def clock(self, phase: str) -> Iterator[None]:
        """Add the time the block takes to `phase`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start

    def close(self) -> None:
        """Collect what the runners know about what they observed, and shut them down."""
        for plan in self.passes:
            runners = [s.runner for s in getattr(self, "pass_segments", {}).get(plan.name, []) if s.runner is not None]
            result = self.results[plan.name]
            if runners:
                result = self.results[plan.name] = replace(result, label=runners[0].label, notices=list(dict.fromkeys(n for r in runners for n in r.notices)))
            for runner in runners:
                result.not_observable.update(runner.not_observable)
        for segment in getattr(self, "reference", []):
            if segment.runner is not None:
                self.reference_not_observable.update(segment.runner.not_observable)
        self._reducer.shutdown(wait=True)
        if getattr(self, "_beside", None) is not None:
            self._beside.shutdown(wait=True)
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
        made_ahead = [s.runner for s in self._all_segments() if s.ahead is not None and s.ahead.exception() is None]
        for runner in [*self._active, *made_ahead]:
            runner.deactivate()
        self._active = []

    def _all_segments(self) -> list[_Segment]:
        return [*getattr(self, "reference", []), *(s for segments in getattr(self, "pass_segments", {}).values() for s in segments)]


def _row(values: Mapping[str, np.ndarray], row: int) -> dict[str, np.ndarray]:
    """Row `row` of a batch's values (each keeps its rows axis, as one sample's own run returns it)."""
    return {name: value[row : row + 1] if value.ndim else value for name, value in values.items()}


def _make_active(segment: _Segment) -> None:
    """Make the segment's runner and activate it (on the caller's thread, or ahead on another)."""
    if segment.runner is None:
        segment.runner = segment.make()
    segment.runner.activate()

