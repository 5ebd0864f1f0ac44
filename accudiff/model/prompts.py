"""Prompts for a decoder language model, as token ids: read from text (tokenized with the `tokenizer.json`
beside the model, through the optional `tokenizers` package) or given as ids, and saved as one .npz whose
sample k holds `k/input_ids` and, where one was given, `k/continuation` (the tokens to feed after the
prompt instead of the reference's greedy choice). Read one prompt at a time, like any samples.

| file     | a prompt is                                                                                      |
|----------|--------------------------------------------------------------------------------------------------|
| `.txt`   | each line that is not blank                                                                      |
| `.jsonl` | each line: a JSON string, or an object {"prompt": text or ids, "continuation": text or ids}       |
| `.npz`   | `k/input_ids` (and `k/continuation`) for k = 0, 1, ..., or one 2-D `input_ids`, a prompt a row   |
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from accudiff.errors import AccudiffError, missing
from accudiff.model.decoder import GENAI_CONFIG, POSITION_IDS, Decoder, cache_types, find_decoder, model_name
from accudiff.model.inventory import ModelInfo
from accudiff.model.samples import NPZ_READ_ERRORS, Samples, samples_from_feeds

if TYPE_CHECKING:
    import onnx

TOKENIZER_FILE = "tokenizer.json"
PROMPT_SUFFIXES = (".txt", ".jsonl", ".npz")


Prompts = str | Path | Sequence[str | Sequence[int] | np.ndarray | Mapping]  # a file, or (from Python) the prompts themselves


def read_prompts(given: Prompts, model_folder: Path, vocabulary: int | None, target: Path) -> Samples:
    """The prompts in the file `given`, or given from Python as a list (each as a .jsonl line holds it: text,
    token ids, or {"prompt": ..., "continuation": ...}), as token ids (text tokenized with `model_folder`'s
    tokenizer), each id checked against the model's `vocabulary` size, saved to `target` (.npz) and read back
    one at a time."""
    if not isinstance(given, (str, Path)):
        return _checked(_from_items(given, model_folder), "the prompts list", "the prompts list", vocabulary, target)
    path = Path(given)
    if not path.is_file():
        raise missing(path, f"prompts file '{path}'")
    suffix = path.suffix.lower()
    if suffix not in PROMPT_SUFFIXES:
        raise AccudiffError(f"prompts file '{path}' is not .txt (a prompt a line), .jsonl or .npz (token ids)")
    if suffix == ".npz":
        prompts = _ids_from_npz(path)
    else:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise AccudiffError(f"prompts file '{path}' could not be read as UTF-8 text ({exc.__class__.__name__})") from None
        items = [(line, None) for line in lines if line.strip()] if suffix == ".txt" else _jsonl(lines, path)
        prompts = _tokenized(items, model_folder, f"'{path}'")
    return _checked(prompts, f"prompts file '{path}'", f"'{path}'", vocabulary, target)


def _checked(prompts: list[tuple[np.ndarray, np.ndarray | None]], source: str, where: str, vocabulary: int | None, target: Path) -> Samples:
    """`prompts` (each its ids and its continuation's) checked against the model's `vocabulary`, saved to
    `target`; `source` names them whole ("prompts file 'p.txt'"), `where` after "prompt k of"."""
    if not prompts:
        raise AccudiffError(f"{source} holds no prompt")
    for k, (prompt, continuation) in enumerate(prompts):
        if prompt.size == 0:
            raise AccudiffError(f"prompt {k} of {where} has no token")
        for ids in (prompt, continuation):
            if ids is not None and vocabulary is not None and ids.size and (ids.min() < 0 or ids.max() >= vocabulary):
                raise AccudiffError(f"prompt {k} of {where} holds token id {int(ids.max() if ids.max() >= vocabulary else ids.min())}, "
                                    f"outside the model's vocabulary of {vocabulary}")
    feeds = [{"input_ids": prompt, **({"continuation": continuation} if continuation is not None else {})} for prompt, continuation in prompts]
    samples = samples_from_feeds(feeds, target)
    samples.source = source
    return samples


def _tokenized(items: Sequence[tuple[object, object]], model_folder: Path, where: str) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Each (prompt, continuation) as token ids; text tokenized with `model_folder`'s tokenizer."""
    encode = _tokenizer(model_folder, where) if any(isinstance(p, str) or isinstance(c, str) for p, c in items) else None
    return [(_ids(prompt, encode, f"prompt {k} of {where}"), None if continuation is None else _ids(continuation, encode, f"the continuation of prompt {k} of {where}"))
            for k, (prompt, continuation) in enumerate(items)]


def _from_items(given, model_folder: Path) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Prompts given from Python: a list of what a .jsonl line holds (token ids also as a 1-D integer array)."""
    if isinstance(given, (bytes, Mapping, np.ndarray)) or not isinstance(given, Sequence):
        raise AccudiffError(f"prompts= takes a file, or a list of prompts (text, token ids, or {{\"prompt\": ..., \"continuation\": ...}}); "
                            f"it is {type(given).__name__}")
    items = []
    for item in given:
        prompt, continuation = (item.get("prompt"), item.get("continuation")) if isinstance(item, Mapping) else (item, None)
        items.append(tuple(v.tolist() if isinstance(v, np.ndarray) and v.ndim == 1 and np.issubdtype(v.dtype, np.integer) else v
                           for v in (prompt, continuation)))
    return _tokenized(items, model_folder, "the prompts list")


def _jsonl(lines: Sequence[str], path: Path) -> list[tuple[object, object]]:
    found = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise AccudiffError(f"line {number} of '{path}' is not JSON") from None
        if isinstance(item, dict) and "prompt" in item:
            found.append((item["prompt"], item.get("continuation")))
        elif isinstance(item, (str, list)):
            found.append((item, None))
        else:
            raise AccudiffError(f"line {number} of '{path}' is neither a prompt (a string or a list of ids) nor {{\"prompt\": ..., \"continuation\": ...}}")
    return found


def _ids(value, encode, what: str) -> np.ndarray:
    if isinstance(value, str):
        return np.asarray(encode(value), np.int64)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63 for v in value):
        return np.asarray(value, np.int64)
    raise AccudiffError(f"{what} is neither text nor a list of token ids (it is {type(value).__name__})")


def _ids_from_npz(path: Path) -> list[tuple[np.ndarray, np.ndarray | None]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except NPZ_READ_ERRORS as exc:
        raise AccudiffError(f"prompts file '{path}' could not be read as .npz ({exc})") from None
    if set(arrays) == {"input_ids"} and arrays["input_ids"].ndim == 2:
        rows = arrays["input_ids"]
        return [(_as_ids(row, path, "input_ids"), None) for row in rows]
    indices = sorted({int(key.split("/")[0]) for key in arrays if key.split("/")[0].isdigit() and key.endswith("/input_ids")})
    if not indices or any(not (key.split("/")[0].isdigit() and key.split("/", 1)[1] in ("input_ids", "continuation")) for key in arrays):
        raise AccudiffError(f"prompts file '{path}' holds {', '.join(sorted(arrays)[:3]) or 'nothing'}; it takes k/input_ids (and k/continuation) "
                            "for k = 0, 1, ..., or one 2-D input_ids")
    return [(_as_ids(arrays[f"{k}/input_ids"], path, f"{k}/input_ids"),
             _as_ids(arrays[f"{k}/continuation"], path, f"{k}/continuation") if f"{k}/continuation" in arrays else None) for k in indices]


def _as_ids(array: np.ndarray, path: Path, key: str) -> np.ndarray:
    if not np.issubdtype(array.dtype, np.integer) or array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
        raise AccudiffError(f"'{key}' in '{path}' is not a 1-D array of token ids ({array.dtype}, shape {list(array.shape)})")
    return array.reshape(-1).astype(np.int64)


def _tokenizer(folder: Path, where: str):
    """`encode(text) -> ids` with the model folder's tokenizer (special tokens as the tokenizer adds them)."""
    source = folder / TOKENIZER_FILE
    if not source.is_file():
        raise AccudiffError(f"{where} holds text, and there is no {TOKENIZER_FILE} in '{folder}' to tokenize it; give token ids (.npz) instead")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise AccudiffError("prompts given as text are tokenized with the 'tokenizers' package: pip install 'accudiff[llm]', or give token ids (.npz)") from None
    try:
        tokenizer = Tokenizer.from_file(str(source))
    except Exception as exc:  # noqa: BLE001 - the tokenizers package raises plain Exceptions
        raise AccudiffError(f"'{source}' could not be read by the tokenizers package ({str(exc).splitlines()[0][:120]})") from None
    return lambda text: tokenizer.encode(text).ids


def decode_tokens(folder: Path, ids: Sequence[int]) -> str | None:
    """`ids` as text, with the model folder's tokenizer (None when it cannot be read)."""
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / TOKENIZER_FILE)).decode(list(ids), skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - text is a convenience beside the ids
        return None


@dataclass(frozen=True)
class GenerationPlan:
    """A decoder's comparison on prompts (execution/generation.py): its roles, the prompts (token ids), each
    prompt's prefill feed (what the plan, calibration and TensorRT's shapes read of a sample) and the decode
    steps after each prefill."""

    decoder: Decoder
    prompts: Samples
    prefills: Samples
    new_tokens: int
    cache_types: dict[str, np.dtype]
    # Prompts may run as rows of one batch: the GenAI builder's graphs (both sides) take any number (a trial's prompts of
    # one length generate together, execution/generation.batches).
    batch: bool = False

    def as_json(self, trial: bool = False) -> dict:
        """What a worker job carries of it (Job.generation); a `trial`'s prompts replay what the comparison fed
        (`replayed_prompts`), nothing generated alone."""
        return {"decoder": self.decoder.as_json(), "new_tokens": self.new_tokens, "cache_types": {name: str(kind) for name, kind in self.cache_types.items()},
                "trial": trial, "batch": self.batch}


def prepare_generation(info: ModelInfo, prompts: Prompts, new_tokens: int, target: Path, scratch: Path, candidate: Path | None = None) -> GenerationPlan:
    """The generation plan of a decoder (`info`) on the prompts in `prompts` (saved as token ids at `target`);
    a `candidate` model file that reads its positions as an input is fed them."""
    decoder = find_decoder(info.path, info.inputs, info.output_names)
    if decoder is None:
        raise AccudiffError(f"--prompts is for a decoder language model, and '{info.path.name}' carries no KV cache (no past_key_values.N.key/value "
                            f"inputs with present.N.key/value outputs, and no {GENAI_CONFIG} beside it)")
    decoder.require_generation(model_name(info.path))
    logits = next((o for o in info.proto.graph.output if o.name == decoder.logits), None)
    dims = logits.type.tensor_type.shape.dim if logits is not None else []
    vocabulary = dims[-1].dim_value if dims and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0 else None
    ids = read_prompts(prompts, info.path.parent, vocabulary, target)
    limit = context_limit(info.proto.graph, decoder)
    if limit is not None:
        for k, prompt in enumerate(ids):
            needed = prompt["input_ids"].size + new_tokens
            if needed > limit[0]:
                raise AccudiffError(f"prompt {k} of {ids.source} is {prompt['input_ids'].size} tokens long, and with {new_tokens} new tokens (--new-tokens) "
                                    f"needs {needed} positions: '{model_name(info.path)}' holds {limit[0]} ({limit[1]})")
    types = cache_types(info.inputs, decoder)
    batch = decoder.source == GENAI_CONFIG and _rows_free(info.proto.graph.input, decoder.input_ids)
    if candidate is not None and (batch or decoder.position_ids is None):
        import onnx

        theirs = onnx.load(str(candidate), load_external_data=False).graph.input
        batch = batch and _rows_free(theirs, decoder.input_ids)
        if decoder.position_ids is None:
            decoder = replace(decoder, position_ids=POSITION_IDS if POSITION_IDS in {i.name for i in theirs} else None)
    prefills = samples_from_feeds([decoder.first_feed(prompt["input_ids"], types) for prompt in ids], scratch / "prefills.npz")
    prefills.source = ids.source
    return GenerationPlan(decoder, ids, prefills, new_tokens, types, batch)


def _rows_free(inputs: Sequence, name: str | None) -> bool:
    """Whether the graph input `name` (token ids) takes any number of rows: its first dimension is not fixed."""
    spec = next((i for i in inputs if i.name == name), None)
    dims = spec.type.tensor_type.shape.dim if spec is not None else []
    return bool(dims) and not dims[0].HasField("dim_value")


def context_limit(graph: onnx.GraphProto, decoder: Decoder) -> tuple[int, str] | None:
    """How many positions a decoder holds, and where that is read: its GenAI config's context_length, and the
    rotary cache its GroupQueryAttention nodes read (ONNX Runtime refuses a longer sequence there, after a
    prefill and as many decode steps as fit); the smaller. None where neither says."""
    found = [(decoder.context_length, f"context_length in its {GENAI_CONFIG}")] if decoder.context_length else []
    weights = {init.name: init for init in graph.initializer}
    rotary = {weights[node.input[7]].dims[0] for node in graph.node
              if node.op_type == "GroupQueryAttention" and len(node.input) > 7 and node.input[7] in weights and weights[node.input[7]].dims}
    found += [(min(rotary), "the rotary cache its GroupQueryAttention nodes read")] if rotary else []
    return min(found) if found else None


def whole_sequences(generations: Sequence[dict], decoder: Decoder, types: dict[str, np.dtype], target: Path, specs: Sequence = ()) -> Samples:
    """Each generation's whole sequence (its prompt and every token its decode steps fed) as one prefill:
    the same tokens, each side computing its own cache in one run: one run a prompt instead of one a step
    (the feeds of a cut bisect compares: a subgraph has no cache to carry)."""
    feeds = [decoder.first_feed(np.asarray([*g["prompt"], *g["reference"][:-1]], np.int64), types) for g in generations]
    return samples_from_feeds(feeds, target, specs)


def replayed_prompts(generations: Sequence[dict], target: Path) -> Samples:
    """Each generation's prompt with the tokens the comparison fed after it, to feed them again step by step
    (the trials of a decoder, GenerationPlan.as_json(trial=True)): a continuation the user gave stays one
    (scored as given), the reference's own greedy choices are `replayed` (scored as when it chose them)."""
    feeds = [{"input_ids": np.asarray(g["prompt"], np.int64), ("continuation" if g["given"] else "replayed"): np.asarray(g["reference"], np.int64)}
             for g in generations]
    return samples_from_feeds(feeds, target)
