"""Local mode's identity check: a registration's join token, compared by its SHA-256."""

from __future__ import annotations

import hashlib
import hmac

from certs.issuance import (
    IdentityError,
)
from xds.state import (
    Registration,
)


class RegistrationTokenCheck:
    """Local mode: a registration entry carries the SHA-256 of its join token. A registration
    without one (kept in state from a run that allowed it, say) is refused unless
    ``allow_tokenless`` (``--allow-unauthenticated-registrations``)."""

    def __init__(self, *, allow_tokenless: bool) -> None:
        self._allow_tokenless = allow_tokenless

    async def check(self, reg: Registration, token: str | None) -> None:
        if reg.token_sha256 is None:
            if self._allow_tokenless:
                return
            raise IdentityError("identity_invalid", f"{reg.name} has no join token registered")
        got = hashlib.sha256((token or "").encode()).hexdigest()
        if not hmac.compare_digest(got, reg.token_sha256):
            raise IdentityError("identity_invalid", f"bad registration token for {reg.name}")
