"""Lists too long to hold in memory, and JSON documents written as they are made.

A replay of a month of a 256-GPU fleet lists every anomaly and every alert change (issue #15:
677,000 anomalies and 471,000 alert changes for 10 days, about half the replay's memory).
:class:`SpillList` keeps the first items in memory and the rest, pickled in blocks, in an
anonymous temporary file (gone when the list is, or when the process ends); it appends and
iterates in order as a list does. :func:`write_json` writes a document whose big lists are
iterables (a :class:`SpillList`, a generator) without building them: the bytes are those of
``json.dump(doc, out, indent=indent)`` had the iterables been lists.

The temporary file is written and read by this process only, so pickle reads back nothing
it did not write itself.
"""

from __future__ import annotations

import json
import pickle
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any, Generic, TypeVar

T = TypeVar("T")

MEMORY_ITEMS = 4096
"""Items a :class:`SpillList` keeps in memory before it writes to disk."""

BLOCK_ITEMS = 1024
"""Items pickled together (one ``pickle.dump`` per block)."""


class SpillList(Generic[T]):
    """An append-only list that writes its items past the first ``memory_items`` to disk.

    Supports ``append``, ``extend``, ``len``, truth and iteration in the order appended
    (iterating while appending sees the items appended before the iteration began, or
    more). Items must pickle. Not thread-safe.

    Args:
        memory_items: Items kept in memory, >= 0.
        block_items: Items pickled per block, >= 1.

    Raises:
        ValueError: A negative ``memory_items`` or a ``block_items`` below 1.
        OSError: The temporary file cannot be made or written (the disk is full).
    """

    def __init__(self, items: Iterable[T] = (), *, memory_items: int = MEMORY_ITEMS,
                 block_items: int = BLOCK_ITEMS) -> None:
        if memory_items < 0 or block_items < 1:
            raise ValueError("memory_items must be >= 0 and block_items >= 1")
        self._memory_items = memory_items
        self._block_items = block_items
        self._head: list[T] = []
        self._tail: list[T] = []
        self._file: IO[bytes] | None = None
        self._blocks: list[int] = []
        """Offset of each block in the file."""
        self._on_disk = 0
        self._closer: weakref.finalize[Any, Any] | None = None
        self.extend(items)

    def append(self, item: T) -> None:
        """Add ``item`` at the end."""
        if len(self._head) < self._memory_items:
            self._head.append(item)
            return
        self._tail.append(item)
        if len(self._tail) >= self._block_items:
            self._flush()

    def extend(self, items: Iterable[T]) -> None:
        """Add ``items`` at the end, in order."""
        for item in items:
            self.append(item)

    def _flush(self) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="gpuhealth-spill-")  # noqa: SIM115
            self._closer = weakref.finalize(self, self._file.close)  # gone with the list
        self._file.seek(0, 2)
        self._blocks.append(self._file.tell())
        pickle.dump(self._tail, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        self._on_disk += len(self._tail)
        self._tail = []

    def __len__(self) -> int:
        return len(self._head) + self._on_disk + len(self._tail)

    def __bool__(self) -> bool:
        return bool(self._head) or bool(self._tail) or self._on_disk > 0

    def __iter__(self) -> Iterator[T]:
        yield from self._head
        for offset in list(self._blocks):
            assert self._file is not None
            self._file.seek(offset)
            block: list[T] = pickle.load(self._file)  # written by this list only
            yield from block
        yield from list(self._tail)

    def __repr__(self) -> str:
        return f"SpillList({len(self)} items, {self._on_disk} on disk)"

    def close(self) -> None:
        """Drop every item and remove the temporary file."""
        if self._closer is not None:
            self._closer()
            self._file = self._closer = None
        self._head, self._tail, self._blocks, self._on_disk = [], [], [], 0


def write_json(doc: Any, out: IO[str], *, indent: int = 2) -> None:
    """Write ``doc`` as JSON to ``out``, its non-list iterables as arrays, item by item.

    ``doc`` is what ``json.dump`` takes, except that any iterable that is not a ``str``,
    ``list``, ``tuple`` or mapping (a :class:`SpillList`, a generator) is written as an
    array as it is iterated, so that only one item of it is in memory at a time. The
    output is byte for byte ``json.dump(doc, out, indent=indent)`` with those iterables
    made lists.

    Raises:
        TypeError: A value JSON cannot represent.
    """
    _write(doc, out, indent, 0)


def _write(value: Any, out: IO[str], indent: int, depth: int) -> None:
    if isinstance(value, Mapping) and _streams_inside(value):
        if not value:
            out.write("{}")
            return
        inner = "\n" + " " * (indent * (depth + 1))
        out.write("{")
        for i, (key, item) in enumerate(value.items()):
            out.write(("," if i else "") + inner + json.dumps(str(key)) + ": ")
            _write(item, out, indent, depth + 1)
        out.write("\n" + " " * (indent * depth) + "}")
    elif _is_stream(value) or (isinstance(value, list | tuple) and _streams_inside(value)):
        inner = "\n" + " " * (indent * (depth + 1))
        first = True
        for item in value:
            out.write(("[" if first else ",") + inner)
            first = False
            _write(item, out, indent, depth + 1)
        out.write("[]" if first else "\n" + " " * (indent * depth) + "]")
    else:  # no stream below: json's own encoding, indented to where it sits
        text = json.dumps(value, indent=indent)
        out.write(text.replace("\n", "\n" + " " * (indent * depth)) if depth else text)


def _is_stream(value: Any) -> bool:
    return (isinstance(value, Iterable) and not isinstance(value, str | bytes | list | tuple)
            and not isinstance(value, Mapping))


def _streams_inside(value: Any) -> bool:
    """Whether a stream is anywhere in ``value`` (a dict or list holding one, at any depth)."""
    if _is_stream(value):
        return True
    if isinstance(value, Mapping):
        return any(_streams_inside(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_streams_inside(v) for v in value)
    return False
