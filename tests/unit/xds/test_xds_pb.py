"""betterproto2 handling: hand-framed responses and the per-class validator cache."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pydantic
import pytest
from pydantic.warnings import PydanticDeprecatedSince212

from xds import pb
from xds.resources import TypeUrl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.listener.v3 import Listener
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryResponse
    from envoy_data_plane.google.protobuf import Any as AnyMsg


def unpacked_name(any_: AnyMsg) -> str:
    msg = any_.unpack()
    assert isinstance(msg, Listener)
    return msg.name


@pytest.fixture(params=[False, True], ids=["naive", "cached"])
def validator_mode(request: pytest.FixtureRequest) -> Iterator[bool]:
    was = pb.validator_cache_installed()
    if request.param:
        assert pb.install_validator_cache()
    else:
        pb.uninstall_validator_cache()
    yield request.param
    if was:
        pb.install_validator_cache()
    else:
        pb.uninstall_validator_cache()


def test_pack_equals_betterproto_any(validator_mode: bool) -> None:
    listener = Listener(name="inbound", stat_prefix="x")
    assert pb.pack(listener, TypeUrl.LISTENER) == bytes(AnyMsg.pack(listener))
    assert pb.validator_cache_installed() is validator_mode


@pytest.mark.parametrize("version,nonce", [("v1", "7"), ("", "")])
def test_hand_framed_response_equals_betterproto(version: str, nonce: str) -> None:
    resources = [AnyMsg.pack(Listener(name=f"l{i}")) for i in range(3)]
    framed = pb.encode_discovery_response(
        version, TypeUrl.LISTENER, nonce, [bytes(r) for r in resources]
    )
    reference = DiscoveryResponse(
        version_info=version, resources=resources, type_url=TypeUrl.LISTENER, nonce=nonce
    )
    assert framed == bytes(reference)
    parsed = DiscoveryResponse.parse(framed)
    assert [unpacked_name(r) for r in parsed.resources] == ["l0", "l1", "l2"]


def test_large_resource_lengths_use_multibyte_varints() -> None:
    big = AnyMsg.pack(Listener(name="x" * 70_000))
    framed = pb.encode_discovery_response("v", TypeUrl.LISTENER, "1", [bytes(big)])
    assert unpacked_name(DiscoveryResponse.parse(framed).resources[0]) == "x" * 70_000


def test_cached_validator_still_validates(validator_mode: bool) -> None:
    # attributes set after construction are validated at serialization, as before the patch
    listener = Listener(name="ok")
    listener.name = 5  # type: ignore[assignment]
    with pytest.raises(pydantic.ValidationError):
        bytes(listener)
    listener.name = "fine"
    assert Listener.parse(bytes(listener)).name == "fine"


def test_encoded_passes_bytes_through() -> None:
    assert pb.Encoded(b"abc").SerializeToString() == b"abc"
    assert pb.Encoded.FromString(b"xyz").data == b"xyz"


def test_install_is_idempotent_and_reversible() -> None:
    was = pb.validator_cache_installed()
    try:
        assert pb.install_validator_cache() and pb.install_validator_cache()
        assert pb.validator_cache_installed()
        pb.uninstall_validator_cache()
        assert not pb.validator_cache_installed()
    finally:
        if was:
            pb.install_validator_cache()
