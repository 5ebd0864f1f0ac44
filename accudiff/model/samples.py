"""Input samples on disk, read one at a time: a dataset is streamed through a comparison, never held.

A sample is one `{input name: array}` feed, stored in an .npz file either alone (keys are input names) or
among others (keys `<index>/<input name>`, the layout accudiff writes). `--load-inputs` takes such a file,
a folder of them (every .npz in it, in name order), polygraphy's `--save-inputs` JSON, or, for a model of
one input, a .npy (converted once). A file whose arrays stack k batches of an input of fixed batch size
(8 rows for a 1x3x224x224 input, as ModelOpt's calibration files hold them) is k samples: the model could
not take it whole.
Only the list of (file, prefix) entries travels to workers and machines; each reads its samples itself.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from accudiff.errors import AccudiffError, missing
from accudiff.model.inputs import (
    NPY_READ_ERRORS,
    Feed, generate_feeds, load_json_feeds, parse_input_shapes, parse_val_ranges, resolve_shapes, save_feeds, validate_feeds,
)
from accudiff.model.inventory import InputSpec, ModelInfo


_INDEXED = re.compile(r"^(\d+)/(.+)$")


@dataclass(frozen=True)
class SampleRef:
    file: str
    prefix: str  # "" for a file holding one sample, "<index>/" for one of several


# What reading a damaged .npz can raise: the zip layer's errors (unsupported flags and methods, encrypted
# members, bad CRCs, truncated deflate streams) and the .npy reader's; all of it is the file's fault.
NPZ_READ_ERRORS = (*NPY_READ_ERRORS, NotImplementedError, RuntimeError, zipfile.BadZipFile, zlib.error)


class Samples(Sequence):
    """The samples of a comparison, in order; `samples[i]` reads sample i from disk."""

    def __init__(self, refs: Sequence[SampleRef], source: str, specs: Sequence[InputSpec] = ()):
        self.refs, self.source, self.specs = list(refs), source, list(specs)

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> Feed:
        ref = self.refs[index]
        try:
            with np.load(ref.file, allow_pickle=False) as archive:
                feed = {key[len(ref.prefix):]: archive[key] for key in archive.files if key.startswith(ref.prefix) and (ref.prefix or "/" not in key)}
        except NPZ_READ_ERRORS as exc:
            raise AccudiffError(f"sample {index} ('{ref.file}') could not be read ({exc})") from exc
        not_arrays = [name for name, value in feed.items() if not isinstance(value, np.ndarray)]  # numpy hands those over as bytes
        if not_arrays:
            raise AccudiffError(f"sample {index} ('{ref.file}') could not be read ('{not_arrays[0]}.npy' is not a .npy array)")
        if self.specs:
            validate_feeds([feed], self.specs, f"{self.source}, sample {index} ('{Path(ref.file).name}')")
        return feed

    def __iter__(self) -> Iterator[Feed]:
        return (self[i] for i in range(len(self)))

    def subset(self, indices: Sequence[int]) -> "Samples":
        return Samples([self.refs[i] for i in indices], self.source, self.specs)

    def as_json(self) -> list[list[str]]:
        return [[ref.file, ref.prefix] for ref in self.refs]

    @classmethod
    def from_json(cls, entries: Sequence[Sequence[str]], source: str = "the inputs", specs: Sequence[InputSpec] = ()) -> "Samples":
        return cls([SampleRef(file, prefix) for file, prefix in entries], source, specs)


def prepare_samples(info: ModelInfo, inputs: str | Path | Sequence[Feed] | Samples | None, path: Path | None = None, *,
                    input_shapes: Sequence[str] | dict | None = None, iterations: int = 1, seed: int = 0, val_range: Sequence[str] | None = None) -> Samples:
    """The samples a run compares: loaded (a file or a folder of files, read one at a time), given (a list
    of feeds), or, without `inputs`, `iterations` generated from `seed` and the ranges; given and generated
    feeds are written to `path` (default: a new temporary folder)."""
    if isinstance(inputs, Samples):
        return inputs
    if isinstance(inputs, (str, Path)):
        return samples_from_path(inputs, info.inputs, "input", path.parent if path is not None else None)
    if inputs is not None:
        feeds = [dict(feed) for feed in inputs]
        validate_feeds(feeds, info.inputs, "the given inputs")
    else:
        resolved = resolve_shapes(info.inputs, input_shapes if isinstance(input_shapes, dict) else parse_input_shapes(input_shapes))
        if path is None:
            path = Path(tempfile.mkdtemp(prefix="accudiff-inputs-")) / "inputs.npz"
        per_sample = sum(math.prod(resolved[spec.name]) * spec.dtype.itemsize for spec in info.inputs)
        _require_room(per_sample * iterations, path.parent, f"--iterations {iterations} of these input shapes")
        feeds = generate_feeds(info.inputs, resolved, seed, parse_val_ranges(val_range), iterations)
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="accudiff-inputs-")) / "inputs.npz"
    return samples_from_feeds(feeds, path, info.inputs)


def _require_room(size: int, folder: Path, what: str) -> None:
    """Generated inputs are held in memory, then written to `folder`: refuse what fits in neither
    (an adversarial --iterations or --input-shapes would otherwise run until the machine gives up)."""
    free_disk = shutil.disk_usage(folder).free
    free_memory = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else free_disk
    room = min(free_disk, free_memory)
    if size > room:
        raise AccudiffError(
            f"{what} would generate {size / 2**30:.3g} GiB of inputs, more than the {room / 2**30:.3g} GiB of memory and disk free; "
            "generate fewer, or give them with --load-inputs"
        )


def samples_from_path(path: str | Path, specs: Sequence[InputSpec], role: str = "input", scratch: Path | None = None) -> Samples:
    """The samples of an .npz file, a folder of .npz files, a polygraphy JSON file or a model's one input's
    .npy (converted into `scratch`, as a file that stacks batches is split); `role` names what they are for
    ("input", "calibration"), said with "file" or "folder". The first sample is validated now; each one is
    validated again as it is read."""
    path = Path(path)
    source = f"{role} {'folder' if path.is_dir() else 'file'} '{path}'"
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".npz")
        if not files:
            raise AccudiffError(f"{source} holds no .npz file")
    elif path.is_file():
        files = [path]
        if path.suffix.lower() == ".json":
            files = [_json_as_npz(path, source, scratch)]
        elif path.suffix.lower() == ".npy":
            files = [_npy_as_npz(path, specs, source, scratch)]
    else:
        raise missing(path, source)
    refs = [ref for file in files for ref in _unstacked(_entries(file.resolve(), source), specs, scratch)]  # a worker started elsewhere reads them too
    if not refs:
        raise AccudiffError(f"{source} holds no arrays")
    samples = Samples(refs, source, specs)
    samples[0]  # noqa: B018 (a bad first sample stops here, before anything runs)
    return samples


def samples_from_feeds(feeds: Sequence[Feed], path: Path, specs: Sequence[InputSpec] = ()) -> Samples:
    """Feeds held in memory, written to `path` (.npz) to be read back one at a time."""
    save_feeds(list(feeds), path)
    return Samples([SampleRef(str(path), f"{i}/") for i in range(len(feeds))], "the given inputs", specs)


def _entries(file: Path, source: str) -> list[SampleRef]:
    try:
        with zipfile.ZipFile(file) as archive:
            keys = [name[: -len(".npy")] for name in archive.namelist() if name.endswith(".npy")]
    except NPZ_READ_ERRORS as exc:
        raise AccudiffError(f"{source} could not be read as .npz ({exc})") from exc
    indexed = [_INDEXED.match(key) for key in keys]
    if keys and all(indexed):
        return [SampleRef(str(file), f"{index}/") for index in sorted({int(m.group(1)) for m in indexed})]
    return [SampleRef(str(file), "")] if keys else []


def _json_as_npz(path: Path, source: str, scratch: Path | None) -> Path:
    try:
        feeds = load_json_feeds(path)
    except (*NPY_READ_ERRORS, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise AccudiffError(f"{source} could not be read as polygraphy JSON ({exc})") from exc
    return _saved(feeds, f"{path.stem}.npz", scratch)


def _npy_as_npz(path: Path, specs: Sequence[InputSpec], source: str, scratch: Path | None) -> Path:
    """A .npy file as the sample(s) of a model's only input (a .npy holds one array and no name)."""
    if len(specs) != 1:
        raise AccudiffError(f"{source} holds one array and no input name, and the model has {len(specs)} inputs "
                            f"({', '.join(spec.name for spec in specs)}): give them in an .npz, a key per input")
    try:
        feed = {specs[0].name: np.load(path, mmap_mode="r", allow_pickle=False)}
    except NPY_READ_ERRORS as exc:
        raise AccudiffError(f"{source} could not be read as .npy ({exc})") from exc
    return _saved(_split_batches(feed, specs) or [feed], f"{path.stem}.npz", scratch)


