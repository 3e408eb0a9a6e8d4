"""xds.store.DocCache: the writer reuses the document of a state it encoded before."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.xds.test_store_batch import wl
from xds.state import WorkloadState
from xds.store import Batch, DocCache, _encode_doc, _Rows, workload_to_doc


def _doc(w: WorkloadState) -> str:
    return _encode_doc(workload_to_doc(w))


def test_a_renewal_reuses_the_document_its_previous_write_encoded() -> None:
    docs = DocCache(8)
    first = wl("a", serial=1)
    written = _Rows.encode(Batch(upserts={"a": first}), docs)
    second = wl("a", serial=2)
    rows = _Rows.encode(Batch(upserts={"a": second}, expect={"a": first}), docs)
    assert rows.expect["a"] is written.workloads["a"]  # reused, not encoded again
    assert rows.expect == {"a": _doc(first)} and rows.workloads == {"a": _doc(second)}
    plain = _Rows.encode(Batch(upserts={"a": second}, expect={"a": first}))
    assert (rows.workloads, rows.expect) == (plain.workloads, plain.expect)
    assert docs._docs["a"][0] is second  # the next renewal expects this one


def test_an_equal_but_different_state_is_encoded_anew() -> None:
    """Identity, not equality: a state that is not the cached object is encoded itself (an
    equal one encodes alike; a changed one must not get the cached document)."""
    docs = DocCache(8)
    w = wl("a", serial=1)
    docs.encode("a", w)
    changed = replace(w, certificates=())
    assert docs.encode("a", changed) == _doc(changed) != _doc(w)
    assert docs.encode("a", wl("a", serial=1)) == _doc(w)


def test_the_cache_keeps_at_most_its_size() -> None:
    docs = DocCache(3)
    states = {f"w{i}": wl(f"w{i}", serial=i + 1) for i in range(10)}
    for name, w in states.items():
        docs.encode(name, w)
    assert list(docs._docs) == ["w7", "w8", "w9"]  # the newest stay
    assert all(docs.encode(n, w) == _doc(w) for n, w in states.items())
    assert len(docs._docs) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.booleans()), max_size=30))
def test_documents_are_always_what_encoding_gives(ops: list[tuple[int, int, bool]]) -> None:
    """Random upserts and expectations of a few workloads, through a small cache: every
    document is the state's own encoding."""
    docs = DocCache(2)
    current = {f"w{i}": wl(f"w{i}", serial=1) for i in range(4)}
    for k, serial, expect in ops:
        name = f"w{k}"
        new = wl(name, serial=serial)
        batch = Batch(upserts={name: new}, expect={name: current[name]} if expect else {})
        rows = _Rows.encode(batch, docs)
        assert rows.workloads == {name: _doc(new)}
        assert rows.expect == ({name: _doc(current[name])} if expect else {})
        current[name] = new
