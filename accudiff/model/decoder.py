"""A decoder language model as it is deployed: which graph input is the tokens, the attention mask and the
positions, which inputs carry the KV cache in (past) and which outputs carry it out (present), and what a
cache holds. Read from the `genai_config.json` the ONNX Runtime GenAI model builder writes beside its model,
or, without one, from the names Hugging Face exporters give (`past_key_values.N.key`, `present.N.key`,
`logits`).

A GenAI folder is a model: `folder/` stands for the model file its config names (`model_file`)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from accudiff.errors import AccudiffError
from accudiff.model.inventory import InputSpec

GENAI_CONFIG = "genai_config.json"
POSITION_IDS = "position_ids"  # a decoder's positions input, as Hugging Face exporters and the GenAI builder name it
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = "present.{layer}.{part}"


@dataclass(frozen=True)
class Decoder:
    """The roles of a decoder's graph inputs and outputs. `cache` pairs each past input with the present
    output that carries its next value (in layer order, key before value); a cache is
    [batch, kv_heads, positions, head_size], of `cache_type`."""

    input_ids: str | None  # None: it reads embeddings instead (the GenAI builder's exclude_embeds)
    logits: str | None  # None: it returns hidden states instead (exclude_lm_head)
    cache: tuple[tuple[str, str], ...]
    kv_heads: int | None  # None: neither the graph nor a config fixes it
    head_size: int | None
    attention_mask: str | None = None
    position_ids: str | None = None
    source: str = "graph names"  # where the roles were read: "genai_config.json" or the graph's names
    eos_token_id: tuple[int, ...] = ()
    context_length: int | None = None  # the positions its GenAI config says it holds
    # The past inputs whose cache is a window of fixed capacity (GroupQueryAttention's sliding_window_cache: the op
    # keeps the most recent positions at its first rows and evicts the rest): (past input, capacity, window).
    windows: tuple[tuple[str, int, int], ...] = ()
    refused: str | None = None  # why generating from prompts cannot be done as it is deployed

    def require_generation(self, model: str) -> None:
        """Generating from prompts needs token ids in, logits out, and a cache whose heads and head size are known."""
        if self.input_ids is None:
            raise AccudiffError(f"'{model}' reads embeddings, not token ids (a GenAI build with exclude_embeds): prompts cannot be fed to it; "
                                "give its inputs with --load-inputs")
        if self.logits is None:
            raise AccudiffError(f"'{model}' returns hidden states, not logits (a GenAI build with exclude_lm_head): it chooses no next token to "
                                "generate with; give its inputs with --load-inputs")
        if self.refused is not None:
            raise AccudiffError(f"'{model}' {self.refused}; give its inputs with --load-inputs")
        if self.kv_heads is None or self.head_size is None:
            raise AccudiffError(f"'{model}' carries a KV cache whose heads or head size its graph does not fix, and no {GENAI_CONFIG} beside it "
                                "says them: an empty cache for the prefill cannot be made")

    @property
    def state(self) -> dict[str, str]:
        """Each present output -> the past input the next step feeds it to."""
        return {present: past for past, present in self.cache}

    @property
    def present_outputs(self) -> tuple[str, ...]:
        return tuple(present for _, present in self.cache)

    def as_json(self) -> dict:
        """What a worker job carries of it."""
        return {"input_ids": self.input_ids, "logits": self.logits, "cache": [list(pair) for pair in self.cache], "kv_heads": self.kv_heads,
                "head_size": self.head_size, "attention_mask": self.attention_mask, "position_ids": self.position_ids, "source": self.source,
                "eos_token_id": list(self.eos_token_id), "context_length": self.context_length, "windows": [list(w) for w in self.windows],
                "refused": self.refused}

    @classmethod
    def from_json(cls, fields: Mapping) -> Decoder:
        return cls(**{**fields, "cache": tuple(tuple(pair) for pair in fields["cache"]), "eos_token_id": tuple(fields["eos_token_id"]),
                      "windows": tuple(tuple(w) for w in fields["windows"])})

    def first_feed(self, prompt: np.ndarray, cache_types: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
        """The prefill's feed: the whole prompt, an empty cache (`cache_types`: each past input's dtype; a windowed
        one at its capacity, its rows holding nothing yet). Prompts of one length may come as rows of a batch ([rows, tokens])."""
        rows = np.atleast_2d(prompt).shape[0]
        capacity = {past: size for past, size, _ in self.windows}
        return self.step_feed(prompt, {past: np.zeros((rows, self.kv_heads, capacity.get(past, 0), self.head_size), cache_types[past]) for past, _ in self.cache}, 0)

    def step_feed(self, tokens: np.ndarray, past: Mapping[str, np.ndarray], done: int) -> dict[str, np.ndarray]:
        """A step's feed: `tokens` (1-D, or [rows, tokens] for a batch) after the `done` positions `past` holds."""
        ids = np.atleast_2d(np.asarray(tokens, np.int64))
        rows, count = ids.shape
        feed = {self.input_ids: ids, **past}
        if self.attention_mask is not None:
            feed[self.attention_mask] = np.ones((rows, done + count), np.int64)
        if self.position_ids is not None:
            feed[self.position_ids] = np.tile(np.arange(done, done + count, dtype=np.int64), (rows, 1))
        return feed

    def next_past(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The cache the next step reads: each present output as its past input."""
        return {past: outputs[present] for past, present in self.cache}

    def resident(self, positions: int) -> dict[str, tuple[slice, ...]]:
        """The part of each windowed present output that holds values once `positions` have been fed: its first
        L rows, L as GroupQueryAttention's contract gives it (the rows after them are left unspecified, and
        differ from one run to the next)."""
        found = {}
        present = dict(self.cache)
        for past, capacity, window in self.windows:
            evicted = capacity - window + 1  # positions reclaimed at once when the capacity is exceeded
            held = positions if positions <= capacity else positions - evicted * math.ceil((positions - capacity) / evicted)
            found[present[past]] = (slice(None), slice(None), slice(0, held))
        return found


def model_name(path: Path) -> str:
    """A model as its user named it: a GenAI folder's model by its folder (every such model is 'model.onnx')."""
    return f"{path.parent.name}/{path.name}" if (path.parent / GENAI_CONFIG).is_file() else path.name


