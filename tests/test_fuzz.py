"""Damaged files: every reader turns what its parser raises into one sentence naming the file (never an
internal error), and a seeded share of benchmarks/fuzz.py's mutation cases runs here."""

from __future__ import annotations

import io
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from accudiff.cli import main
from accudiff.errors import AccudiffError
from accudiff.model.inputs import save_feeds
from accudiff.checks.baselines import read_baseline
from conftest import ROOT, fixture

sys.path.insert(0, str(ROOT))
from benchmarks import fuzz  # noqa: E402

CASES_PER_FORMAT = 6  # x 7 formats; `python benchmarks/fuzz.py --cases N` runs many more


@pytest.fixture(scope="module")
def seeds():
    with tempfile.TemporaryDirectory(prefix="accudiff-fuzz-seeds-") as folder:
        yield fuzz._seed_files(Path(folder))


@pytest.mark.parametrize("fmt", fuzz.FORMATS)
def test_mutated_files_end_in_a_result_or_one_sentence(fmt, seeds, tmp_path):
    defects = [o for o in (fuzz.run_case(fmt, case, seeds, tmp_path) for case in range(CASES_PER_FORMAT)) if o.defect]
    assert not defects, [f"case {o.case}: {o.defect}: {o.message}" for o in defects]


def _compare(args: list[str], capsys) -> tuple[int, str]:
    code = main(["compare", *args, "--fp16", "--candidate", "onnxrt", "--no-verify"])
    return code, capsys.readouterr().err.strip()


def test_a_name_that_is_not_utf8_is_one_sentence(tmp_path, capsys):
    """protobuf hands an undecodable name over as bytes: the checker raised UnicodeDecodeError, and a
    name it let through broke the worker's JSON job later."""
    data = fixture("layernorm_overflow").read_bytes()
    assert data.count(b"centered") > 0
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(data.replace(b"centered", b"c\xe5ntered", 1))  # same length: the protobuf stays well formed
    code, err = _compare([str(damaged), "-o", str(tmp_path / "r")], capsys)
    assert code == 2 and err.count("\n") == 0
    assert "is not a valid ONNX model: a NodeProto" in err and "is not UTF-8 text" in err
    assert not (tmp_path / "r").exists()


def _npz(tmp_path: Path) -> tuple[Path, Path]:
    model = fixture("layernorm_overflow")
    info_inputs = onnx.load(str(model)).graph.input
    shape = [d.dim_value for d in info_inputs[0].type.tensor_type.shape.dim]
    path = tmp_path / "inputs.npz"
    save_feeds([{info_inputs[0].name: np.ones(shape, np.float32)}], path)
    return model, path


@pytest.mark.parametrize("flag, why", [(0x1, "encrypted"), (0x20, "flag bit 5")])
def test_zip_members_the_zip_layer_refuses_are_one_sentence(flag, why, tmp_path, capsys):
    """zipfile raises RuntimeError for an encrypted member and NotImplementedError for compressed patched data."""
    model, path = _npz(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")  # the central directory entry: general-purpose flags at offset 8
    data[at + 8] |= flag
    path.write_bytes(bytes(data))
    code, err = _compare([str(model), "--load-inputs", str(path)], capsys)
    assert code == 2 and err.count("\n") == 0 and err.startswith("accudiff: error: ") and "could not be read" in err, err


@pytest.mark.parametrize("member", [b"\x93NUMPY\x01\x00\x20\x00{'descr': '<f4', 'shape': (1,  \n", b"not an array at all"])
def test_npy_members_numpy_cannot_parse_are_one_sentence(member, tmp_path, capsys):
    """A header numpy tokenizes as Python raised tokenize.TokenError; a member without the .npy magic came back as bytes."""
    model, path = _npz(tmp_path)
    name = onnx.load(str(model)).graph.input[0].name
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"{name}.npy", member)
    path.write_bytes(buffer.getvalue())
    code, err = _compare([str(model), "--load-inputs", str(path)], capsys)
    assert code == 2 and err.count("\n") == 0 and "could not be read" in err, err


@pytest.mark.parametrize("text", ["{", '{"tensors": []}', '{"tensors": {"y": {"sqnr_db": "high"}}}', '{"schema": 1}',
                                  '{"tensors": {}, "decisions": {"y": {"kl": {"value": "x", "low": 0, "high": 1}}}}', '{"tensors": {}, "decisions": []}'])
