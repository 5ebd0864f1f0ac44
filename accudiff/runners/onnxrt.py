"""ONNX Runtime on CPU, in a child process, with chosen tensors marked as outputs.

Running the session in a child process means a native crash (seen on converted models) becomes a
clear error naming the model and step. Results come back as memory-mapped .npy files, so the parent
holds no copy of them: the statistics pass reads each tensor straight from the page cache.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from accudiff.errors import AccudiffError
from accudiff.runners.base import Runner
from accudiff.runners.outputs import NpyFiles


class OnnxrtRunner(Runner):
    def __init__(
        self,
        model_path: str | Path,
        outputs: Sequence[str] = (),
        label: str = "ONNX Runtime CPU",
        emulate_fp16: bool = False,
    ):
        """`emulate_fp16`: run an FP16 model through `fp16_emulation`, so every FP16 tensor is really rounded."""
        self.model_path = Path(model_path)
        self.outputs = list(outputs)
        self.label = label
        self.emulate_fp16 = emulate_fp16
        self._process: subprocess.Popen | None = None
        self._scratch: Path | None = None
        self._marked: list[str] | None = None
        self._calls = 0

    def activate(self) -> None:
        """Start the worker and let it load the model in the background; `infer` waits for it."""
        # Tensor files go to the OS temp folder (TMPDIR): on disk, they never count against memory.
        self._scratch = Path(tempfile.mkdtemp(prefix="accudiff-ort-"))
        self._stderr = open(self._scratch / "stderr.txt", "w+")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "accudiff.runners.onnxrt_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._send(
            {
                "op": "load",
                "model": str(self.model_path),
                "outputs": self.outputs,
                "emulate_fp16": self.emulate_fp16,
                "scratch": str(self._scratch),
            }
        )

    def infer(self, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        self._wait_until_loaded()
        self._calls += 1
        step = self._scratch / f"run{self._calls}"
        shutil.rmtree(self._scratch / f"run{self._calls - 1}", ignore_errors=True)  # earlier maps stay valid: unlinked, not truncated
        step.mkdir()
        with open(step / "inputs.npz", "wb") as handle:
            np.savez(handle, **feed)
        reply = self._request({"op": "infer", "inputs": str(step / "inputs.npz"), "out_dir": str(step)}, "running")
        return NpyFiles(reply["files"])

    def deactivate(self) -> None:
        if self._process is not None:
            self._process.kill()  # it holds nothing worth a graceful exit, and tearing down a session is slow
            self._process.wait()
            for stream in (self._process.stdin, self._process.stdout):
                stream.close()
            self._process = None
            self._stderr.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    @property
    def not_observable(self) -> dict[str, str]:
        marked = set(self._marked or [])
        return {name: "ONNX Runtime did not return it" for name in self.outputs if name not in marked}

    def _wait_until_loaded(self) -> None:
        if self._marked is None:
            self._marked = self._read_reply("loading")["outputs"]

    def _send(self, request: dict) -> None:
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died; the read that follows reports how

    def _request(self, request: dict, step: str) -> dict:
        self._send(request)
        return self._read_reply(step)

    def _read_reply(self, step: str) -> dict:
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise AccudiffError(f"ONNX Runtime {_how_it_died(code)} while {step} '{self.model_path.name}'{self._stderr_tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise AccudiffError(f"ONNX Runtime failed while {step} '{self.model_path.name}': {reply['error']}")
        return reply

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        lines = [line.strip() for line in self._stderr.read().splitlines() if line.strip()]
        return f" (last message: {lines[-1]})" if lines else ""


def _how_it_died(code: int) -> str:
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"crashed (signal {-code})"
    return f"exited unexpectedly (code {code})"