def model_file(path: Path) -> Path:
    """The model file a path names: the file itself, or the model a GenAI folder's config names."""
    if not path.is_dir():
        return path
    config = path / GENAI_CONFIG
    if not config.is_file():
        models = sorted(p.name for p in path.glob("*.onnx"))
        held = (f": give the model file in it ({', '.join(models[:3])}{', ...' if len(models) > 3 else ''})" if models else
                ", and it holds no .onnx file")
        raise AccudiffError(f"'{path}' is a folder, not a model file{held}; a folder is read as a model only when it holds the {GENAI_CONFIG} "
                            "the ONNX Runtime GenAI model builder writes")
    name = _decoder_section(config).get("filename", "model.onnx")
    target = path / str(name)
    if not target.is_file():
        raise AccudiffError(f"'{config}' names the model file '{name}', which is not in '{path}'")
    return target


def genai_config(model: Path) -> dict | None:
    """The GenAI config beside `model` that names it, or None."""
    config = model.parent / GENAI_CONFIG
    if not config.is_file():
        return None
    section = _decoder_section(config)
    return section if section.get("filename", "model.onnx") == model.name else None


def find_decoder(model: Path, inputs: Sequence[InputSpec], outputs: Sequence[str]) -> Decoder | None:
    """The decoder roles of a model (its `inputs` and graph `outputs`), or None when it carries no KV cache."""
    config = genai_config(model)
    if config is not None:
        return _from_config(config, model.parent / GENAI_CONFIG, inputs, outputs)
    layers = {}
    for spec in inputs:
        found = _PAST.match(spec.name)
        if found:
            layers.setdefault(int(found.group(1)), {})[found.group(2)] = spec
    if not layers or "logits" not in outputs:
        return None
    cache = []
    for layer in sorted(layers):
        for part in ("key", "value"):
            present = _PRESENT.format(layer=layer, part=part)
            if part not in layers[layer] or present not in outputs:
                return None
            cache.append((layers[layer][part].name, present))
    first = layers[min(layers)]["key"].shape
    kv_heads, head_size = (first[1], first[3]) if len(first) == 4 else (None, None)
    names = {spec.name for spec in inputs}
    return Decoder("input_ids", "logits", tuple(cache), kv_heads if isinstance(kv_heads, int) else None, head_size if isinstance(head_size, int) else None, "attention_mask" if "attention_mask" in names else None,
                   POSITION_IDS if POSITION_IDS in names else None)