def test_a_damaged_baseline_is_one_sentence(text, tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(text)
    with pytest.raises(AccudiffError, match=r"^baseline '.*' cannot be read \(.*\): delete it, or run with --accudiff-update-baseline"):
        read_baseline(path)


def test_a_weight_whose_data_does_not_fill_its_shape_is_one_sentence(tmp_path, capsys):
    """The checker lets a weight through whose data holds more values than its dims say; the FP16
    transform's read of it raised 'cannot reshape array' (found by benchmarks/fuzz.py, onnx case 660)."""
    proto = onnx.load(str(fixture("layernorm_overflow")))
    weight = max(proto.graph.initializer, key=lambda t: len(t.raw_data))
    weight.dims[-1] -= 1
    damaged = tmp_path / "damaged.onnx"
    onnx.save(proto, str(damaged))
    code, err = _compare([str(damaged)], capsys)
    assert code == 2 and err.count("\n") == 0, err
    assert f"weight '{weight.name}' holds" in err and "values for shape" in err


def test_a_large_weight_holding_values_twice_is_one_sentence(tmp_path, capsys):
    """The checker sees the graph without its large weights' bytes (it used to read a third copy of the
    file): a weight with values in raw_data and float_data both, which it refused, is still refused."""
    values = np.arange(4096, dtype=np.float32).reshape(64, 64)
    weight = onnx.numpy_helper.from_array(values, "w")
    weight.float_data.extend([0.0])
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])], [weight])
    damaged = tmp_path / "twice.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), str(damaged))
    code, err = _compare([str(damaged)], capsys)
    assert code == 2 and err.count("\n") == 0 and "weight 'w' holds values in 2 fields" in err, err


@pytest.mark.parametrize("option, value, said", [
    ("--val-range", "1e999,nan", "must have finite bounds"),  # was: internal error, OverflowError from NumPy's uniform
    ("--val-range", "0,1e39", "goes beyond what float32 holds"),  # was: infinite inputs, compared as if meant
    ("--iterations", "99999999999", "GiB of inputs, more than the"),  # was: generating until the machine gave up
    ("--seed", "-1", "--seed must be 0 or more"),  # was: internal error, ValueError from NumPy's default_rng
])
def test_adversarial_generation_options_are_one_sentence(option, value, said, tmp_path, capsys):
    code, err = _compare([str(fixture("clean")), option, value, "-o", str(tmp_path / "r")], capsys)
    assert code == 2 and err.count("\n") == 0 and said in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("option, value, said", [
    ("--keep-fp32", "MatMul", "--keep-fp32 'MatMul' matches no node of the model"),
    ("--workers", "-3", "--workers must be at least 1"),
])
def test_a_bisector_refuses_a_bad_option_before_its_first_step(option, value, said, tmp_path, capsys):
    """The bisectors printed "step 1: compare the whole model ..." before the sentence (found by fuzz.py)."""
    for bisector in ("precision", "subgraph"):
        code = main(["bisect", bisector, str(fixture("if_model")), "--fp16", option, value, "-o", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and said in err, err
        assert list(tmp_path.iterdir()) == []  # no report, and no hidden .r.partial-* staging folder either


def test_a_captured_array_numpy_cannot_parse_is_one_sentence(tmp_path, capsys):
    """A RunResults array whose .npy header NumPy's tokenizer rejects raised tokenize.TokenError (found by
    benchmarks/fuzz.py, run-results case 52)."""
    import base64
    import json

    from accudiff.model.run_results import write_run_results

    model = fixture("layernorm_overflow")
    save_feeds([{"x": np.ones((1, 8, 64), np.float32)}], tmp_path / "inputs.npz")
    write_run_results(tmp_path / "candidate.json", "trt-runner-N0", [{"y": np.ones((1, 8, 16), np.float32)}])
    document = json.loads((tmp_path / "candidate.json").read_text())
    bad = b"\x93NUMPY\x01\x00\x20\x00{'descr': '<f4', 'shape': (1,  \n"
    document["lst"][0][1][0]["outputs"]["y"]["values"]["array"] = base64.b64encode(bad).decode()
    (tmp_path / "candidate.json").write_text(json.dumps(document))
    code = main(["compare", str(model), "--fp16", "--load-inputs", str(tmp_path / "inputs.npz"), "--load-candidate", str(tmp_path / "candidate.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "tensor 'y' of iteration 0 cannot be decoded" in err, err
