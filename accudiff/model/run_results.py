"""polygraphy's RunResults JSON (`polygraphy run ... --save-outputs FILE`), the field's way of carrying
tensors between machines: read into a store of recorded tensors, and written from one, without pickle.

The file is `{"lst": [[runner name, [iteration, ...]], ...], "polygraphy_class": "RunResults"}`; each
iteration is `{"outputs": {tensor: array}, "runtime": s, "runner_name": ..., "polygraphy_class":
"IterationResult"}`, and each array a base64 .npy, wrapped in a LazyArray by recent polygraphy versions
(`{"values": {"array": ...}}`) and bare by older ones (`{"array": ...}`).
"""

from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from accudiff.errors import AccudiffError
from accudiff.model.inputs import NPY_READ_ERRORS
from accudiff.model.json_stream import leaves
from accudiff.model.stores import ReferenceStore


@dataclass
class Recorded:
    """One runner's iterations from a RunResults file, saved as a store (one folder per iteration)."""

    store: ReferenceStore
    runner: str
    iterations: int
    found: list[str]  # tensors of the model the file holds
    foreign: list[str] = field(default_factory=list)  # names in the file that are no tensor of the model
    file: Path = Path()  # the RunResults file it was read from


def read_run_results(path: Path, tensors: Sequence[str], folder: Path, runner: str | None = None) -> Recorded:
    """The iterations of `runner` (or of the file's only runner) in the RunResults file `path`, decoded one
    array at a time into a store in `folder` for the model `tensors`; the file is streamed twice (its
    runners first, then the chosen one's arrays), never held whole. One sentence for anything wrong."""
    path = Path(path)
    runners = _survey(path)
    if runner is None and len(runners) > 1:
        raise AccudiffError(f"'{path}' holds the results of {len(runners)} runners; choose one with --candidate-runner: {', '.join(runners)}")
    chosen = runner if runner is not None else next(iter(runners))
    if chosen not in runners:
        raise AccudiffError(f"'{path}' holds no runner '{chosen}'; its runners are: {', '.join(runners)}")
    position, iterations = runners[chosen]
    if iterations == 0:
        raise AccudiffError(f"'{path}' holds no iteration of runner '{chosen}'")
    known = set(tensors)
    store = ReferenceStore(folder, tensors)
    names: dict[str, None] = {}

    def array_of_ours(where: tuple) -> bool:  # ("lst", runner, 1, iteration, "outputs", tensor, ["values",] "array")
        return len(where) >= 7 and where[:3] == ("lst", position, 1) and where[4] == "outputs" and where[5] in known and where[-1] == "array"

    for where, value in _leaves(path, array_of_ours):
        if len(where) >= 6 and where[:3] == ("lst", position, 1) and where[4] == "outputs":
            names[where[5]] = None
            if array_of_ours(where):
                store.write(where[3], {where[5]: _decode(value, path, f"tensor '{where[5]}' of iteration {where[3]}")})
    found = [name for name in tensors if name in names]
    if not found:
        shown = ", ".join(list(names)[:5])
        raise AccudiffError(f"no tensor in '{path}' is a tensor of the model (it holds {shown}{', ...' if len(names) > 5 else ''}): was it saved from another model?")
    store.finish()
    return Recorded(store, chosen, iterations, found, [name for name in names if name not in known], path)


def _survey(path: Path) -> dict[str, tuple[int, int]]:
    """Each runner of a RunResults file: its position in the file and how many iterations it holds."""
    names: dict[int, str] = {}
    iterations: dict[int, int] = {}
    root = None
    for where, value in _leaves(path, lambda where: where == ("polygraphy_class",) or (len(where) == 3 and where[0] == "lst" and where[2] == 0)):
        if where == ("polygraphy_class",):
            root = value
        elif len(where) == 3 and where[0] == "lst" and where[2] == 0 and isinstance(value, str):
            names[where[1]] = value
        elif len(where) >= 4 and where[0] == "lst" and where[2] == 1 and isinstance(where[3], int):
            iterations[where[1]] = max(iterations.get(where[1], 0), where[3] + 1)
    if root != "RunResults" or not names:
        raise AccudiffError(f"'{path}' is not a polygraphy RunResults file with results in it (polygraphy run ... --save-outputs writes one)")
    return {name: (position, iterations.get(position, 0)) for position, name in names.items()}


