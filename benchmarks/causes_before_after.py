"""The cause and repair each trained model gets from the rules alone (`--no-verify`) and verified, with the
brute-force oracle's best single keep beside them, on the output's worst sample (tests/oracle.py: FP16 and BF16; it runs every converted
node kept alone, so it takes minutes on the larger models).

    python benchmarks/causes_before_after.py [--models ppocr_rec_v4 magika_v3 ...] [--precisions fp16 bf16 int8] [--no-oracle]

Inputs are realistic (benchmarks/realistic_inputs.py, two samples; INT8 calibrated on four others), the
candidate ONNX Runtime, the options a user would pass. One Markdown row per model and precision.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import accudiff  # noqa: E402
from accudiff.model.loading import load_model  # noqa: E402
from accudiff.transforms.opset import at_forms_opset  # noqa: E402
import oracle  # noqa: E402
from benchmarks import models, realistic_inputs  # noqa: E402

TRAINED = ["magika_v3", "ppocr_rec_v4", "ppocr_cls_v2", "ppocr_det_v4", "nudenet_320n", "silero_vad"]


def _best_tried(cause) -> str | None:
    tried = [c for c in cause.contributors if c.tol_ratio_kept is not None]
    return min(tried, key=lambda c: c.tol_ratio_kept).node if tried else None


def named(cause) -> str:
    if cause.kind in ("local", "several"):
        others = "".join(f" + {c.node}" for c in cause.co_causes)
        return f"{cause.kind}: {cause.op_type} {cause.node}{others}"
    best = next((c for c in cause.contributors if c.node == _best_tried(cause)), None)
    if best is not None:
        return f"{cause.kind} (best of {len(cause.contributors)} tried: {best.node}, {best.tol_ratio_kept:.3g}x)"
    return cause.kind


def repaired(failure) -> str:
    repair = failure.repair
    if repair is None:
        return "-"
    steps = " -> ".join(f"{s.tol_ratio:.3g}x" for s in repair.steps)
    return f"{len(repair.keep)} node(s), {steps}{'' if repair.verified else ' (not verified)'}"


def row(name: str, precision: str, with_oracle: bool, folder: Path) -> str:
    path = models.MODELS[name](folder)
    feeds = realistic_inputs.dataset(name, 2)
    options = {"candidate": "onnxrt", "inputs": feeds}
    if precision == "int8":
        calibration = folder / f"{name}-calibration.npz"
        np.savez(calibration, **{f"{i}/{k}": v for i, sample in enumerate(realistic_inputs.dataset(name, 4, 100)) for k, v in sample.items()})
        options["calib_data"] = calibration
    # An old opset has no BF16 Conv: accudiff compares such a model at opset 22, and the oracle must round
    # the same graph (at opset 12 its BF16 Casts would be refused node by node, and it would round nothing).
    path = at_forms_opset(load_model(path), precision, folder)[0].path
    rules = accudiff.compare(path, precision, verify=False, **options)
    verified = accudiff.compare(path, precision, **options)
    if not verified.output_failures:
        return f"| {name} | {precision} | passes | | | |"
    lines = []
    rules_by_output = {f.tensor: f for f in rules.output_failures}
    for failure in verified.output_failures:
        before = rules_by_output.get(failure.tensor)
        best = "no keep-one oracle for INT8" if precision == "int8" else "not run (--no-oracle)"
        if with_oracle and precision in ("fp16", "bf16"):
            tol = verified.tolerances.default
            worst = feeds[int(verified.failing_samples.query("tensor == @failure.tensor")["sample"].iloc[0])]
            values = oracle.reference_values(path, worst)
            ranking = oracle.single_keep_ranking(path, values, worst, set(verified.converted), (tol.atol, tol.rtol, tol.stol), failure.tensor, precision)
            rank = {node: k + 1 for k, (_, node) in enumerate(ranking)}
            ours = failure.cause.node or _best_tried(failure.cause)
            best = f"{ranking[0][1]} {ranking[0][0]:.3g}x (of {len(ranking)}); rank of {ours}: {rank.get(ours, '-')}"
        lines.append(f"| {name} | {precision} | {failure.tensor} | {named(before.cause) if before else '-'} | {named(failure.cause)}; repair {repaired(failure)} | {best} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=TRAINED, choices=TRAINED)
    parser.add_argument("--precisions", nargs="+", default=["fp16", "int8"], choices=["fp16", "bf16", "int8"])
    parser.add_argument("--no-oracle", action="store_true")
    args = parser.parse_args()
    print("| model | precision | output | rules alone (--no-verify) | verified cause; repair (ratio per step) | oracle's best single keep (the output's worst sample) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for precision in args.precisions:
                print(row(name, precision, not args.no_oracle, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
