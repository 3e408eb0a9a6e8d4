"""The attestation result in a standard form: an EAR (EAT Attestation Result) signed by the
control plane, wrapped in a RATS Conceptual Message Wrapper, carried in each mesh leaf.

Pure: time, keys and claims come in as arguments; nothing here reads a clock or a file.

Documents followed (the encodings below cite their sections):

- EAR: draft-ietf-rats-ear ("EAT Attestation Results"), §3 the claims-set (``eat_profile``
  ``tag:github.com,2023:veraison/ear``, ``iat``, ``ear.verifier-id``, ``submods``, optional
  ``eat_nonce``), §3.1 the verifier identification (``build``, ``developer``), §3.2 the
  appraisal (``ear.status``, ``ear.trustworthiness-vector``, ``ear.appraisal-policy-id``),
  §3.2.2 the trust tiers, §3.3 the JSON serialisation (claim names, tier names), §4.1
  unregistered extensions (collision-resistant public names: ours start ``attestmesh.dev/``),
  §4.5 the ``ear.veraison.key-attestation`` extension (``akpub``: the attested key's
  SubjectPublicKeyInfo, base64url), §5 media types. The trustworthiness values and tiers are
  AR4SI's (draft-ietf-rats-ar4si §2.3): 0 none, 2-31 affirming, 32-95 warning, 96-127
  contraindicated.
- EAT: RFC 9711 (§4.1 ``eat_nonce``: 8 to 64 bytes, base64url in JSON; §4.2.18 ``submods``;
  §4.3.1 ``iat`` is an integer; §6 profiles) and the EAT media types, RFC 9782
  (``application/eat+jwt`` with the ``eat_profile`` parameter).
- JWT/JWS: RFC 7519 (claims, ``sub``), RFC 7515 (compact serialisation, §7.1), RFC 7518 §3.4
  (ES256: the signature is R || S, 32 bytes each, not DER), RFC 7515 §4.1.9 ``typ`` and §4.1.8
  ``x5t#S256`` (SHA-256 of the signing certificate's DER, naming the key).
- CMW: draft-ietf-rats-msg-wrap §3.1 (the Record CMW: ``[type, value, ? ind]``; in CBOR
  ``value`` is a byte string), §3.1.1 (``ind`` bit 3: Attestation Results), §4.3 (the X.509
  extension: ``CMW ::= CHOICE { json UTF8String, cbor OCTET STRING }``, its DER is the
  extnValue; "SHOULD NOT be marked critical") and §4.3.2 (the TCG ``ConceptualMessageWrapper``
  accepts a subset of that grammar).
- TCG DICE Attestation Architecture v1.1 §6.1.8: ``tcg-dice-conceptual-message-wrapper``,
  OID 2.23.133.5.4.9, an OCTET STRING holding a CBOR record, JSON record or CBOR tag CMW.

So the extension is OID 2.23.133.5.4.9 (as the issue asks; the IETF id-pe-cmw,
1.3.6.1.5.5.7.1.35, has the same syntax) and its extnValue is the DER of the ``cbor`` choice:
an OCTET STRING holding the CBOR record ``["application/eat+jwt; eat_profile=...", h'<JWT>',
8]``; this is byte for byte what both documents accept.

Why a JWT and not a COSE-signed CWT: the EAR draft implements both; the JSON form is what
EAR's reference verifiers (Veraison's ``arc``, c-ear) and policy engines (OPA's
``io.jwt.verify_es256``, the draft's Appendix B) read, and ``openssl asn1parse`` plus a base64
decoder shows it to an operator. It is signed (ES256) by the intermediate CA that signs the
leaf: a relying party that trusts the mesh root can check it with the chain it already holds,
and no second key needs distributing. The JWS header names that certificate (``x5t#S256``).

Binding: the EAR names the leaf's key (``akpub``, EAR §4.5) and its SPIFFE ID (``sub``), so an
EAR copied into another certificate does not verify for it.
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import cbor2
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from certs.errors import AttestmeshError
from certs.evidence.claims import Claims, Tee
from certs.evidence.composite import attached_gpus

# TCG DICE Attestation Architecture v1.1 §6.1.8: tcg-dice-conceptual-message-wrapper.
CMW_OID = x509.ObjectIdentifier("2.23.133.5.4.9")
EAR_PROFILE = "tag:github.com,2023:veraison/ear"  # draft-ietf-rats-ear §3
# RFC 9782 (EAT media types) with the profile parameter; draft-ietf-rats-ear §5.
EAR_MEDIA_TYPE = f'application/eat+jwt; eat_profile="{EAR_PROFILE}"'
CMW_IND_ATTESTATION_RESULTS = 1 << 3  # draft-ietf-rats-msg-wrap §3.1.1, cm-type bit 3
VERIFIER_DEVELOPER = "https://attestmesh.dev"
VERIFIER_BUILD = "attestmesh control plane 0.1.0"
CLAIM_PREFIX = "attestmesh.dev/"  # EAR §4.1: collision-resistant public claim names
MAX_TOKEN = 16 * 1024  # an EAR of ours is ~1 KiB; anything near this is not one
MAX_EXTENSION = MAX_TOKEN + 256


class Signer(Protocol):
    """The issuing intermediate (``certs.ca.Issuer``): its certificate and key."""

    @property
    def cert(self) -> x509.Certificate: ...

    @property
    def key(self) -> ec.EllipticCurvePrivateKey: ...


class EarError(AttestmeshError):
    """An EAR or its wrapper is malformed, badly signed, or not about this certificate.

    Reasons: ``cmw_missing``, ``cmw_malformed``, ``cmw_type_unsupported``, ``ear_malformed``,
    ``ear_alg_unsupported``, ``ear_signature_invalid``, ``ear_profile_mismatch``,
    ``ear_claims_invalid``, ``ear_key_mismatch``, ``ear_subject_mismatch``."""


class TrustTier(enum.StrEnum):
    """AR4SI trust tiers, JSON names (draft-ietf-rats-ear §3.2.2, §3.3)."""

    NONE = "none"
    AFFIRMING = "affirming"
    WARNING = "warning"
    CONTRAINDICATED = "contraindicated"


def tier_of(value: int) -> TrustTier:
    """The tier of one AR4SI trustworthiness claim (draft-ietf-rats-ar4si §2.3.3: -1..1 none,
    2..31 affirming, 32..95 warning, 96..127 contraindicated; the negative, implementation-
    specific values are read by their magnitude, the same tiers)."""
    magnitude = abs(value)
    if magnitude <= 1:
        return TrustTier.NONE
    if magnitude <= 31:
        return TrustTier.AFFIRMING
    if magnitude <= 95:
        return TrustTier.WARNING
    return TrustTier.CONTRAINDICATED


_TIER_RANK = {
    TrustTier.AFFIRMING: 0,
    TrustTier.NONE: 1,
    TrustTier.WARNING: 2,
    TrustTier.CONTRAINDICATED: 3,
}
# AR4SI values used below (draft-ietf-rats-ar4si §2.3.4)
APPROVED = 2  # executables: only approved executables loaded; hardware: genuine
UNSAFE = 32  # configuration/hardware: genuine, but with known weaknesses (debug, TCB not latest)


def trustworthiness(claims: Claims) -> dict[str, int]:
    """The AR4SI vector the control plane can vouch for after verify -> appraise:
    ``executables`` approved (the measurements passed policy); ``hardware`` genuine (the
    evidence verified to the vendor root), or a warning when the TCB status is not up to date;
    ``configuration`` a warning for a debug TEE. The simulated TEE has no hardware root: no
    ``hardware`` claim is made for it."""
    vector = {"executables": APPROVED}
    if claims.tee is not Tee.SIM:
        up_to_date = claims.tcb_status in (None, "UpToDate")
        vector["hardware"] = APPROVED if up_to_date else UNSAFE
    if claims.debug:
        vector["configuration"] = UNSAFE
    return vector


def status_of(claims: Claims, vector: Mapping[str, int]) -> TrustTier:
    """``ear.status``: no higher than the worst claim in the vector (EAR §3.2); the simulated
    TEE is never better than ``warning`` (nothing vouches for its hardware)."""
    worst = max((tier_of(v) for v in vector.values()), key=_TIER_RANK.__getitem__)
    if worst is TrustTier.NONE:
        worst = TrustTier.WARNING  # make no affirming claim on a vector of "no claim"s
    if claims.tee is Tee.SIM and _TIER_RANK[worst] < _TIER_RANK[TrustTier.WARNING]:
        return TrustTier.WARNING
    return worst


def build_ear(
    claims: Claims,
    *,
    policy: str,
    spiffe_id: str,
    subject_spki_der: bytes,
    nonce: bytes,
    now: datetime,
    verifier_build: str,
) -> dict[str, Any]:
    """The EAR claims-set (JSON serialisation, EAR §3.3) for one admitted attestation."""
    if not 8 <= len(nonce) <= 64:
        raise ValueError("eat_nonce must be 8 to 64 bytes (RFC 9711 §4.1)")
    vector = trustworthiness(claims)
    akpub = {"akpub": b64url(subject_spki_der)}
    gpus = attached_gpus(claims)
    own = {k: v for k, v in claims.measurements.items() if not (gpus and k.startswith("gpu"))}
    appraisal: dict[str, Any] = {
        "ear.status": status_of(claims, vector).value,
        "ear.trustworthiness-vector": vector,
        "ear.appraisal-policy-id": policy,
        "ear.veraison.key-attestation": akpub,
        CLAIM_PREFIX + "measurements": dict(sorted(own.items())),
        CLAIM_PREFIX + "evidence-sha256": claims.evidence_sha256,
    }
    if claims.tcb_status is not None:
        appraisal[CLAIM_PREFIX + "tcb-status"] = claims.tcb_status
    submods: dict[str, Any] = {claims.tee.value: appraisal}
    # A composite device (RFC 9711 §4.2.18, EAR §3): one submod per attached GPU, appraised by
    # the same policy, bound to the same key (its nonce derives from the CPU's binding).
    for gpu in gpus:
        gpu_vector = {"executables": APPROVED, "hardware": APPROVED}
        submods[f"{Tee.NVIDIA_GPU.value}.{gpu.index}"] = {
            "ear.status": TrustTier.AFFIRMING.value,
            "ear.trustworthiness-vector": gpu_vector,
            "ear.appraisal-policy-id": policy,
            "ear.veraison.key-attestation": akpub,
            CLAIM_PREFIX + "measurements": dict(sorted(gpu.measurements.items())),
            CLAIM_PREFIX + "evidence-sha256": str(gpu.details.get("evidence_sha256", "")),
        }
    return {
        "eat_profile": EAR_PROFILE,
        "iat": int(now.timestamp()),
        "sub": spiffe_id,
        "ear.verifier-id": {"developer": VERIFIER_DEVELOPER, "build": verifier_build},
        "eat_nonce": b64url(nonce),
        "submods": submods,
    }


# -- JWS (RFC 7515 compact, ES256 per RFC 7518 §3.4) ----------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str, what: str) -> bytes:
    if not text or any(c not in _B64URL for c in text) or len(text) % 4 == 1:
        raise EarError("ear_malformed", f"{what} is not base64url without padding")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise EarError("ear_malformed", f"{what} is not base64url") from None


_B64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _json_segment(doc: Mapping[str, Any]) -> str:
    return b64url(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


@functools.lru_cache(maxsize=16)
def _header_segment(signer: x509.Certificate) -> str:
    """The JWS header naming ``signer`` (the same for every EAR one intermediate signs)."""
    header = {
        "alg": "ES256",
        "typ": "JWT",
        "x5t#S256": b64url(signer.fingerprint(hashes.SHA256())),
    }
    return _json_segment(header)


def sign_ear(claims_set: Mapping[str, Any], key: ec.EllipticCurvePrivateKey,
             signer: x509.Certificate) -> str:  # fmt: skip
    """The compact JWS of ``claims_set``, ES256 with ``key`` (P-256); the header names
    ``signer`` (the certificate of ``key``) by ``x5t#S256``."""
    if key.curve.name != "secp256r1":
        raise ValueError("ES256 needs a P-256 key")
    signing_input = f"{_header_segment(signer)}.{_json_segment(claims_set)}"
    der = key.sign(signing_input.encode("ascii"), ec.ECDSA(hashes.SHA256()))
    r, s = decode_dss_signature(der)
    return f"{signing_input}.{b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


