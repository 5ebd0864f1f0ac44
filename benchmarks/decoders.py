"""Decoder language models as users deploy them, made here: nothing is downloaded.

* `trained_llama`: a small Llama-architecture model (grouped-query attention with 8 query and 2 key/value
  heads, rotary positions, RMSNorm, SiLU MLP, a byte vocabulary) trained on this CPU for about two minutes
  on Python's own standard library source, saved as a Hugging Face checkpoint folder with its tokenizer;
* `trained_windowed`: a smaller Gemma2-architecture model trained the same way, whose alternate layers attend over
  a sliding window of 16 positions: built by the GenAI builder, those layers carry a window-sized KV cache
  (GroupQueryAttention's sliding_window_cache), evicting as prompts run past it;
* `random_llama`: the same architecture at TinyLlama's shape (1.1B parameters, 22 layers, vocabulary 32000),
  randomly initialised, for the scale benchmark;
* `genai_model`: such a checkpoint built by the ONNX Runtime GenAI model builder (`onnxruntime_genai.models.builder`,
  `-e cpu`) in fp32, fp16 or int4, with its `--extra_options`: the folder it writes (model.onnx, its data,
  genai_config.json, the tokenizer).
* `source_prompts`: lines of standard library source the model was not trained on, as prompts.

Each needs torch and transformers (and onnxruntime-genai for the builder) and raises ModuleNotFoundError
without them. Training and building run in a process of their own (`python -m benchmarks.decoders`), and
their folders are made once: callers share one folder, guarded by a lock (parallel test workers).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

BYTES = 256
BOS, EOS = 256, 257
TRAINED = dict(hidden=128, layers=4, heads=8, kv_heads=2, steps=1200, context=128, batch=16)
WINDOWED = dict(hidden=64, layers=2, heads=4, kv_heads=2, steps=400, context=64, batch=16, window=16)
TINYLLAMA = dict(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000)
TRAINING_FILES = slice(0, 80)  # the standard library files (by name) the model learns from; prompts come from others
PROMPT_FILES = slice(100, 160)


def _require(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"the '{module}' package is not installed (needed to make the decoder models; see .ci/run)", name=module)


@contextlib.contextmanager
def _made_once(target: Path):
    """Hold a lock on `target`'s folder while it is made (another process waits, then finds it made)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _stdlib_files() -> list[Path]:
    return sorted(Path(os.__file__).parent.glob("*.py"))


def trained_llama(folder: Path) -> Path:
    """The trained checkpoint folder (`folder/llama-trained-<recipe>-hf`), made once per recipe."""
    recipe = "-".join(f"{value}" for value in TRAINED.values())
    target = Path(folder).resolve() / f"llama-trained-{recipe}-hf"  # absolute: the process that makes it runs elsewhere
    with _made_once(target):
        if not (target / "config.json").is_file():
            _require("torch", "transformers", "tokenizers")
            _run(["train", str(target)])
    return target


def trained_windowed(folder: Path) -> Path:
    """The trained windowed checkpoint folder (`folder/gemma2-windowed-trained-<recipe>-hf`), made once per recipe."""
    recipe = "-".join(f"{value}" for value in WINDOWED.values())
    target = Path(folder).resolve() / f"gemma2-windowed-trained-{recipe}-hf"
    with _made_once(target):
        if not (target / "config.json").is_file():
            _require("torch", "transformers", "tokenizers")
            _run(["train-windowed", str(target)])
    return target


def random_llama(folder: Path) -> Path:
    """A randomly initialised checkpoint of TinyLlama's shape (`folder/llama-1.1b-random-hf`, 4.4 GB), made once."""
    target = Path(folder).resolve() / "llama-1.1b-random-hf"
    with _made_once(target):
        if not (target / "config.json").is_file():
            _require("torch", "transformers", "tokenizers")
            _run(["random", str(target)])
    return target


def genai_model(checkpoint: Path, folder: Path, precision: str, extra_options: tuple[str, ...] = ()) -> Path:
    """`checkpoint` built by the GenAI model builder for the CPU in `precision` into a folder under `folder`
    named by them, made once."""
    checkpoint, folder = Path(checkpoint).resolve(), Path(folder).resolve()  # the builder runs in another folder
    name = f"{checkpoint.name.removesuffix('-hf')}-genai-{precision}" + "".join(map(_option_tag, extra_options))
    target = folder / name
    with _made_once(target):
        if not (target / "genai_config.json").is_file():
            _require("torch", "transformers", "onnxruntime_genai", "onnx_ir")
            command = ["build", "-i", str(checkpoint), "-o", str(target), "-p", precision, "-e", "cpu", "-c", str(folder / "genai-cache")]
            _run(command + (["--extra_options", *extra_options] if extra_options else []))
    return target


def _option_tag(option: str) -> str:
    """An --extra_options entry as a folder name's part, its value included (two values of one option are two
    builds: `int4_algo=k_quant_mixed` and `int4_algo=rtn_last` once shared a folder), a long one shortened by a hash."""
    key, _, value = option.partition("=")
    tag = re.sub(r"[^A-Za-z0-9.]+", "_", value)
    return f"-{key}-{tag if len(tag) <= 24 else tag[:16] + hashlib.sha1(value.encode()).hexdigest()[:8]}"


