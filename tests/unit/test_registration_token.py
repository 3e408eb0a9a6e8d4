"""Local mode identity: join tokens, and no silent pass for a registration without one."""

from __future__ import annotations

import hashlib

import pytest

from attestmesh.controlplane import RegistrationTokenCheck
from certs.issuance import IdentityError
from xds.state import Endpoint, Registration


def reg(token: str | None) -> Registration:
    sha = None if token is None else hashlib.sha256(token.encode()).hexdigest()
    return Registration("web-1", "default", "web", "web", Endpoint("127.0.0.1", 1), 2,
                        token_sha256=sha)  # fmt: skip


async def test_the_join_token_must_match() -> None:
    check = RegistrationTokenCheck(allow_tokenless=False)
    await check.check(reg("s3cret"), "s3cret")
    for wrong in (None, "", "s3cret ", "other"):
        with pytest.raises(IdentityError):
            await check.check(reg("s3cret"), wrong)


async def test_a_tokenless_registration_is_refused_unless_allowed() -> None:
    # e.g. kept in state from a run started with --allow-unauthenticated-registrations
    with pytest.raises(IdentityError) as exc:
        await RegistrationTokenCheck(allow_tokenless=False).check(reg(None), None)
    assert "no join token" in exc.value.detail
    await RegistrationTokenCheck(allow_tokenless=True).check(reg(None), None)
