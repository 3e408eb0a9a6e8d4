"""The KBS resource protocol of the CoCo key broker (Request, Challenge, Attestation, Response),
pure: payload parsers, the evidence binding, and the session book. Time and randomness are
arguments.

As the published protocol description has it (``docs/kbs_attestation_protocol.md`` of the
confidential-containers KBS):

1. ``POST /kbs/v0/auth`` with a ``Request`` ``{"version", "tee", "extra-params"}``: the answer
   is a ``Challenge`` ``{"nonce", "extra-params"}`` and a ``kbs-session-id`` cookie;
2. ``POST /kbs/v0/attest`` with that cookie and an ``Attestation`` ``{"tee-pubkey": JWK,
   "tee-evidence": ...}``: the evidence must bind the nonce and the hash of ``tee-pubkey``;
3. ``GET /kbs/v0/resource/<repository>/<type>/<tag>`` with the cookie: a JWE (flattened JSON)
   encrypted to ``tee-pubkey``; 401 without an attested session, 403 not allowed, 404 unknown.

What this implementation fixes where the description leaves it to the attestation service:

* ``tee``: ``amd-sev-snp``, ``intel-tdx``, ``intel-sgx``, and ``sample`` (the simulated TEE,
  only where the sim verifier is configured);
* ``tee-evidence``: ``{"workload": <registration name>, "evidence": <base64 raw evidence>,
  "collateral": {name: base64}}``: the pod names itself (its quarantine and its SecretPolicy
  rules apply); the evidence must verify and be admitted by the attestation policy governing it;
* binding: the evidence's report data is ``SHA-512(canonical JSON {"nonce", "tee-pubkey"})``
  (``kbs_report_data``): the runtime data of the KBS protocol, one hash over both.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from certs.errors import AttestmeshError
from certs.evidence.claims import Tee
from certs.sealing import SealingError, TeePublicKey, canonical_json, parse_tee_pubkey

PROTOCOL_VERSIONS = frozenset({"0.1.0", "0.1.1"})
KBS_TEES: Mapping[str, Tee] = {
    "amd-sev-snp": Tee.SEV_SNP,
    "intel-tdx": Tee.TDX,
    "intel-sgx": Tee.SGX,
    "sample": Tee.SIM,
}
NONCE_BYTES = 32
CHALLENGE_TTL = timedelta(minutes=2)
SESSION_TTL = timedelta(minutes=5)
MAX_SESSIONS = 4096
MAX_EVIDENCE = 64 * 1024
COOKIE = "kbs-session-id"


class KbsError(AttestmeshError):
    """A KBS request refused. ``status`` is the HTTP status the protocol prescribes."""

    def __init__(self, reason: str, detail: str, status: int) -> None:
        super().__init__(reason, detail)
        self.status = status


@dataclass(frozen=True, slots=True)
class KbsEvidence:
    workload: str
    evidence: bytes
    collateral: Mapping[str, bytes]


@dataclass(frozen=True, slots=True)
class Attested:
    """What an attested session knows: who, the key to encrypt to, the facts its evidence showed
    (namespace/SA from the registration, claims from the verified evidence)."""

    workload: str
    tee_pubkey: TeePublicKey
    tee: str
    measurements: Mapping[str, str]
    tcb_status: str | None


@dataclass(frozen=True, slots=True)
class Session:
    tee: Tee
    nonce: str  # base64, as sent
    expires: datetime
    attested: Attested | None = None


def _b64(value: object, what: str, limit: int = MAX_EVIDENCE) -> bytes:
    if not isinstance(value, str) or len(value) > limit * 4 // 3 + 4:
        raise KbsError("request_malformed", f"{what} must be a base64 string", 400)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise KbsError("request_malformed", f"{what} is not base64", 400) from None


def parse_request(body: Any, enabled: frozenset[Tee]) -> Tee:
    """A ``Request``: a supported version and a TEE this control plane verifies."""
    if not isinstance(body, dict) or not {"version", "tee"} <= set(body):
        raise KbsError("request_malformed", "a Request has version and tee", 400)
    if set(body) - {"version", "tee", "extra-params"}:
        raise KbsError("request_malformed", "a Request has version, tee, extra-params", 400)
    if body["version"] not in PROTOCOL_VERSIONS:
        raise KbsError(
            "version_not_supported", f"protocol versions {sorted(PROTOCOL_VERSIONS)}", 400
        )
    tee = KBS_TEES.get(body["tee"]) if isinstance(body["tee"], str) else None
    if tee is None or tee not in enabled:
        raise KbsError("tee_not_supported", "this KBS does not verify that TEE", 400)
    return tee


def parse_attestation(body: Any) -> tuple[dict[str, Any], KbsEvidence]:
    """An ``Attestation``: the ``tee-pubkey`` JWK (checked by ``parse_tee_pubkey``) and our
    ``tee-evidence`` object."""
    if not isinstance(body, dict) or set(body) != {"tee-pubkey", "tee-evidence"}:
        raise KbsError("request_malformed", "an Attestation has tee-pubkey and tee-evidence", 400)
    jwk, ev = body["tee-pubkey"], body["tee-evidence"]
    if not isinstance(jwk, dict) or not isinstance(ev, dict):
        raise KbsError("request_malformed", "tee-pubkey and tee-evidence are objects", 400)
    if set(ev) - {"workload", "evidence", "collateral"} or not isinstance(ev.get("workload"), str):
        raise KbsError("request_malformed", "tee-evidence: workload, evidence, collateral", 400)
    if not 0 < len(ev["workload"]) <= 253:
        raise KbsError("request_malformed", "tee-evidence.workload", 400)
    collateral_raw = ev.get("collateral", {})
    if not isinstance(collateral_raw, dict) or len(collateral_raw) > 16:
        raise KbsError("request_malformed", "tee-evidence.collateral maps names to base64", 400)
    collateral = {str(k): _b64(v, f"collateral {k}") for k, v in collateral_raw.items()}
    return jwk, KbsEvidence(ev["workload"], _b64(ev.get("evidence"), "evidence"), collateral)


def kbs_report_data(nonce: str, tee_pubkey: Mapping[str, Any]) -> bytes:
    """The 64 bytes the evidence must carry: SHA-512 over the canonical runtime data."""
    return hashlib.sha512(canonical_json({"nonce": nonce, "tee-pubkey": dict(tee_pubkey)})).digest()


def check_binding(report_data: bytes, nonce: str, tee_pubkey: Mapping[str, Any]) -> None:
    if not hmac.compare_digest(report_data, kbs_report_data(nonce, tee_pubkey)):
        raise KbsError(
            "binding_mismatch", "the evidence does not bind this nonce and tee-pubkey", 401
        )


def tee_key(jwk: Mapping[str, Any]) -> TeePublicKey:
    try:
        return parse_tee_pubkey(dict(jwk))
    except SealingError as exc:
        raise KbsError(exc.reason, exc.detail, 400) from None


class KbsSessions:
    """The cookie -> session book: bounded (the oldest is dropped), expiring, ids random."""

    def __init__(
        self,
        *,
        clock: Callable[[], datetime],
        random_bytes: Callable[[int], bytes],
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self._clock = clock
        self._random = random_bytes
        self._max = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def challenge(self, tee: Tee) -> tuple[str, Session]:
        now = self._clock()
        self._expire(now)
        while len(self._sessions) >= self._max:
            self._sessions.popitem(last=False)
        sid = base64.urlsafe_b64encode(self._random(32)).rstrip(b"=").decode()
        nonce = base64.b64encode(self._random(NONCE_BYTES)).decode()
        session = Session(tee, nonce, now + CHALLENGE_TTL)
        self._sessions[sid] = session
        return sid, session

    def get(self, sid: str | None) -> Session:
        session = self._sessions.get(sid) if sid else None
        if session is None or self._clock() >= session.expires:
            if sid:
                self._sessions.pop(sid, None)
            raise KbsError("session_unknown", "no KBS session: POST /kbs/v0/auth first", 401)
        return session

    def attested(self, sid: str, attested: Attested) -> None:
        """The challenge is answered: the session is attested (and its nonce spent)."""
        session = self.get(sid)
        if session.attested is not None:
            raise KbsError("session_attested", "this session has attested already", 401)
        self._sessions[sid] = replace(
            session, attested=attested, nonce="", expires=self._clock() + SESSION_TTL
        )

    def drop(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def _expire(self, now: datetime) -> None:
        for sid in [s for s, v in self._sessions.items() if now >= v.expires][:64]:
            del self._sessions[sid]


__all__ = [
    "COOKIE",
    "KBS_TEES",
    "Attested",
    "KbsError",
    "KbsEvidence",
    "KbsSessions",
    "Session",
    "check_binding",
    "kbs_report_data",
    "parse_attestation",
    "parse_request",
    "tee_key",
]
