"""Input data for the runs: seeded random feeds, their validation, and the .npz layout they are saved in.

A feed is one `{input name: array}` mapping (a sample). Samples on disk, including datasets, are read
one at a time through `samples.py`; the feeds a run generated are saved with the report (`save_feeds`),
so any run can be replayed with `--load-inputs`.
"""

from __future__ import annotations

import base64
import io
import json
import math
import tokenize
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from accudiff.errors import AccudiffError
from accudiff.model.inventory import InputSpec

Feed = dict[str, np.ndarray]

DEFAULT_VAL_RANGE = (0.0, 1.0)


# What NumPy's .npy reader raises for a damaged array: the file's fault, never ours (it tokenizes the
# header as Python, hence the tokenizer's and parser's errors).
NPY_READ_ERRORS = (OSError, ValueError, EOFError, SyntaxError, tokenize.TokenError)


def parse_input_shapes(items: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Parse `name:1x3x224x224` items (the name may itself contain colons)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.lower().split("x")) if dims else ()
        except ValueError:
            raise AccudiffError(f"input shape '{item}' is not of the form name:1x3x224x224") from None
        if any(d <= 0 for d in shapes[name]):
            raise AccudiffError(f"input shape '{item}' has a dimension of size 0 or less: the comparison would cover no element")
    return shapes


