"""TensorRT (10.x, 11.x or TensorRT-RTX) as the candidate: build (or reuse) the engine, then run it.

Inference uses the TensorRT tensor-address API with cuda-python buffers, so one code path serves graph
outputs and debug tensors (`--trt-mark unfused`), whose values arrive through an `IDebugListener`.
Outputs come back under their ONNX tensor names and align exactly with the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from accudiff.errors import AccudiffError
from accudiff.runners.base import Runner
from accudiff.runners.trt_build import BuildSettings, BuiltEngine, build_engine, error_log
from accudiff.runners.trt_env import import_tensorrt, is_rtx, require_inference


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

    def activate(self) -> None:
        self._trt = trt = import_tensorrt(self.module)
        require_inference(trt)
        if self.prebuilt is not None:
            if not Path(self.prebuilt).is_file():
                raise AccudiffError(f"engine file '{self.prebuilt}' does not exist")
            only_outputs = "a pre-built engine (--engine) exposes only its graph outputs"
            self.built = BuiltEngine(Path(self.prebuilt).read_bytes(), "outputs", [], {name: only_outputs for name in self.outputs})
        else:
            self.built = build_engine(trt, self.model_path, self.outputs, self.settings, self.cache_dir)
        self.label = f"{'TensorRT-RTX' if is_rtx(trt) else 'TensorRT'} {trt.__version__} (engine built from the candidate model, --trt-mark {self.built.mark})"
        self._runtime = trt.Runtime(error_log(trt))  # keeps TensorRT's messages off the console
        self._engine = self._runtime.deserialize_cuda_engine(self.built.plan)
        if self._engine is None:
            raise AccudiffError(f"TensorRT could not load the engine built for '{self.model_path.name}'")
        self._context = self._engine.create_execution_context()
        if self.layer_report is not None:
            self._write_layer_report()

    def infer(self, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        from cuda.bindings import runtime as cudart

        trt, engine, context = self._trt, self._engine, self._context
        stream = _check(cudart.cudaStreamCreate())
        allocations, outputs = [], {}
        debug = _debug_tensors(trt) if self.built.mark == "unfused" else None
        try:
            if debug is not None:
                context.set_debug_listener(debug)
                context.set_all_tensors_debug_state(True)
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            for name in names:
                if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                    array = np.ascontiguousarray(feed[name], dtype=trt.nptype(engine.get_tensor_dtype(name)))
                    context.set_input_shape(name, array.shape)
                    pointer = _device_copy_of(array, stream, allocations)
                    context.set_tensor_address(name, pointer)
            for name in names:
                if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                    host = np.empty(tuple(context.get_tensor_shape(name)), dtype=trt.nptype(engine.get_tensor_dtype(name)))
                    pointer = _check(cudart.cudaMallocAsync(max(host.nbytes, 1), stream))
                    allocations.append(pointer)
                    context.set_tensor_address(name, pointer)
                    outputs[name] = (host, pointer)
            if not context.execute_async_v3(stream):
                raise AccudiffError(f"TensorRT failed to run the engine for '{self.model_path.name}'")
            for host, pointer in outputs.values():
                _check(cudart.cudaMemcpyAsync(host.ctypes.data, pointer, host.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))
            _check(cudart.cudaStreamSynchronize(stream))
        finally:
            for pointer in allocations:
                cudart.cudaFreeAsync(pointer, stream)
            cudart.cudaStreamSynchronize(stream)
            cudart.cudaStreamDestroy(stream)
        results = {name: host for name, (host, _) in outputs.items()}
        if debug is not None:
            results.update(debug.tensors)
        self._received = set(results)
        return results

    def deactivate(self) -> None:
        self._context = self._engine = self._runtime = None

    @property
    def not_observable(self) -> dict[str, str]:
        reasons = dict(self.built.not_observable) if self.built else {}
        fused = "fused away by TensorRT (--trt-mark unfused observes only tensors that survive fusion)"
        for name in self.outputs:
            if name not in self._received and name not in reasons:
                reasons[name] = fused if self.built and self.built.mark == "unfused" else "not returned by the engine"
        return reasons

    @property
    def notices(self) -> list[str]:
        return list(self.built.notices) if self.built else []

    def _write_layer_report(self) -> None:
        """The engine inspector's layers, each mapped back to the ONNX nodes it covers (by node name)."""
        inspector = self._engine.create_engine_inspector()
        layers = json.loads(inspector.get_engine_information(self._trt.LayerInformationFormat.JSON)).get("Layers", [])
        import onnx

        nodes = [n.name for n in onnx.load(str(self.model_path), load_external_data=False).graph.node if n.name]
        for layer in layers:
            if isinstance(layer, dict):
                text = layer.get("Name", "")
                layer["onnx_nodes"] = [node for node in nodes if node in text]
        self.layer_report.write_text(json.dumps(layers, indent=2) + "\n")


def _check(result):
    """cuda-python returns (error, value...): raise on error, return the value."""
    error, *values = result if isinstance(result, tuple) else (result,)
    from cuda.bindings import runtime as cudart

    if error != cudart.cudaError_t.cudaSuccess:
        raise AccudiffError(f"CUDA call failed: {cudart.cudaGetErrorString(error)[1].decode()}")
    return values[0] if len(values) == 1 else (values or None)


def _device_copy_of(array: np.ndarray, stream, allocations: list) -> int:
    from cuda.bindings import runtime as cudart

    pointer = _check(cudart.cudaMallocAsync(max(array.nbytes, 1), stream))
    allocations.append(pointer)
    _check(cudart.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))
    return pointer


def _debug_tensors(trt):
    """An IDebugListener that copies every debug tensor to the host under its (ONNX) name."""
    from cuda.bindings import runtime as cudart

    class DebugTensors(trt.IDebugListener):
        def __init__(self):
            trt.IDebugListener.__init__(self)
            self.tensors: dict[str, np.ndarray] = {}

        def process_debug_tensor(self, address, location, dtype, shape, name, debug_stream):
            host = np.empty(tuple(shape), dtype=trt.nptype(dtype))
            cudart.cudaMemcpyAsync(host.ctypes.data, address, host.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, debug_stream)
            cudart.cudaStreamSynchronize(debug_stream)
            self.tensors[name] = host
            return True

    return DebugTensors()