@dataclass(frozen=True, slots=True)
class Ear:
    """A verified EAR: its JWS header and claims-set."""

    header: Mapping[str, Any]
    claims: Mapping[str, Any]

    @property
    def submods(self) -> Mapping[str, Mapping[str, Any]]:
        return self.claims["submods"]  # type: ignore[no-any-return]

    @property
    def status(self) -> TrustTier:
        """The overall tier: the worst of the submods'."""
        tiers = [TrustTier(s["ear.status"]) for s in self.submods.values()]
        return max(tiers, key=_TIER_RANK.__getitem__)


def parse_jws(token: str) -> tuple[dict[str, Any], dict[str, Any], bytes, bytes]:
    """Split and decode a compact JWS: (header, claims, signing input, raw signature).
    Strict: three segments, base64url, JSON objects, ES256, no ``crit``."""
    if len(token) > MAX_TOKEN:
        raise EarError("ear_malformed", f"the EAR is {len(token)} bytes (at most {MAX_TOKEN})")
    parts = token.split(".")
    if len(parts) != 3:
        raise EarError("ear_malformed", f"a compact JWS has 3 segments, this has {len(parts)}")
    header = _json_object(_unb64url(parts[0], "the JWS header"), "the JWS header")
    claims = _json_object(_unb64url(parts[1], "the JWS payload"), "the JWS payload")
    signature = _unb64url(parts[2], "the JWS signature")
    if header.get("alg") != "ES256":
        raise EarError("ear_alg_unsupported", f"alg {header.get('alg')!r}: only ES256 is accepted")
    if "crit" in header:
        raise EarError("ear_alg_unsupported", "the JWS header has crit extensions")
    if len(signature) != 64:
        raise EarError("ear_malformed", f"an ES256 signature is 64 bytes, not {len(signature)}")
    return header, claims, f"{parts[0]}.{parts[1]}".encode("ascii"), signature


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise EarError("ear_malformed", f"{what} is not JSON") from None
    if not isinstance(doc, dict):
        raise EarError("ear_malformed", f"{what} is not a JSON object")
    return doc