def parse_val_ranges(items: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Parse `[name:]lo,hi` items; the key "" holds the default range for every other input."""
    ranges: dict[str, tuple[float, float]] = {}
    for item in items:
        name, _, bounds = item.rpartition(":")
        try:
            low, high = (float(v) for v in bounds.split(","))
        except ValueError:
            raise AccudiffError(f"value range '{item}' is not of the form [name:]low,high") from None
        if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(high - low)):
            raise AccudiffError(f"value range '{item}' must have finite bounds whose difference is finite too")
        if low > high:
            raise AccudiffError(f"value range '{item}' has its low bound above its high bound")
        ranges[name] = (low, high)
    return ranges


def resolve_shapes(specs: list[InputSpec], given: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Concrete shape of every input: static dimensions from the model, dynamic ones from `given`."""
    _check_names(given, specs, "--input-shapes")
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        if spec.name in given:
            shape = given[spec.name]
            _check_shape(spec, shape, "--input-shapes")
        elif spec.is_static:
            shape = tuple(int(d) for d in spec.shape)
        else:
            example = "x".join(str(d) if isinstance(d, int) else f"<{d or '?'}>" for d in spec.shape)
            dynamic = next(d for d in spec.shape if not isinstance(d, int))
            raise AccudiffError(
                f"input '{spec.name}' has a dynamic dimension '{dynamic or '?'}'; give its shape with "
                f"--input-shapes {spec.name}:{example}"
            )
        shapes[spec.name] = shape
    return shapes


def generate_feeds(
    specs: list[InputSpec],
    shapes: Mapping[str, tuple[int, ...]],
    seed: int = 0,
    val_ranges: Mapping[str, tuple[float, float]] | None = None,
    iterations: int = 1,
) -> list[Feed]:
    """Seeded random feeds: floats uniform in the value range, integers uniform in [low, high], bools fair."""
    val_ranges = dict(val_ranges or {})
    _check_names({k: v for k, v in val_ranges.items() if k}, specs, "--val-range")
    default = val_ranges.get("", DEFAULT_VAL_RANGE)
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(iterations):
        feed: Feed = {}
        for spec in specs:
            low, high = val_ranges.get(spec.name, default)
            _require_representable(spec, low, high)
            shape = shapes[spec.name]
            if spec.dtype == np.bool_:
                values = rng.random(shape) < 0.5
            elif np.issubdtype(spec.dtype, np.integer):
                values = rng.integers(int(np.ceil(low)), int(np.floor(high)), size=shape, endpoint=True)
            elif np.issubdtype(spec.dtype, np.floating):
                values = rng.uniform(low, high, size=shape)
            else:
                raise AccudiffError(f"input '{spec.name}' has dtype {spec.dtype}, for which accudiff cannot generate data; use --load-inputs")
            feed[spec.name] = np.asarray(values, dtype=spec.dtype)  # an array even for scalar inputs
        feeds.append(feed)
    return feeds


def _require_representable(spec: InputSpec, low: float, high: float) -> None:
    """A value range the input's type can hold (NumPy would wrap integers round, or make floats infinite)."""
    if spec.dtype == np.bool_ or not (np.issubdtype(spec.dtype, np.integer) or np.issubdtype(spec.dtype, np.floating)):
        return
    info = np.iinfo(spec.dtype) if np.issubdtype(spec.dtype, np.integer) else np.finfo(spec.dtype)
    if low < float(info.min) or high > float(info.max):
        raise AccudiffError(f"value range {low:g},{high:g} for input '{spec.name}' goes beyond what {spec.dtype} holds ({info.min:g} to {info.max:g})")


def save_feeds(feeds: list[Feed], path: Path) -> None:
    """Save feeds as .npz with keys `<iteration>/<input name>`, the layout `load_feeds` reads back."""
    arrays = {f"{i}/{name}": np.asarray(array) for i, feed in enumerate(feeds) for name, array in feed.items()}  # 0-d stays 0-d
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


def validate_feeds(feeds: list[Feed], specs: list[InputSpec], source: str) -> None:
    """Every feed must give exactly the model's inputs, with their dtypes and static dimensions."""
    for feed in feeds:
        _check_names(feed, specs, source)
        for spec in specs:
            if spec.name not in feed:
                raise AccudiffError(f"{source} gives no data for the model input '{spec.name}'")
            array = feed[spec.name]
            if array.dtype != spec.dtype and not _widens_exactly(array.dtype, spec.dtype):
                raise AccudiffError(f"{source} gives input '{spec.name}' as {array.dtype}, but the model expects {spec.dtype}")
            _check_shape(spec, array.shape, source)


def load_json_feeds(path: Path) -> list[Feed]:
    """Feeds from polygraphy's `--save-inputs` JSON (arrays as base64 .npy, read without pickle)."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(feed, dict) for feed in data):
        raise ValueError("expected a list of {input name: array} mappings")
    return [{name: _decode_polygraphy_array(value) for name, value in feed.items()} for feed in data]


def _decode_polygraphy_array(value: object) -> np.ndarray:
    if not isinstance(value, dict) or not isinstance(value.get("array"), str):
        raise ValueError("an input is not a polygraphy-encoded array")
    raw = base64.b64decode(value["array"].encode(), validate=True)
    return np.load(io.BytesIO(raw), allow_pickle=False)


def _widens_exactly(given: np.dtype, expected: np.dtype) -> bool:
    """A float input given in a narrower float type (FP16 for an FP32 input: a model compared with its float
    form takes the inputs of the model) is fed widened, which loses nothing."""
    return np.issubdtype(given, np.floating) and np.issubdtype(expected, np.floating) and np.can_cast(given, expected, "safe")


def _check_names(given: Mapping[str, object], specs: list[InputSpec], source: str) -> None:
    known = [spec.name for spec in specs]
    for name in given:
        if name not in known:
            raise AccudiffError(f"{source} names an input '{name}' that the model does not have; its inputs are: {', '.join(known)}")


def _check_shape(spec: InputSpec, shape: tuple[int, ...], source: str) -> None:
    mismatch = len(shape) != len(spec.shape) or any(
        isinstance(want, int) and want != got for want, got in zip(spec.shape, shape)
    )
    if mismatch:
        raise AccudiffError(f"{source} gives input '{spec.name}' the shape {shape_text(shape)}, but the model expects {declared_shape(spec)}")


def declared_shape(spec: InputSpec) -> str:
    """An input's shape as the model declares it: 1x3x224x224, or batch x 3 x height x width."""
    return shape_text([d if isinstance(d, int) else str(d or "?") for d in spec.shape], " x " if not spec.is_static else "x")


def shape_text(dims: Sequence[int | str], separator: str = "x") -> str:
    """A shape as a person writes it (1x3x224x224); a scalar's, which has no dimensions, says so."""
    return separator.join(map(str, dims)) if len(dims) else "() (a scalar)"


def fed_shapes(feed: Feed, specs: list[InputSpec]) -> str:
    """The shapes a sample gives the model's inputs whose dimensions the model leaves free, beside what
    it declares: where a model that will not run on a sample is told what it was given ("input 'images'
    1x3x300x300, declared batchx3xheightxwidth"); every input where none is free."""
    free = [spec for spec in specs if not spec.is_static and spec.name in feed] or [spec for spec in specs if spec.name in feed]
    return "; ".join(f"input '{spec.name}' {shape_text(np.shape(feed[spec.name]))}, declared {declared_shape(spec)}" for spec in free)
