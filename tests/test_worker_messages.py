"""The messages between a run and its workers are typed and survive their JSON form whole: a job with every
field set to something other than its default, each of its passes too, comes back equal."""

from __future__ import annotations

import dataclasses

import pytest

from accudiff.execution.messages import Job, PassSpec


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
        inputs=["x"], input_specs=[["x", "float32", [1, 2]]], threads=2, run_samples=9, outputs_store="outs", largest_tensor=1 << 30,
        thresholds={"": 0.3}, output_kinds={"b": ["logits", -1]}, generation={"new_tokens": 4}, one_session_at_a_time=True,
        validate=["given.onnx"],
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
