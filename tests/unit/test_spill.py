"""``storage.spill``: lists kept on disk past a memory budget, JSON written as it is made."""

from __future__ import annotations

import io
import json
import math

import pytest

from storage.spill import SpillList, write_json


def test_a_spill_list_keeps_order_and_length_across_memory_and_disk() -> None:
    items = SpillList(memory_items=3, block_items=4)
    assert not items
    assert list(items) == []
    items.extend({"i": i, "x": [i] * 2} for i in range(20))
    assert len(items) == 20
    assert items
    assert [d["i"] for d in items] == list(range(20))  # 3 in memory, 16 in blocks, 1 in tail
    assert "16 on disk" in repr(items)
    items.append({"i": 20})
    assert [d["i"] for d in items][-2:] == [19, 20]
    assert [d["i"] for d in items] == [d["i"] for d in items]  # iterating twice: same items
    items.close()
    assert len(items) == 0
    assert list(items) == []


def test_iterating_while_appending_sees_what_was_there() -> None:
    items = SpillList(range(10), memory_items=2, block_items=3)
    seen = []
    for i in items:
        seen.append(i)
        if i < 3:
            items.append(100 + i)
    assert seen[:10] == list(range(10))
    assert len(items) == 13


def test_a_spill_list_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="memory_items"):
        SpillList(memory_items=-1)
    with pytest.raises(ValueError, match="block_items"):
        SpillList(block_items=0)


@pytest.mark.parametrize("doc", [
    {},
    [],
    {"a": [], "b": {}, "c": None, "d": [1, {"e": [2, 3]}], "f": "é\n\"", "g": math.inf},
    [{"x": 1.5}, [], [[]], "s"],
    {"nested": {"deeper": [{"k": [1, 2]}, {}]}},
])
def test_written_json_is_json_dumps_of_the_same_document(doc) -> None:
    """With every list given as a generator (or a SpillList), the bytes are json.dump's."""

    def as_streams(value):
        if isinstance(value, dict):
            return {k: as_streams(v) for k, v in value.items()}
        if isinstance(value, list):
            return (as_streams(v) for v in value)
        return value

    for streamed in (doc, as_streams(doc)):
        out = io.StringIO()
        write_json(streamed, out, indent=2)
        assert out.getvalue() == json.dumps(doc, indent=2)
    spilled = SpillList([{"a": i} for i in range(7)], memory_items=2, block_items=2)
    out = io.StringIO()
    write_json({"items": spilled, "n": 7}, out)
    assert json.loads(out.getvalue()) == {"items": [{"a": i} for i in range(7)], "n": 7}
    assert out.getvalue() == json.dumps({"items": [{"a": i} for i in range(7)], "n": 7},
                                        indent=2)


def test_a_value_json_cannot_hold_is_refused() -> None:
    with pytest.raises(TypeError):
        write_json({"a": (x for x in [object()])}, io.StringIO())