def with_rms_normalization(model: Path, target: Path) -> Path:
    """A GenAI build's graph with each SimplifiedLayerNormalization (ONNX Runtime's op in the default domain,
    which ModelOpt's ONNX PTQ stops on) written as opset 23's RMSNormalization, which computes the same: what a
    user does to quantize the decoder with ModelOpt."""

    def rewrite(proto) -> None:
        for node in proto.graph.node:
            if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx"):
                node.op_type = "RMSNormalization"
                kept = [a for a in node.attribute if a.name in ("axis", "epsilon")]
                del node.attribute[:]
                node.attribute.extend(kept)
        for entry in proto.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = max(entry.version, 23)
        proto.ir_version = max(proto.ir_version, 11)

    return edited(model, target, rewrite)


def edited(model: Path, target: Path, edit) -> Path:
    """`model`'s graph changed by `edit` and saved as `target`, beside a copy of its data files: the graph is
    read without its weights, which are copied as files, not through memory."""
    import shutil

    import onnx

    proto = onnx.load(model, load_external_data=False)
    edit(proto)
    names = {entry.value for tensor in proto.graph.initializer for entry in tensor.external_data if entry.key == "location"}
    for name in names:
        shutil.copyfile(Path(model).parent / name, Path(target).parent / name)
    onnx.save(proto, target)
    return target


def source_prompts(count: int, characters: int = 64) -> list[str]:
    """`count` prompts of about `characters` characters: code lines from standard library files the
    trained model never saw, each cut at a word boundary."""
    prompts = []
    for path in _stdlib_files()[PROMPT_FILES]:
        lines = [line.strip() for line in path.read_text(errors="ignore").splitlines() if len(line.strip()) >= characters // 2 and "\t" not in line]
        if lines:
            line = lines[len(lines) // 2]
            prompts.append(line if len(line) <= characters or " " not in line[:characters] else line[:characters].rsplit(" ", 1)[0])
        if len(prompts) == count:
            break
    return prompts


def write_prompts(path: Path, prompts: list[str]) -> Path:
    """Prompts as a .jsonl file (a JSON string a line: code keeps its indentation)."""
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def _run(arguments: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.decoders", *arguments], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        raise RuntimeError(f"making a decoder model failed ({' '.join(arguments[:2])}): {done.stderr.strip().splitlines()[-3:]}")


# ----- what runs in the process of its own -----

def _torch():
    import torch

    for op in ("nms", "qnms"):  # the registry's torchvision is a CUDA build beside CPU torch (models.py says more)
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass
    return torch


def _save_byte_tokenizer(target: Path) -> None:
    """A byte-level tokenizer (256 byte tokens, <s> and </s>) in the checkpoint folder, as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"<0x{b:02X}>": b for b in range(BYTES)} | {"<s>": BOS, "</s>": EOS}
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=[], byte_fallback=True, unk_token=None))
    tokenizer.decoder = decoders.ByteFallback()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(target)


def _config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=2048, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)


def _train(target: Path, windowed: bool = False) -> None:
    import math

    torch = _torch()
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    text = "".join(path.read_text(errors="ignore") for path in _stdlib_files()[TRAINING_FILES])
    data = torch.tensor(list(text.encode()), dtype=torch.long)
    p = WINDOWED if windowed else TRAINED
    if windowed:
        model = Gemma2ForCausalLM(Gemma2Config(vocab_size=BYTES + 2, hidden_size=p["hidden"], intermediate_size=2 * p["hidden"], num_hidden_layers=p["layers"],
                                               num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], head_dim=p["hidden"] // p["heads"],
                                               sliding_window=p["window"], max_position_embeddings=2048, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
                                               tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(_config(BYTES + 2, p["hidden"], p["layers"], p["heads"], p["kv_heads"], 2 * p["hidden"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / p["steps"])))
    draw = torch.Generator().manual_seed(0)
    for _ in range(p["steps"]):
        starts = torch.randint(0, len(data) - p["context"] - 1, (p["batch"],), generator=draw)
        batch = torch.stack([data[s : s + p["context"]] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    _save(model, target)


def _random(target: Path) -> None:
    torch = _torch()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    p = TINYLLAMA
    model = LlamaForCausalLM(_config(p["vocab"], p["hidden"], p["layers"], p["heads"], p["kv_heads"], p["intermediate"]))
    _save(model, target)


def _save(model, target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    _save_byte_tokenizer(partial)
    partial.rename(target)


def _build(arguments: list[str]) -> None:
    import runpy

    _torch()
    output = Path(arguments[arguments.index("-o") + 1])
    partial = output.with_name(output.name + ".partial")
    arguments[arguments.index("-o") + 1] = str(partial)
    sys.argv = ["builder", *arguments]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
    partial.rename(output)


if __name__ == "__main__":
    action, rest = sys.argv[1], sys.argv[2:]
    if action == "train":
        _train(Path(rest[0]))
    elif action == "train-windowed":
        _train(Path(rest[0]), windowed=True)
    elif action == "random":
        _random(Path(rest[0]))
    elif action == "build":
        _build(rest)
