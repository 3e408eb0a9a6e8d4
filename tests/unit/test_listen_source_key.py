"""``_source_key`` remembers the bucket of each host it has seen (an address is parsed once,
not at every accept) within a bound, and the connections of one source share its string."""

from __future__ import annotations

import pytest

from attestmesh import listen
from attestmesh.listen import _source_key


def test_a_host_is_parsed_once_and_its_key_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listen, "_sources", {})
    parsed: list[str] = []
    real = listen._parse_source

    def counting(host: str) -> str:
        parsed.append(host)
        return real(host)

    monkeypatch.setattr(listen, "_parse_source", counting)
    first = _source_key(("".join(["10.0.0.", "7"]), 1000))  # a string of its own, as accept's
    again = _source_key(("".join(["10.0.", "0.7"]), 2000))
    assert first == again == "10.0.0.7"
    assert first is again
    assert parsed == ["10.0.0.7"]
    v6 = _source_key(("2001:db8:1:2::5", 1, 0, 0))
    assert v6 == _source_key(("2001:db8:1:2:ff::1", 9, 0, 0)) == "2001:db8:1:2::/64"
    assert _source_key(("::ffff:10.0.0.1", 1, 0, 0)) == "10.0.0.1"
    assert _source_key(("not an address", 1)) == "not an address"
    assert _source_key("") is None


def test_the_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listen, "_sources", {})
    monkeypatch.setattr(listen, "_SOURCES_KEPT", 64)
    for i in range(1000):
        assert _source_key((f"10.0.{i // 256}.{i % 256}", 1)) == f"10.0.{i // 256}.{i % 256}"
        assert len(listen._sources) <= 64