def verify_ear(token: str, public_key: ec.EllipticCurvePublicKey) -> Ear:
    """Check the ES256 signature with ``public_key``, then the EAR claims-set's shape
    (EAR §3, §3.1, §3.2). Raises EarError with a precise reason."""
    header, claims, signing_input, signature = parse_jws(token)
    if public_key.curve.name != "secp256r1":
        raise EarError("ear_signature_invalid", "the signer's key is not P-256")
    der = encode_dss_signature(
        int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
    )
    try:
        public_key.verify(der, signing_input, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise EarError(
            "ear_signature_invalid", "the EAR's signature does not verify with the issuer's key"
        ) from None
    check_ear_claims(claims)
    return Ear(header, claims)


def check_ear_claims(claims: Mapping[str, Any]) -> None:
    """The EAR claims-set's mandatory members and their types (EAR §3, §3.1, §3.2)."""
    if claims.get("eat_profile") != EAR_PROFILE:
        raise EarError(
            "ear_profile_mismatch",
            f"eat_profile is {claims.get('eat_profile')!r}, not {EAR_PROFILE!r}",
        )
    iat = claims.get("iat")
    if not isinstance(iat, int) or isinstance(iat, bool):
        raise EarError("ear_claims_invalid", "iat must be an integer (RFC 9711 §4.3.1)")
    vid = claims.get("ear.verifier-id")
    if not (
        isinstance(vid, dict)
        and isinstance(vid.get("build"), str)
        and isinstance(vid.get("developer"), str)
    ):
        raise EarError("ear_claims_invalid", "ear.verifier-id needs build and developer")
    nonce = claims.get("eat_nonce")
    if nonce is not None and not (isinstance(nonce, str) and 12 <= len(nonce) <= 88):
        raise EarError("ear_claims_invalid", "eat_nonce must be base64url text of 12-88 chars")
    submods = claims.get("submods")
    if not isinstance(submods, dict) or not submods:
        raise EarError("ear_claims_invalid", "submods must hold at least one appraisal")
    tiers = {t.value for t in TrustTier}
    for label, appraisal in submods.items():
        if not isinstance(appraisal, dict) or appraisal.get("ear.status") not in tiers:
            raise EarError(
                "ear_claims_invalid", f"submod {label!r} has no valid ear.status ({sorted(tiers)})"
            )
        vector = appraisal.get("ear.trustworthiness-vector", {})
        if not isinstance(vector, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and -128 <= v <= 127
            for v in vector.values()
        ):
            raise EarError(
                "ear_claims_invalid", f"submod {label!r}: trustworthiness values are -128..127"
            )


# -- CMW record in the X.509 extension --


@dataclass(frozen=True, slots=True)
class Cmw:
    """A Record CMW (draft-ietf-rats-msg-wrap §3.1)."""

    type: str | int
    value: bytes
    ind: int | None = None


def encode_cmw_extension(token: str) -> bytes:
    """The extnValue: DER ``cbor OCTET STRING`` holding the CBOR record ``[media type,
    bytes(JWT), ind=Attestation Results]`` (draft-ietf-rats-msg-wrap §3.1, §4.3)."""
    record = _CMW_RECORD_HEAD + _cbor_head(2, len(token)) + token.encode("ascii") + _CMW_RECORD_TAIL
    return b"\x04" + _der_length(len(record)) + record


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head (RFC 8949 §3), shortest form (§4.2.1 deterministic encoding)."""
    if n < 24:
        return bytes((major << 5 | n,))
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes((major << 5 | info,)) + n.to_bytes(size, "big")
    raise ValueError("a CBOR length is at most 64 bits")


# The Record CMW is the array [media type (text), token (bytes), ind (unsigned)]: everything but
# the token's bytes is the same for every leaf (what ``cbor2.dumps`` writes, byte for byte).
_CMW_MEDIA = EAR_MEDIA_TYPE.encode()
_CMW_RECORD_HEAD = _cbor_head(4, 3) + _cbor_head(3, len(_CMW_MEDIA)) + _CMW_MEDIA
_CMW_RECORD_TAIL = _cbor_head(0, CMW_IND_ATTESTATION_RESULTS)


def decode_cmw_extension(value: bytes) -> Cmw:
    """The Record CMW in an extnValue, strictly: one DER OCTET STRING (the ``cbor`` choice)
    holding one canonical CBOR array of 2 or 3 members. A JSON record (``json UTF8String``) or
    a CBOR tag CMW is reported as not supported, not misread."""
    if len(value) > MAX_EXTENSION:
        raise EarError("cmw_malformed", f"the CMW extension is {len(value)} bytes")
    if not value:
        raise EarError("cmw_malformed", "the CMW extension is empty")
    if value[0] == 0x0C:
        raise EarError("cmw_type_unsupported", "a JSON CMW (UTF8String); expected the CBOR form")
    if value[0] != 0x04:
        raise EarError("cmw_malformed", f"expected a DER OCTET STRING, found tag {value[0]:#04x}")
    body = _der_octet_string(value)
    if body[:1] and 0xC0 <= body[0] <= 0xDB:
        raise EarError("cmw_type_unsupported", "a CBOR tag CMW; expected a CBOR record")
    try:
        record = cbor2.loads(body)
    except (cbor2.CBORDecodeError, ValueError, RecursionError, MemoryError):
        raise EarError("cmw_malformed", "the CMW is not CBOR") from None
    if not isinstance(record, list) or len(record) not in (2, 3):
        raise EarError("cmw_malformed", "a CMW record is an array of 2 or 3 members")
    if cbor2.dumps(record) != body:
        raise EarError("cmw_malformed", "trailing or non-canonical bytes in the CMW record")
    ctype, cvalue = record[0], record[1]
    ind = record[2] if len(record) == 3 else None
    if not isinstance(ctype, str | int) or isinstance(ctype, bool):
        raise EarError("cmw_malformed", "the CMW type is neither a media type nor a number")
    if not isinstance(cvalue, bytes):
        raise EarError("cmw_malformed", "the CMW value is not a byte string")
    if ind is not None and (not isinstance(ind, int) or isinstance(ind, bool) or ind <= 0):
        raise EarError("cmw_malformed", "the CMW ind must be a non-zero unsigned integer")
    return Cmw(ctype, cvalue, ind)


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


def _der_octet_string(value: bytes) -> bytes:
    if len(value) < 2:
        raise EarError("cmw_malformed", "truncated DER")
    first = value[1]
    if first < 0x80:
        length, start = first, 2
    else:
        count = first & 0x7F
        if count == 0 or count > 4 or len(value) < 2 + count:
            raise EarError("cmw_malformed", "bad DER length")
        length = int.from_bytes(value[2 : 2 + count], "big")
        start = 2 + count
        if length < 0x80 or value[2] == 0:
            raise EarError("cmw_malformed", "non-minimal DER length")
    if start + length != len(value):
        raise EarError("cmw_malformed", "the DER length does not match the extension's")
    return value[start:]


# -- reading a certificate --


def ear_token_of(cert: x509.Certificate) -> str:
    """The EAR JWT carried in ``cert``'s CMW extension (not verified)."""
    try:
        ext = cert.extensions.get_extension_for_oid(CMW_OID)
    except x509.ExtensionNotFound:
        raise EarError("cmw_missing", f"no CMW extension ({CMW_OID.dotted_string})") from None
    raw = ext.value
    if not isinstance(raw, x509.UnrecognizedExtension):
        raise EarError("cmw_malformed", "the CMW extension was decoded as something else")
    cmw = decode_cmw_extension(raw.value)
    if not isinstance(cmw.type, str) or cmw.type.split(";")[0].strip() != "application/eat+jwt":
        raise EarError("cmw_type_unsupported", f"CMW type {cmw.type!r}; expected {EAR_MEDIA_TYPE}")
    try:
        return cmw.value.decode("ascii")
    except UnicodeDecodeError:
        raise EarError("ear_malformed", "the JWT is not ASCII") from None


def verify_certificate_ear(
    cert: x509.Certificate, issuer: x509.Certificate, spiffe_id: str | None = None
) -> Ear:
    """The EAR in ``cert``, verified with ``issuer``'s key, and bound to ``cert``: every
    submod's attested key is ``cert``'s key and ``sub`` is ``spiffe_id`` (when given)."""
    key = issuer.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise EarError("ear_signature_invalid", "the issuer's key is not an EC key")
    ear = verify_ear(ear_token_of(cert), key)
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for label, appraisal in ear.submods.items():
        attested = appraisal.get("ear.veraison.key-attestation")
        akpub = attested.get("akpub") if isinstance(attested, dict) else None
        if akpub != b64url(spki):
            raise EarError(
                "ear_key_mismatch", f"submod {label!r} attests another key than this certificate's"
            )
    if spiffe_id is not None and ear.claims.get("sub") != spiffe_id:
        raise EarError(
            "ear_subject_mismatch", f"the EAR is about {ear.claims.get('sub')!r}, not {spiffe_id!r}"
        )
    return ear


def build_ear_extension(
    claims: Claims,
    *,
    policy: str,
    spiffe_id: str,
    subject_key: CertificatePublicKeyTypes,
    nonce: bytes,
    issuer: Signer,
    now: datetime,
) -> bytes:
    """The CMW extension value for a leaf: the EAR of this admitted attestation, signed by the
    issuing intermediate (the one that signs the leaf)."""
    spki = subject_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    claims_set = build_ear(
        claims, policy=policy, spiffe_id=spiffe_id, subject_spki_der=spki, nonce=nonce,
        now=now, verifier_build=VERIFIER_BUILD,
    )  # fmt: skip
    return encode_cmw_extension(sign_ear(claims_set, issuer.key, issuer.cert))
