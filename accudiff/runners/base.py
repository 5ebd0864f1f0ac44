"""The one interface every backend implements, so nothing outside `runners/` knows which one it talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np

BACKEND_NAMES = {"onnxrt": "ONNX Runtime", "trt": "TensorRT"}  # a backend as messages name it


class Runner(ABC):
    """Lifecycle: `activate()` -> `infer(feed)` any number of times -> `deactivate()`; or use `with`.

    `infer` returns `{tensor name: array}` for every tensor the runner could observe. Arrays may be
    memory-mapped and stay valid only until the next `infer` call: consume them before asking again.
    """

    #: Human-readable description of what this runner really computes (shown in reports).
    label: str = ""
    #: Whether its runs may go on while another runner's do, on another thread (engine.py): ONNX Runtime's CPU
    #: sessions, each on its own threads; not a GPU runner, whose device the others would share.
    runs_beside_others: bool = False

    @abstractmethod
    def activate(self) -> None: ...

    @abstractmethod
    def infer(self, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]: ...

    @abstractmethod
    def deactivate(self) -> None: ...

    @property
    def not_observable(self) -> dict[str, str]:
        """Tensors this runner was asked for but cannot observe, with the reason."""
        return {}

    @property
    def notices(self) -> list[str]:
        """What a reader of the report must know about how this runner observed the model."""
        return []

    def __enter__(self) -> "Runner":
        self.activate()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.deactivate()
