"""The messages between a run and its workers are typed and survive their encoded form whole: a job with every
field set to something other than its default, each of its passes too, and a worker's result likewise, come
back equal; two results merge as one worker would have added them up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from accudiff.execution.messages import Job, Layout, PassResult, PassSpec, WorkerResult
from accudiff.judging.decisions import SampleOutcome
from accudiff.judging.metrics import StatsSet


def _every_field_set() -> Job:
    passes = [
        PassSpec("candidate", "cand.onnx", "onnxrt", fed_from_reference={"x": "y"}, layer_report=True, samples=8, runs=8, record="rec",
                 recorded="captured", label="polygraphy runner 'trt'", fixed_inputs={"switch_0": True, "switch_1": False}, reuse=True),
        PassSpec("isolated", "iso.onnx", "trt"),
    ]
    return Job(
        reference="ref.onnx", passes=passes, precision="fp16", tensors=["a", "b"], outputs=["b"], segments=[["a"], ["b"]],
        tolerances={"atol": 1e-3}, quant_ranges={"a": {"scale": 0.5}}, samples=[["inputs.npz", "0/"]], sample_indices=[3], result="out",
        trt={"module": "tensorrt_rtx"}, input_shapes={"x": [1, 2]}, shape_values={"n": [4]}, store="store", layer_report="layers.json",
        inputs=["x"], input_specs=[["x", "float32", [1, 2]]], threads=2, run_samples=9, sessions_at_once=2, outputs_store="outs", largest_tensor=1 << 30,
        thresholds={"": 0.3}, output_kinds={"b": ["logits", -1]}, generation={"new_tokens": 4}, one_session_at_a_time=True, release_reused=True,
        validate=["given.onnx"],
        points=0,
    )


def test_a_job_survives_its_json_form_whole():
    job = _every_field_set()
    defaults = Job(reference="", passes=[], precision="", tensors=[], outputs=[], segments=[], tolerances={}, quant_ranges={}, samples=[],
                   sample_indices=[], result="")
    assert all(getattr(job, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(Job))  # every field is exercised
    assert all(getattr(job.passes[0], f.name) != f.default for f in dataclasses.fields(PassSpec) if f.default is not dataclasses.MISSING)
    again = Job.from_json(job.to_json())
    assert again == job and all(isinstance(p, PassSpec) for p in again.passes)


def test_a_pass_with_a_field_nobody_declared_is_refused_where_it_is_read():
    text = _every_field_set().to_json().replace('"reuse": true', '"reused": true')
    with pytest.raises(TypeError, match="reused"):
        Job.from_json(text)


def _a_result_with_every_field_set(seed: int) -> WorkerResult:
    rng = np.random.default_rng(seed)

    def stats(rows: int) -> StatsSet:
        found = StatsSet(rows)
        found.values[:] = rng.normal(size=found.values.shape)
        found.sketch[:, :3] = rng.integers(1, 9, size=(rows, 3))
        return found

    outcome = SampleOutcome(sample=2, tensor="logits", max_abs_err=0.5, tol_ratio=3.0, outside_share=0.25, sqnr_db=18.0, rows=4, top1=3, kl_sum=0.2)
    candidate = PassResult(
        stats(3), seen={0: ("float32", "float16", "1x4")}, notes={2: "shape differs"}, not_observable={"t": "fused"}, label="ONNX Runtime (CPU)",
        notices=["a notice"], outcomes=[outcome], points={"logits": [[2, 0.5, 0.75]]},
        sketches={"logits": {"ratio": np.arange(4, dtype=np.int64), "kl": np.ones(4, np.int64)}},
    )
    return WorkerResult(
        passes={"candidate": candidate, "isolated": PassResult(stats(3))}, inputs=stats(1), reference_not_observable={"r": "why"},
        timings={"sessions": 0.5}, layout=Layout(1, (2,)), run_time_ranges={"t": [1.0, 8.0, 2.0, -1.0, 1.0, -0.5, 0.5]},
        steps=[{"sample": 0, "phase": "prefill"}], generations=[{"sequence": 0, "reference": "abc"}],
    )


def _equal(a, b) -> bool:
    """Dataclasses, containers and arrays compared field by field (arrays by value)."""
    if isinstance(a, StatsSet):
        return isinstance(b, StatsSet) and np.array_equal(a.values, b.values) and np.array_equal(a.sketch, b.sketch)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_a_workers_result_survives_its_encoded_form_whole():
    result = _a_result_with_every_field_set(0)
    empty = WorkerResult({}, StatsSet(0))
    assert all(not _equal(getattr(result, f.name), getattr(empty, f.name)) for f in dataclasses.fields(WorkerResult))  # every field is exercised
    bare = PassResult(StatsSet(3))
    assert all(not _equal(getattr(result.passes["candidate"], f.name), getattr(bare, f.name)) for f in dataclasses.fields(PassResult))
    assert _equal(WorkerResult.decode(*result.encode()), result)
    assert not _equal(WorkerResult.decode(*_a_result_with_every_field_set(1).encode()), result)  # the comparison can fail


def test_two_workers_results_merge_as_one_worker_would_have_added_them():
    first, second = _a_result_with_every_field_set(0), _a_result_with_every_field_set(1)
    merged = first.merged(second)
    expected = StatsSet.from_arrays(first.passes["candidate"].stats.arrays())
    expected.merge(second.passes["candidate"].stats)
    assert _equal(merged.passes["candidate"].stats, expected)
    assert merged.layout == Layout(2, (2,)) and merged.timings == {"sessions": 1.0}
    assert len(merged.passes["candidate"].outcomes) == 2 and merged.steps == first.steps + second.steps
    assert np.array_equal(merged.passes["candidate"].sketches["logits"]["ratio"], 2 * np.arange(4))
    assert _equal(first, _a_result_with_every_field_set(0))  # merging made new values: the parts are as they were


def test_a_worker_closed_by_two_threads_at_once_is_closed_once():
    """Ctrl-C during verification: the thread running a worker's job and the caller's thread both closed the
    worker, and one read the stderr file the other had just closed ('internal error: ValueError: I/O operation
    on closed file'). The file here lets the first closer on only once the second has started, or after a
    while: without the lock between them, the second reads a closed file every time."""
    import threading

    from accudiff.execution.pool import Worker

    worker = Worker()
    entered, first_done = threading.Event(), threading.Event()
    real = worker._stderr
    callers = []

    class Interleaved:
        closed = property(lambda self: real.closed)

        def seek(self, offset: int) -> int:
            callers.append(threading.current_thread())
            if len(callers) == 1:
                entered.wait(2)  # the second closer's arrival, or none: it waits for the first (the lock)
            else:
                entered.set()
                first_done.wait(2)
            return real.seek(offset)

        def read(self) -> str:
            return real.read()

        def close(self) -> None:
            real.close()
            first_done.set()

    worker._stderr = Interleaved()
    errors = []

    def close() -> None:
        try:
            worker.close(kill=True)
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(callers) == 1