def _unstacked(refs: list[SampleRef], specs: Sequence[InputSpec], scratch: Path | None) -> list[SampleRef]:
    """A file of one sample whose arrays stack several batches (`_split_batches`) as those samples."""
    if len(refs) != 1 or refs[0].prefix or not specs or not all(_fixed_batch(spec) for spec in specs):
        return refs
    try:
        with np.load(refs[0].file, allow_pickle=False) as archive:
            feeds = _split_batches({key: archive[key] for key in archive.files}, specs)
    except NPZ_READ_ERRORS:
        return refs  # said when the sample is read
    if feeds is None:
        return refs
    target = _saved(feeds, f"{Path(refs[0].file).stem}-{len(feeds)}-samples.npz", scratch)
    return [SampleRef(str(target.resolve()), f"{k}/") for k in range(len(feeds))]


def _split_batches(feed: Feed, specs: Sequence[InputSpec]) -> list[Feed] | None:
    """`feed` as k > 1 samples when each input's array holds k batches of its fixed batch size (its first
    dimension) along its first axis, its other dimensions as many; else None (the feed is one sample)."""
    counts = set()
    for spec in specs:
        batch, array = _fixed_batch(spec), feed.get(spec.name)
        if not batch or not isinstance(array, np.ndarray) or array.ndim != len(spec.shape) or array.shape[0] % batch:
            return None
        counts.add(array.shape[0] // batch)
    if set(feed) != {spec.name for spec in specs} or len(counts) != 1 or min(counts) < 2:
        return None
    return [{spec.name: feed[spec.name][k * _fixed_batch(spec) : (k + 1) * _fixed_batch(spec)] for spec in specs} for k in range(counts.pop())]


def _fixed_batch(spec: InputSpec) -> int:
    """An input's first dimension where the model fixes it (0 where it is dynamic, or the input a scalar)."""
    return spec.shape[0] if spec.shape and isinstance(spec.shape[0], int) else 0


def _saved(feeds: list[Feed], name: str, scratch: Path | None) -> Path:
    """`feeds` written as `name` in `scratch` (default: a new temporary folder), in the indexed layout."""
    folder = scratch if scratch is not None else Path(tempfile.mkdtemp(prefix="accudiff-inputs-"))
    target = folder / name
    save_feeds(feeds, target)
    return target
