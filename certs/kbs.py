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
import heapq
import hmac
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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
MAX_ENTRIES = 65536  # spent challenges + attested sessions (state only after evidence verified)
PER_WORKLOAD = 16  # attested sessions per workload; its oldest is dropped
MAX_EVIDENCE = 64 * 1024
COOKIE = "kbs-session-id"
_TEE_CODES: tuple[Tee, ...] = tuple(KBS_TEES.values())
_MAC_CONTEXT = b"attestmesh kbs challenge v1\0"
_PAYLOAD = 9 + NONCE_BYTES  # tee code (1), expiry in Unix seconds (8), nonce
_COOKIE_CHARS = len(base64.urlsafe_b64encode(bytes(_PAYLOAD + 32)).rstrip(b"="))


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
class Challenge:
    """What a challenge cookie carries (authenticated by the book's HMAC)."""

    tee: Tee
    nonce: str  # base64, as sent
    expires: datetime
    key: bytes  # the raw nonce: the challenge's identity in the book


@dataclass(frozen=True, slots=True)
class _Entry:
    expires: datetime
    attested: Attested | None  # None: a spent challenge, remembered until it expires
    spent_until: datetime | None = None  # an attested session: when its challenge expires


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
    """The session book. A challenge is stateless: its cookie carries the TEE, the expiry and the
    nonce under an HMAC with this book's key, so ``POST /kbs/v0/auth`` (unauthenticated) stores
    nothing and cannot evict anyone. State is kept only once evidence has *verified*: the
    challenge is then spent (remembered until it expires, so it is answered once) and, if the
    attestation is admitted, the attested session (until ``SESSION_TTL``) under the same cookie.
    Bounded: at most ``per_workload`` attested sessions per workload (its oldest is dropped,
    never another workload's) and ``max_entries`` in all (then attestation answers 503 until
    entries expire; sessions in force are never evicted for newcomers)."""

    def __init__(
        self,
        *,
        clock: Callable[[], datetime],
        random_bytes: Callable[[int], bytes],
        max_entries: int = MAX_ENTRIES,
        per_workload: int = PER_WORKLOAD,
    ) -> None:
        self._clock = clock
        self._key = random_bytes(32)
        self._random = random_bytes
        self._max = max_entries
        self._per_workload = per_workload
        self._entries: dict[bytes, _Entry] = {}
        self._by_workload: dict[str, OrderedDict[bytes, None]] = {}
        self._expiry: list[tuple[datetime, int, bytes]] = []
        self._seq = 0

    def __len__(self) -> int:
        """Entries held: spent challenges and attested sessions (challenges are not held)."""
        return len(self._entries)

    def challenge(self, tee: Tee) -> tuple[str, Challenge]:
        """A fresh challenge and its cookie; nothing is stored."""
        expires = int((self._clock() + CHALLENGE_TTL).timestamp())
        nonce = self._random(NONCE_BYTES)
        if len(nonce) != NONCE_BYTES:
            raise ValueError("random_bytes returned the wrong length")
        payload = struct.pack(">BQ", _TEE_CODES.index(tee), expires) + nonce
        cookie = base64.urlsafe_b64encode(payload + self._mac(payload)).rstrip(b"=").decode()
        return cookie, self._challenge(payload)

    def open(self, cookie: str | None) -> Challenge:
        """The unexpired, unanswered challenge a cookie carries (401 otherwise)."""
        challenge = self._parse(cookie)
        if self._clock() >= challenge.expires:
            raise KbsError("session_unknown", "the challenge expired: POST /kbs/v0/auth", 401)
        self._purge(self._clock())
        if challenge.key in self._entries:
            raise KbsError("session_attested", "this challenge has been answered", 401)
        return challenge

    def spend(self, challenge: Challenge) -> None:
        """The challenge's evidence verified: it is answered, whatever the outcome."""
        now = self._clock()
        self._purge(now)
        if challenge.key in self._entries:
            raise KbsError("session_attested", "this challenge has been answered", 401)
        if len(self._entries) >= self._max:
            raise KbsError("kbs_busy", "too many sessions: try again later", 503)
        self._put(challenge.key, _Entry(challenge.expires, None))

    def attested(self, challenge: Challenge, attested: Attested) -> None:
        """The spent challenge's attestation is admitted: its cookie is an attested session."""
        entry = self._entries.get(challenge.key)
        if entry is None or entry.attested is not None:
            raise KbsError("session_unknown", "spend the challenge first", 401)
        self._put(challenge.key, _Entry(self._clock() + SESSION_TTL, attested, entry.expires))
        mine = self._by_workload.setdefault(attested.workload, OrderedDict())
        mine[challenge.key] = None
        while len(mine) > self._per_workload:
            oldest, _ = mine.popitem(last=False)
            old = self._entries[oldest]  # still spent until its challenge expires
            self._put(oldest, _Entry(old.spent_until or old.expires, None))

    def session(self, cookie: str | None) -> Attested:
        """The attested session a cookie names (401 ``not_attested`` / ``session_unknown``)."""
        challenge = self._parse(cookie)
        now = self._clock()
        self._purge(now)
        entry = self._entries.get(challenge.key)
        if entry is not None and entry.attested is not None and now < entry.expires:
            return entry.attested
        if now < challenge.expires and entry is None:
            raise KbsError("not_attested", "attest first: POST /kbs/v0/attest", 401)
        raise KbsError("session_unknown", "no KBS session: POST /kbs/v0/auth first", 401)

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, _MAC_CONTEXT + payload, hashlib.sha256).digest()

    def _parse(self, cookie: str | None) -> Challenge:
        unknown = KbsError("session_unknown", "no KBS session: POST /kbs/v0/auth first", 401)
        if not cookie or len(cookie) != _COOKIE_CHARS:
            raise unknown
        try:
            raw = base64.urlsafe_b64decode(cookie + "=" * (-len(cookie) % 4))
        except (binascii.Error, ValueError):
            raise unknown from None
        payload, mac = raw[:_PAYLOAD], raw[_PAYLOAD:]
        if len(raw) != _PAYLOAD + 32 or not hmac.compare_digest(mac, self._mac(payload)):
            raise unknown
        return self._challenge(payload)

    @staticmethod
    def _challenge(payload: bytes) -> Challenge:
        code, expires = struct.unpack(">BQ", payload[:9])
        nonce = payload[9:]
        return Challenge(
            _TEE_CODES[code],
            base64.b64encode(nonce).decode(),
            datetime.fromtimestamp(expires, UTC),
            nonce,
        )

    def _put(self, key: bytes, entry: _Entry) -> None:
        self._entries[key] = entry
        self._seq += 1
        heapq.heappush(self._expiry, (entry.expires, self._seq, key))

    def _purge(self, now: datetime) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            expires, _, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is None or entry.expires != expires:
                continue  # superseded by a later state of the same key
            del self._entries[key]
            if entry.attested is not None:
                mine = self._by_workload.get(entry.attested.workload)
                if mine is not None:
                    mine.pop(key, None)
                    if not mine:
                        del self._by_workload[entry.attested.workload]


__all__ = [
    "COOKIE",
    "KBS_TEES",
    "Attested",
    "Challenge",
    "KbsError",
    "KbsEvidence",
    "KbsSessions",
    "check_binding",
    "kbs_report_data",
    "parse_attestation",
    "parse_request",
    "tee_key",
]
