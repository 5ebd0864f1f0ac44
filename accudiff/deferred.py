"""A mapping computed on a thread of its own, for what one stage measures and only a later stage reads."""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Mapping, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Deferred(Mapping[K, V]):
    """The mapping `compute()` returns, computed on a thread from when this is made; reading it waits for it
    (and raises what computing it raised). A candidate's weight findings read its weights back (0.2 s on
    MiniLM): computed so, they are measured while the worker runs the comparison, which the caller waits
    for anyway. `compute` must read only what nothing changes meanwhile (its own copies)."""

    def __init__(self, compute: Callable[[], Mapping[K, V]]) -> None:
        self._done = threading.Event()
        self._value: dict[K, V] = {}
        self._error: BaseException | None = None
        threading.Thread(target=self._compute, args=(compute,), name="accudiff-deferred", daemon=True).start()

    def _compute(self, compute: Callable[[], Mapping[K, V]]) -> None:
        try:
            self._value = dict(compute())
        except BaseException as exc:  # raised where it is read
            self._error = exc
        finally:
            self._done.set()

    def _computed(self) -> dict[K, V]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def __getitem__(self, key: K) -> V:
        return self._computed()[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._computed())

    def __len__(self) -> int:
        return len(self._computed())
