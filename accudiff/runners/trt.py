"""TensorRT (10.x, 11.x or TensorRT-RTX) as the candidate: build (or reuse) the engine, then run it.

Execution is polygraphy's `TrtRunner` (NVIDIA runs it on GPUs in its own tests): it sets input shapes and
addresses, allocates outputs (data-dependent shapes through its `IOutputAllocator`), runs the engine on
its own stream and copies the outputs back. accudiff adds what polygraphy does not do for it:

* with `--trt-mark unfused`, an `IDebugListener` that reads every debug tensor under its ONNX name. The
  bindings call it with the device address as an integer (TensorRT's pyCore.cpp passes
  `reinterpret_cast<size_t>(addr)`), although the method's docstring types it as a capsule: both are
  accepted. TensorRT prints and swallows an exception raised in the callback, so the listener keeps
  what went wrong and `infer` raises it. Types numpy lacks are decoded (BF16, FP8 E4M3) or listed as
  not observable with the reason (4-bit types, E8M0 scales).
* the engine inspector's layers mapped to ONNX nodes exactly, by the `[ONNX Layer: name]` metadata the
  ONNX parser gives every layer it creates (a fused layer carries several).
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from accudiff.errors import AccudiffError, first_line, missing
from accudiff.runners.base import Runner
from accudiff.runners.trt_build import BuildSettings, BuiltEngine, build_engine, error_log
from accudiff.runners.trt_env import import_tensorrt, is_rtx, require_inference

_ONNX_LAYER = re.compile(r"\[ONNX Layer: (.*?)(?: \| [^\]]*)?\]")


class TrtRunner(Runner):
    def __init__(
        self,
        model_path: Path,
        outputs: Sequence[str],
        settings: BuildSettings,
        module: str | None = None,
        cache_dir: Path | None = None,
        layer_report: Path | None = None,
        prebuilt: Path | None = None,
    ):
        """`layer_report`: where to write the engine inspector's layer information (JSON), if anywhere.
        `prebuilt`: an engine file to run instead of building one (it exposes only its graph outputs)."""
        self.model_path, self.outputs, self.settings = Path(model_path), list(outputs), settings
        self.module, self.cache_dir, self.layer_report, self.prebuilt = module, cache_dir, layer_report, prebuilt
        self.built: BuiltEngine | None = None
        self._received: set[str] = set()
        self._listener = None

    def activate(self) -> None:
        self._trt = trt = import_tensorrt(self.module)
        require_inference(trt)
        if self.prebuilt is not None:
            if not Path(self.prebuilt).is_file():
                raise missing(self.prebuilt, f"engine file '{self.prebuilt}'")
            only_outputs = "a pre-built engine (--engine) exposes only its graph outputs"
            self.built = BuiltEngine(Path(self.prebuilt).read_bytes(), "outputs", [], {name: only_outputs for name in self.outputs})
        else:
            self.built = build_engine(trt, self.model_path, self.outputs, self.settings, self.cache_dir)
        self.label = f"{'TensorRT-RTX' if is_rtx(trt) else 'TensorRT'} {trt.__version__} (engine built from the candidate model, --trt-mark {self.built.mark})"
        self._runtime = trt.Runtime(error_log(trt))  # keeps TensorRT's messages off the console
        self._engine = self._runtime.deserialize_cuda_engine(self.built.plan)
        if self._engine is None:
            raise AccudiffError(f"TensorRT could not load the engine built for '{self.model_path.name}'")
        self._listener = debug_listener(trt) if self.built.mark == "unfused" else None
        self._runner = polygraphy_runner(trt, self._engine, self._listener)
        self._guarded("starting", self._runner.activate)
        if self.layer_report is not None:
            self._write_layer_report()

    def infer(self, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        engine, trt = self._engine, self._trt
        inputs = {}
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                reading = host_reading(trt, engine.get_tensor_dtype(name))
                if isinstance(reading, str) or reading[1] is not None:  # no numpy type to write it in
                    raise AccudiffError(f"the engine's input '{name}' is {engine.get_tensor_dtype(name).name}: accudiff cannot feed that type")
                inputs[name] = np.asarray(feed[name], dtype=reading[0], order="C")  # ascontiguousarray would make a scalar 1-d
                built_for = self.settings.shape_values.get(name)
                if engine.is_shape_inference_io(name) and built_for is not None and inputs[name].reshape(-1).tolist() != list(built_for):
                    raise AccudiffError(
                        f"TensorRT reads input '{name}' as a shape and its engine was built for the first sample's value {list(built_for)}; "
                        f"this sample has {inputs[name].reshape(-1).tolist()}: compare samples with other values separately"
                    )
        if self._listener is not None:
            self._listener.clear()
        outputs = self._guarded("running", lambda: self._runner.infer(inputs, copy_outputs_to_host=True))
        results = {name: np.asarray(value) for name, value in outputs.items()}
        if self._listener is not None:
            if self._listener.errors:
                raise AccudiffError(f"reading TensorRT's debug tensors of '{self.model_path.name}' failed: {self._listener.errors[0]}")
            results.update(self._listener.tensors)
        self._received = set(results)
        return results

    def deactivate(self) -> None:
        if getattr(self, "_runner", None) is not None and self._runner.is_active:
            self._runner.deactivate()
        self._runner = self._engine = self._runtime = None

    @property
    def not_observable(self) -> dict[str, str]:
        reasons = dict(self.built.not_observable) if self.built else {}
        if self._listener is not None:
            reasons.update(self._listener.unreadable)
        fused = "fused away by TensorRT (--trt-mark unfused observes only tensors that survive fusion)"
        for name in self.outputs:
            if name not in self._received and name not in reasons:
                reasons[name] = fused if self.built and self.built.mark == "unfused" else "not returned by the engine"
        return reasons

    @property
    def notices(self) -> list[str]:
        return list(self.built.notices) if self.built else []

    def _guarded(self, step: str, call: Callable):
        """polygraphy reports failures (its own and CUDA's) as PolygraphyException: one sentence of ours."""
        from polygraphy.exception import PolygraphyException

        try:
            return call()
        except PolygraphyException as exc:
            raise AccudiffError(f"TensorRT failed while {step} the engine for '{self.model_path.name}': {first_line(exc)}") from exc

    def _write_layer_report(self) -> None:
        """The engine inspector's layers, each with the ONNX nodes it was built from."""
        inspector = self._engine.create_engine_inspector()
        layers = json.loads(inspector.get_engine_information(self._trt.LayerInformationFormat.JSON)).get("Layers", [])
        import onnx

        names = {n.name for n in onnx.load(str(self.model_path), load_external_data=False).graph.node if n.name}
        report = [{**(layer if isinstance(layer, dict) else {"Name": layer}), "onnx_nodes": layer_nodes(layer, names)} for layer in layers]
        self.layer_report.write_text(json.dumps(report, indent=2) + "\n")


def layer_nodes(layer: dict | str, node_names: set[str]) -> list[str]:
    """The ONNX nodes an engine layer was built from, exactly: from its `[ONNX Layer: name]` metadata
    (written by the ONNX parser, kept by the inspector at detailed profiling verbosity; a fused layer
    lists several), else from its name when that is a node's name or a ` + `-joined list of them."""
    if isinstance(layer, dict) and layer.get("Metadata"):
        found = [name for name in _ONNX_LAYER.findall(layer["Metadata"]) if name in node_names]
        return list(dict.fromkeys(found))
    name = layer.get("Name", "") if isinstance(layer, dict) else str(layer)
    parts = [name] if name in node_names else name.split(" + ")
    return [part for part in dict.fromkeys(parts) if part in node_names]


def polygraphy_runner(trt, engine, listener):
    """polygraphy's TrtRunner for `engine`, on the same TensorRT module (tensorrt or tensorrt_rtx)."""
    import polygraphy.config

    polygraphy.config.USE_TENSORRT_RTX = is_rtx(trt)  # read when polygraphy's TensorRT module is first imported
    from polygraphy.backend.trt import TrtRunner as PolygraphyTrtRunner
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR  # its progress lines are not ours to print
    return PolygraphyTrtRunner(engine, name="accudiff", debug_listener=listener)


def device_pointer(address) -> int:
    """A debug tensor's address as an integer: given as one, or wrapped in a PyCapsule."""
    if isinstance(address, int):
        return address
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype, api.PyCapsule_GetPointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    pointer = api.PyCapsule_GetPointer(address, api.PyCapsule_GetName(address))
    if not pointer:
        raise AccudiffError(f"TensorRT passed a debug tensor address accudiff cannot read ({type(address).__name__})")
    return pointer


def host_reading(trt, dtype) -> tuple[np.dtype, Callable[[np.ndarray], np.ndarray] | None] | str:
    """How to read a TensorRT type on the host: (storage dtype, decoder or None), or why it cannot be."""
    try:
        return np.dtype(trt.nptype(dtype)), None
    except TypeError:
        pass
    name = getattr(dtype, "name", str(dtype))
    if name == "BF16":
        return np.dtype(np.uint16), bfloat16_to_float32
    if name == "FP8":
        return np.dtype(np.uint8), fp8_e4m3_to_float32
    return f"TensorRT holds it as {name}, which has no numpy form (packed 4-bit values or block scales): not compared"


def bfloat16_to_float32(raw: np.ndarray) -> np.ndarray:
    """BF16 is the upper half of an FP32: widen exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _fp8_e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    normal = (1 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    values = sign * np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, normal)
    values[(exponent == 0xF) & (mantissa == 0x7)] = np.nan  # E4M3FN: no infinities, one NaN per sign
    return values.astype(np.float32)


_FP8_E4M3 = _fp8_e4m3_table()


def fp8_e4m3_to_float32(raw: np.ndarray) -> np.ndarray:
    """TensorRT's FP8 (E4M3FN) decoded exactly through a 256-entry table."""
    return _FP8_E4M3[raw]


def debug_listener(trt):
    """An IDebugListener that copies every debug tensor to the host under its (ONNX) name."""

    class DebugTensors(trt.IDebugListener):
        def __init__(self):
            trt.IDebugListener.__init__(self)
            self.tensors: dict[str, np.ndarray] = {}
            self.unreadable: dict[str, str] = {}
            self.errors: list[str] = []

        def clear(self) -> None:
            self.tensors, self.errors = {}, []

        def process_debug_tensor(self, addr, location, type, shape, name, stream):  # noqa: A002 (TensorRT's names)
            try:
                self._read(addr, location, type, tuple(shape), name, stream)
            except Exception as exc:  # TensorRT would print it and carry on: infer raises it instead
                self.errors.append(f"debug tensor '{name}': {first_line(exc)}")
            return True

        def _read(self, addr, location, dtype, shape, name, stream) -> None:
            from polygraphy import cuda

            reading = host_reading(trt, dtype)
            if isinstance(reading, str):
                self.unreadable[name] = reading
                return
            storage, decode = reading
            host = np.empty(shape, dtype=storage)
            pointer = device_pointer(addr)
            if location == trt.TensorLocation.HOST:
                ctypes.memmove(host.ctypes.data, pointer, host.nbytes)
            else:
                cuda.wrapper().memcpy(dst=host.ctypes.data, src=pointer, nbytes=host.nbytes, kind=cuda.MemcpyKind.DeviceToHost, stream_ptr=int(stream))
                cuda.wrapper().stream_synchronize(int(stream))  # the address is valid only during this call
            self.tensors[name] = decode(host) if decode is not None else host

    return DebugTensors()
