"""attestmesh.gcpolicy start-up hold: automatic collection is off from hold_collections until
GcPolicy.start (or release_collections), and a hold never turns on what someone else turned
off."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from attestmesh import gcpolicy
from attestmesh.gcpolicy import Collector, GcPolicy, hold_collections, release_collections


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    release_collections()
    if was:
        gc.enable()
    else:
        gc.disable()


def _fake_policy() -> GcPolicy:
    noop = Collector(freeze=lambda: None, unfreeze=lambda: None, collect=lambda: 0, size=lambda: 1)
    return GcPolicy(collector=noop, connections=lambda: (0, 0))


def test_hold_turns_collection_off_until_the_policy_starts() -> None:
    gc.enable()
    hold_collections()
    assert not gc.isenabled()
    hold_collections()  # idempotent
    assert not gc.isenabled()
    _fake_policy().start()
    assert gc.isenabled()
    release_collections()  # nothing held any more: no effect
    assert gc.isenabled()


def test_release_is_idempotent_and_ends_the_hold() -> None:
    gc.enable()
    hold_collections()
    release_collections()
    assert gc.isenabled()
    gc.disable()
    release_collections()  # not held: leaves someone else's choice alone
    assert not gc.isenabled()


def test_a_hold_never_turns_on_what_someone_else_turned_off() -> None:
    gc.disable()
    hold_collections()
    _fake_policy().start()
    assert not gc.isenabled()
    assert gcpolicy._held is False


def test_the_policy_starts_as_before_without_a_hold() -> None:
    gc.enable()
    frozen: list[int] = []
    c = Collector(
        freeze=lambda: frozen.append(1), unfreeze=lambda: None, collect=lambda: 0, size=lambda: 7
    )
    GcPolicy(collector=c, connections=lambda: (0, 0)).start()
    assert frozen == [1] and gc.isenabled()