def _decoder_section(config: Path) -> dict:
    try:
        document = json.loads(config.read_text())
        section = document["model"]["decoder"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AccudiffError(f"'{config}' is not a GenAI config: it has no model.decoder section ({exc.__class__.__name__})") from None
    if not isinstance(section, dict):
        raise AccudiffError(f"'{config}' is not a GenAI config: its model.decoder is not an object")
    eos = document["model"].get("eos_token_id", [])
    return {**section, "eos_token_id": eos if isinstance(eos, list) else [eos], "context_length": document["model"].get("context_length")}


def _from_config(section: dict, config: Path, inputs: Sequence[InputSpec], outputs: Sequence[str]) -> Decoder:
    """The roles a GenAI config gives, each checked against the graph."""
    names = {spec.name for spec in inputs}
    try:
        given_inputs, given_outputs = section["inputs"], section["outputs"]
        layers, kv_heads, head_size = int(section["num_hidden_layers"]), int(section["num_key_value_heads"]), int(section["head_size"])
        cache = [(given_inputs[f"past_{part}_names"] % layer, given_outputs[f"present_{part}_names"] % layer) for layer in range(layers) for part in ("key", "value")]
        input_ids, logits = given_inputs.get("input_ids"), given_outputs.get("logits")
    except (KeyError, TypeError, ValueError) as exc:
        raise AccudiffError(f"'{config}' does not say the decoder's KV cache ({exc.__class__.__name__}: {exc})") from None
    for role, name, known in [("input", input_ids, names), ("output", logits, outputs), *(("input", p, names) for p, _ in cache), *(("output", q, outputs) for _, q in cache)]:
        if name is not None and name not in known:
            raise AccudiffError(f"'{config}' names the {role} '{name}', which the model's graph does not have")
    optional = {role: given_inputs.get(role) for role in ("attention_mask", "position_ids")}
    windows, refused = _windows(section.get("sliding_window"), config, layers, cache)
    return Decoder(input_ids, logits, tuple(cache), kv_heads, head_size, *(name if name in names else None for name in optional.values()),
                   source=GENAI_CONFIG, eos_token_id=tuple(int(t) for t in section.get("eos_token_id", [])),
                   context_length=section["context_length"] if isinstance(section.get("context_length"), int) and section["context_length"] > 0 else None,
                   windows=windows, refused=refused)


def _windows(sliding: object, config: Path, layers: int, cache: Sequence[tuple[str, str]]) -> tuple[tuple[tuple[str, int, int], ...], str | None]:
    """The windowed caches a GenAI config's `sliding_window` gives (its layers' past inputs, each with its
    capacity, the window plus the slack the runtime keeps beyond it, and the window), and why generation is
    refused where the runtime, not the model, slides the cache (`slide_key_value_cache`, `slide_inputs`)."""
    if sliding is None:
        return (), None
    try:
        window, slack = int(sliding["window_size"]), int(sliding.get("cache_slack", 0))
        chosen = [int(layer) for layer in sliding.get("layers", range(layers))]
    except (KeyError, TypeError, ValueError) as exc:
        raise AccudiffError(f"'{config}' does not say its sliding window ({exc.__class__.__name__}: {exc})") from None
    if sliding.get("slide_key_value_cache") or sliding.get("slide_inputs"):
        return (), "has ONNX Runtime GenAI slide its KV cache or its inputs itself (sliding_window in its genai_config.json), which accudiff does not do"
    if window < 1 or slack < 0 or any(not 0 <= layer < layers for layer in chosen):
        raise AccudiffError(f"'{config}' gives a sliding window of {window} positions (cache_slack {slack}) over layers {chosen} of {layers}, "
                            "which its model cannot have")
    return tuple((cache[2 * layer + part][0], window + slack, window) for layer in chosen for part in (0, 1)), None


def cache_types(inputs: Sequence[InputSpec], decoder: Decoder) -> dict[str, np.dtype]:
    """Each past input's element type."""
    types = {spec.name: spec.dtype for spec in inputs}
    return {past: types[past] for past, _ in decoder.cache}
