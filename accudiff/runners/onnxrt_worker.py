"""Child process that owns one ONNX Runtime session (see `OnnxrtRunner`).

Protocol: one JSON object per line on stdin, one JSON reply per line on the original stdout.
* {"op": "load", "model": path, "outputs": [names], "emulate_fp16": bool, "scratch": dir}
  -> {"ok": true, "outputs": [names marked]}
* {"op": "infer", "inputs": npz path, "out_dir": dir} -> {"ok": true, "files": {name: file}}
Arrays travel as .npy files (no pickle anywhere); errors come back as {"ok": false, "error": text}.
A native crash kills only this process; the parent turns that into a clear error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx


def _load(request: dict) -> tuple[object, dict[str, str], dict]:
    """The session, and for each marked output the tensor name it answers for."""
    import onnxruntime as ort

    payload, fp16_copies = _marked_model(request)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(payload, options, providers=["CPUExecutionProvider"])
    answers_for = {copy: name for name, copy in fp16_copies.items()}
    tensors = {o.name: answers_for.get(o.name, o.name) for o in session.get_outputs()}
    return session, tensors, {"ok": True, "outputs": list(tensors.values())}


def _marked_model(request: dict) -> tuple[str, dict[str, str]]:
    """The model with the requested tensors marked as outputs, saved beside its weights as external data:
    ONNX Runtime then maps the weights from the file instead of copying them out of a protobuf."""
    from accudiff.model.loading import clear_unknown_dims
    from accudiff.runners.fp16_emulation import lower_fp16

    model = onnx.load(request["model"], load_external_data=True)
    clear_unknown_dims(model)  # a size written as 0 means "unknown", not an empty tensor
    fp16_copies = lower_fp16(model) if request.get("emulate_fp16") else {}
    existing = {o.name for o in model.graph.output}
    marked = (fp16_copies.get(name, name) for name in request["outputs"])
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in marked if name not in existing)
    target = Path(request["scratch"]) / "marked.onnx"
    onnx.save(model, str(target), save_as_external_data=True, location="marked.onnx.data", size_threshold=1024)
    return str(target), fp16_copies


def _infer(session, tensors: dict[str, str], request: dict) -> dict:
    wanted = {i.name: i.type for i in session.get_inputs()}
    with np.load(request["inputs"], allow_pickle=False) as archive:
        feed = {key: archive[key] for key in archive.files}
    for key, value in feed.items():
        if value.dtype == np.float16 and wanted.get(key) == "tensor(float)":
            feed[key] = value.astype(np.float32)  # an FP16 input of a model lowered for emulation
    results = session.run(list(tensors), feed)
    out_dir = Path(request["out_dir"])
    files = {}
    for index, (name, value) in enumerate(zip(tensors.values(), results)):
        if not isinstance(value, np.ndarray):
            continue  # sequences and maps are not compared
        path = out_dir / f"{index}.npy"
        np.save(path, value, allow_pickle=False)
        files[name] = str(path)
    return {"ok": True, "files": files}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    session, tensors = None, {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                session, tensors, reply = _load(request)
            else:
                reply = _infer(session, tensors, request)
        except Exception as exc:  # reported to the parent, which words it for the user
            reply = {"ok": False, "error": str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
