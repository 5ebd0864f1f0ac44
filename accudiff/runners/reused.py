"""Runners kept open across the jobs of one worker process: verification's rounds run one switchboard with
different switches, and each round's job finds its session made (execution/worker.py)."""

from __future__ import annotations

from typing import Callable

from accudiff.runners.base import Runner


class ReusedRunners:
    """Runners kept open across the jobs of one worker (passes marked `reuse`: the same model file, run
    with different `fixed_inputs`). Each is activated once and closed when the worker ends."""

    def __init__(self) -> None:
        self._runners: dict[tuple, Runner] = {}

    def get(self, key: tuple, make: Callable[[], Runner]) -> Runner:
        if key not in self._runners:
            self._runners[key] = _Reused(make())
        return self._runners[key]

    def close(self) -> None:
        for runner in self._runners.values():
            runner.runner.deactivate()
        self._runners = {}


class _Reused(Runner):
    """A runner its engines share: activated on first use, never deactivated by them."""

    def __init__(self, runner: Runner) -> None:
        self.runner, self._active = runner, False

    def activate(self) -> None:
        if not self._active:
            self.runner.activate()
            self._active = True

    def infer(self, feed):
        return self.runner.infer(feed)

    def deactivate(self) -> None:
        pass

    @property
    def label(self) -> str:
        return self.runner.label

    @property
    def not_observable(self) -> dict[str, str]:
        return self.runner.not_observable

    @property
    def notices(self) -> list[str]:
        return self.runner.notices
