"""The leaves of a JSON file, one at a time, without the file in memory: a mark-all RunResults file of a
real model is hundreds of MB of base64, and reading it whole takes several times that.

`leaves(path, keep)` yields `(path, value)` for every string, number, true, false and null, where `path`
is the tuple of keys and list positions leading to it; strings whose path `keep` rejects are skipped
without being held (their value is None). At most one kept string is in memory at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

CHUNK = 1 << 20
Path_ = tuple  # keys (str) and list positions (int) from the root


class _Reader:
    """Characters of a UTF-8 file, read a chunk at a time."""

    def __init__(self, file) -> None:
        self.file, self.buffer, self.at = file, "", 0

    def _fill(self) -> bool:
        chunk = self.file.read(CHUNK)
        if not chunk:
            return False
        self.buffer, self.at = self.buffer[self.at :] + chunk, 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ("" at the end of the file)."""
        while True:
            while self.at < len(self.buffer) and self.buffer[self.at] in " \t\r\n":
                self.at += 1
            if self.at < len(self.buffer) or not self._fill():
                return self.buffer[self.at] if self.at < len(self.buffer) else ""

    def take(self, expected: str) -> None:
        if self.peek() != expected:
            raise ValueError(f"expected '{expected}' in the JSON, found {self.peek()!r}")
        self.at += 1

    def string(self, keep: bool) -> str | None:
        """A string (the reader is at its opening quote); held only when `keep`."""
        self.take('"')
        parts: list[str] = []
        while True:
            end = self.buffer.find('"', self.at)
            while end >= 0 and _escaped(self.buffer, end, self.at):
                end = self.buffer.find('"', end + 1)
            if end < 0:
                tail = len(self.buffer)
                while tail > self.at and self.buffer[tail - 1] == "\\":  # backslashes wait for what they escape
                    tail -= 1
                if keep:
                    parts.append(self.buffer[self.at : tail])
                self.at = tail
                if not self._fill():
                    raise ValueError("the JSON ends inside a string")
                continue
            if keep:
                parts.append(self.buffer[self.at : end])
            self.at = end + 1
            if not keep:
                return None
            raw = "".join(parts)
            return json.loads(f'"{raw}"') if "\\" in raw else raw

    def scalar(self) -> object:
        """A number, true, false or null."""
        text = ""
        while True:
            start = self.at
            while self.at < len(self.buffer) and self.buffer[self.at] not in ",]} \t\r\n":
                self.at += 1
            text += self.buffer[start : self.at]
            if self.at < len(self.buffer) or not self._fill():
                return json.loads(text)


def _escaped(text: str, quote: int, start: int) -> bool:
    """Whether the quote at `quote` is escaped (preceded by an odd number of backslashes)."""
    count, at = 0, quote - 1
    while at >= start and text[at] == "\\":
        count, at = count + 1, at - 1
    return count % 2 == 1


def leaves(path: Path, keep: Callable[[Path_], bool]) -> Iterator[tuple[Path_, object]]:
    """Every leaf of the JSON file at `path`, in order (see the module's docstring)."""
    with open(path, encoding="utf-8") as file:
        reader = _Reader(file)
        yield from _value(reader, (), keep)
        if reader.peek() != "":
            raise ValueError("the JSON goes on after its end")


def _value(reader: _Reader, where: Path_, keep: Callable[[Path_], bool]) -> Iterator[tuple[Path_, object]]:
    first = reader.peek()
    if first == "{":
        reader.take("{")
        if reader.peek() == "}":
            reader.take("}")
            return
        while True:
            key = reader.string(keep=True)
            reader.take(":")
            yield from _value(reader, (*where, key), keep)
            if reader.peek() == ",":
                reader.take(",")
                continue
            reader.take("}")
            return
    if first == "[":
        reader.take("[")
        if reader.peek() == "]":
            reader.take("]")
            return
        index = 0
        while True:
            yield from _value(reader, (*where, index), keep)
            index += 1
            if reader.peek() == ",":
                reader.take(",")
                continue
            reader.take("]")
            return
    if first == '"':
        yield where, reader.string(keep(where))
    elif first == "":
        raise ValueError("the JSON ends early")
    else:
        yield where, reader.scalar()