def _leaves(path: Path, keep):
    """The file's leaves (model/json_stream.py); a file that is not whole, readable JSON is one sentence."""
    try:
        yield from leaves(path, keep)
    except FileNotFoundError:
        raise AccudiffError(f"'{path}' does not exist") from None
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise AccudiffError(f"'{path}' is not a polygraphy RunResults file: it is not whole, readable JSON ({exc})") from None


@dataclass
class Captured:
    """Tensors captured elsewhere for this run (either side may be None: it runs here)."""

    candidate: Recorded | None = None
    reference: Recorded | None = None
    notices: list[str] = field(default_factory=list)


def read_captured(tensors: Sequence[str], load_candidate: str | Path | None, load_reference: str | Path | None, candidate_runner: str | None,
                  samples: int, scratch: Path) -> Captured:
    """The captured stage: the --load-candidate and --load-reference files read into stores (the candidate's
    runs of `candidate_runner`, if the file holds several), one iteration per sample (as polygraphy matches
    them), and what a reader must know about them."""
    captured = Captured()
    for side, path in (("candidate", load_candidate), ("reference", load_reference)):
        if path is None:
            continue
        recorded = read_run_results(Path(path), tensors, scratch / f"captured-{side}", candidate_runner)
        if recorded.iterations != samples:
            raise AccudiffError(
                f"'{path}' holds {recorded.iterations} iteration(s) of runner '{recorded.runner}', but {samples} sample(s) were given: "
                "give the inputs it was made from (polygraphy's --save-inputs file)"
            )
        setattr(captured, side, recorded)
        captured.notices.append(
            f"the {side}'s tensors were captured by polygraphy runner '{recorded.runner}' ({Path(path).name}): {len(recorded.found)} of the model's "
            f"{len(tensors)} tensors"
        )
        if recorded.foreign:
            shown = ", ".join(recorded.foreign[:3]) + (", ..." if len(recorded.foreign) > 3 else "")
            captured.notices.append(
                f"{len(recorded.foreign)} name(s) in {Path(path).name} are no tensor of the model (TensorRT layer names, or another model's): {shown}; not compared"
            )
    if captured.candidate is not None:
        captured.notices.append("the isolated run needs the candidate to run again: off for a candidate captured elsewhere")
    return captured


def write_run_results(path: Path, runner: str, iterations: Iterable[Mapping[str, np.ndarray]]) -> None:
    """A RunResults file polygraphy reads back (`polygraphy run ... --load-outputs FILE`), written one array
    at a time into a hidden file that is renamed into place when whole."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as out:
            out.write('{"lst": [[' + json.dumps(runner) + ", [")
            for index, outputs in enumerate(iterations):
                out.write(", " if index else "")
                out.write('{"outputs": {')
                for k, (name, array) in enumerate(outputs.items()):
                    out.write(", " if k else "")
                    out.write(f'{json.dumps(name)}: {{"values": {_encode(array)}, "polygraphy_class": "LazyArray"}}')
                out.write('}, "runtime": 0.0, "runner_name": ' + json.dumps(runner) + ', "polygraphy_class": "IterationResult"}')
            out.write(']]], "polygraphy_class": "RunResults"}\n')
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def store_iterations(store: ReferenceStore, samples: int, tensors: Sequence[str]) -> Iterable[dict[str, np.ndarray]]:
    """Each sample's recorded tensors, in the model's order, read when asked for."""
    for sample in range(samples):
        yield store.read(sample, tensors)


def _decode(text: object, path: Path, what: str) -> np.ndarray:
    """A polygraphy-encoded array (base64 of a .npy), without pickle."""
    if not isinstance(text, str):
        raise AccudiffError(f"'{path}': {what} is not a polygraphy-encoded array")
    try:
        array = np.load(io.BytesIO(base64.b64decode(text.encode(), validate=True)), allow_pickle=False)
    except NPY_READ_ERRORS as exc:
        raise AccudiffError(f"'{path}': {what} cannot be decoded ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise AccudiffError(f"'{path}': {what} is not an array")
    return array


def _encode(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array, order="C"), allow_pickle=False)
    return json.dumps({"array": base64.b64encode(buffer.getvalue()).decode(), "polygraphy_class": "ndarray"})
