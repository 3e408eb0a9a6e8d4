"""Intermediate rotation of the mesh CA: the pure predicates at their exact boundaries, the
prepare/activate/retire steps on disk, leaves of the old intermediate after the activation
(chain and CRL, verified by OpenSSL), restarts, and a crash after every file operation."""

from __future__ import annotations

import json
import shutil
import stat
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import crypto

import certs.ca.slots as slots_module
from certs.ca import (
    BACKDATE,
    INTERMEDIATE_LIFETIME,
    MIN_INTERMEDIATE_LIFETIME,
    NEXT_SLOT,
    PREVIOUS_RETENTION,
    PREVIOUS_SLOT,
    CertificateAuthority,
    Issuer,
    activation_time,
    encode_claims_extension,
    parse_csr,
    preparation_time,
    rotation_step,
)
from certs.ca.templates import build_leaf, ca_certificate
from certs.errors import AttestmeshError
from certs.policy import MAX_TTL
from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, claims, csr_pem, new_key

SPIFFE = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/web"
US = timedelta(microseconds=1)
# The first intermediate: notBefore NOW - 30 s, notAfter NOW + 365 d (lifetime 365 d 30 s).
PREPARE_AT = NOW + timedelta(days=182, hours=12) - timedelta(seconds=15)  # half of it
ACTIVATE_AT = NOW + timedelta(days=243, hours=8) - timedelta(seconds=10)  # two thirds
LEGACY_FILES = ["intermediate.key", "intermediate.pem", "root.key", "root.pem"]


def _leaf(issuer: Issuer, now: datetime, serial: int, ttl: timedelta = MAX_TTL) -> x509.Certificate:
    return build_leaf(
        parse_csr(csr_pem(new_key())),
        spiffe_id=SPIFFE,
        claims_extension=encode_claims_extension(claims(), "default/pol", now),
        issuer=issuer,
        serial=serial,
        now=now,
        ttl=ttl,
    )


def _crls(pem: bytes) -> list[x509.CertificateRevocationList]:
    end = b"-----END X509 CRL-----\n"
    return [x509.load_pem_x509_crl(part + end) for part in pem.split(end) if part.strip()]


def _openssl_verify(
    ca: CertificateAuthority,
    chain_pem: bytes,
    at: datetime,
    crls: list[x509.CertificateRevocationList] | None = None,
) -> None:
    """OpenSSL path validation from the root with the leaf's CRL required (CRL_CHECK checks
    the leaf only, as Envoy's only_verify_leaf_cert_crl does)."""
    leaf, *intermediates = x509.load_pem_x509_certificates(chain_pem)
    store = crypto.X509Store()
    store.add_cert(crypto.X509.from_cryptography(ca.root))
    for crl in _crls(ca.crl_pem([], at, timedelta(hours=24))) if crls is None else crls:
        store.add_crl(crl)
    store.set_flags(crypto.X509StoreFlags.CRL_CHECK)
    store.set_time(at)
    crypto.X509StoreContext(
        store,
        crypto.X509.from_cryptography(leaf),
        [crypto.X509.from_cryptography(c) for c in intermediates],
    ).verify_certificate()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly created CA directory; tests copy it rather than generate keys again."""
    directory = tmp_path_factory.mktemp("template") / "ca"
    CertificateAuthority.load_or_create(directory, TRUST_DOMAIN, NOW)
    return directory


@pytest.fixture
def ca_dir(template: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "ca"
    shutil.copytree(template, directory)
    return directory


@pytest.fixture
def ca(ca_dir: Path) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(ca_dir, TRUST_DOMAIN, NOW)


def _load(directory: Path, at: datetime = NOW) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(directory, TRUST_DOMAIN, at)


def _same_issuer(a: Issuer | None, b: Issuer | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.cert == b.cert and a.key.public_key() == b.key.public_key()


# ---------------------------------------------------------------------------------------------
# pure predicates


def test_thresholds_are_a_half_and_two_thirds_of_the_intermediates_lifetime(
    ca: CertificateAuthority,
) -> None:
    cert = ca.intermediate.cert
    assert (cert.not_valid_before_utc, cert.not_valid_after_utc) == (
        NOW - BACKDATE,
        NOW + INTERMEDIATE_LIFETIME,
    )
    assert preparation_time(cert) == PREPARE_AT
    assert activation_time(cert) == ACTIVATE_AT


def test_should_prepare_at_exactly_half_the_lifetime(ca: CertificateAuthority) -> None:
    assert not ca.should_prepare(NOW)
    assert not ca.should_prepare(PREPARE_AT - US)
    assert ca.should_prepare(PREPARE_AT)
    assert ca.should_prepare(NOW + timedelta(days=400))  # even long after: nothing prepared


def test_should_prepare_not_while_a_usable_intermediate_is_prepared(
    ca: CertificateAuthority,
) -> None:
    prepared = ca.prepare(PREPARE_AT)
    assert prepared.prepared is not None
    end = prepared.prepared.cert.not_valid_after_utc
    assert not prepared.should_prepare(PREPARE_AT)
    assert not prepared.should_prepare(end - US)
    assert prepared.should_prepare(end)  # the prepared one expired unused: prepare again


def test_should_prepare_not_when_the_root_is_about_to_expire(ca: CertificateAuthority) -> None:
    root_end = ca.root.not_valid_after_utc
    assert ca.should_prepare(root_end - MIN_INTERMEDIATE_LIFETIME)
    assert not ca.should_prepare(root_end - MIN_INTERMEDIATE_LIFETIME + US)


def test_should_activate_at_exactly_two_thirds_of_the_lifetime(ca: CertificateAuthority) -> None:
    assert not ca.should_activate(ACTIVATE_AT)  # nothing prepared
    prepared = ca.prepare(PREPARE_AT)
    assert not prepared.should_activate(PREPARE_AT)
    assert not prepared.should_activate(ACTIVATE_AT - US)
    assert prepared.should_activate(ACTIVATE_AT)


def test_should_activate_not_an_expired_or_not_yet_valid_prepared_intermediate(
    ca: CertificateAuthority,
) -> None:
    prepared = ca.prepare(PREPARE_AT)
    assert prepared.prepared is not None
    end = prepared.prepared.cert.not_valid_after_utc
    assert prepared.should_activate(end - US)
    assert not prepared.should_activate(end)
    early = ca.prepare(ACTIVATE_AT + timedelta(days=1))  # a clock that went backwards
    assert not early.should_activate(ACTIVATE_AT)


def test_should_retire_after_the_longest_leaf_lifetime_or_at_expiry(
    ca: CertificateAuthority,
) -> None:
    assert not ca.should_retire(NOW + timedelta(days=1000))  # no previous
    active = ca.prepare(PREPARE_AT).activate(ACTIVATE_AT)
    assert PREVIOUS_RETENTION == MAX_TTL + BACKDATE == timedelta(hours=24, seconds=30)
    assert not active.should_retire(ACTIVATE_AT + PREVIOUS_RETENTION - US)
    assert active.should_retire(ACTIVATE_AT + PREVIOUS_RETENTION)
    assert active.previous is not None
    expiry = active.previous.cert.not_valid_after_utc
    # Whatever the activation time, an expired previous intermediate goes.
    late = replace(active, activated_at=expiry)
    assert not late.should_retire(expiry - US)
    assert late.should_retire(expiry)


def test_predicates_are_pure(ca: CertificateAuthority, ca_dir: Path) -> None:
    before = sorted(p.name for p in ca_dir.iterdir())
    for at in (NOW, PREPARE_AT, ACTIVATE_AT, NOW + timedelta(days=900)):
        for predicate in (ca.should_prepare, ca.should_activate, ca.should_retire):
            predicate(at)
    assert sorted(p.name for p in ca_dir.iterdir()) == before == LEGACY_FILES


# ---------------------------------------------------------------------------------------------
# the steps on disk


def test_prepare_persists_the_next_intermediate_without_signing_with_it(
    ca: CertificateAuthority, ca_dir: Path
) -> None:
    key = new_key()
    prepared = ca.prepare(PREPARE_AT, key=key, serial=77)
    nxt = prepared.prepared
    assert nxt is not None
    assert prepared.intermediate == ca.intermediate  # still signing with the old one
    assert nxt.key is key and nxt.cert.serial_number == 77
    nxt.cert.verify_directly_issued_by(ca.root)
    assert nxt.cert.not_valid_before_utc == PREPARE_AT - BACKDATE
    assert nxt.cert.not_valid_after_utc == PREPARE_AT + INTERMEDIATE_LIFETIME
    # A name of its own, so that a CRL is matched to the right intermediate.
    assert nxt.cert.subject != ca.intermediate.cert.subject
    bc = nxt.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca and bc.path_length == 0
    nc = nxt.cert.extensions.get_extension_for_class(x509.NameConstraints).value
    assert nc.permitted_subtrees == [x509.UniformResourceIdentifier(TRUST_DOMAIN)]
    assert sorted(p.name for p in ca_dir.iterdir()) == sorted([*LEGACY_FILES, NEXT_SLOT])
    assert stat.S_IMODE((ca_dir / NEXT_SLOT).stat().st_mode) == 0o600
    # The legacy files still hold the signing pair.
    assert (ca_dir / "intermediate.pem").read_bytes() == ca.intermediate_pem
    # Its (empty) CRL joins the set now, ahead of the first leaf it signs.
    crls = _crls(prepared.crl_pem([], PREPARE_AT, timedelta(hours=1)))
    assert [c.issuer for c in crls] == [ca.intermediate.cert.subject, nxt.cert.subject]


def test_prepare_caps_the_next_intermediate_at_the_roots_expiry(ca: CertificateAuthority) -> None:
    root_end = ca.root.not_valid_after_utc
    at = root_end - timedelta(days=100)
    prepared = ca.prepare(at)
    assert prepared.prepared is not None
    assert prepared.prepared.cert.not_valid_after_utc == root_end


def test_prepare_then_activate_with_an_injected_clock(
    ca: CertificateAuthority, ca_dir: Path
) -> None:
    old = ca.intermediate
    steps = []
    current = ca
    for at in (NOW, PREPARE_AT - US, PREPARE_AT, ACTIVATE_AT - US, ACTIVATE_AT):
        nxt = rotation_step(current, at)
        steps.append(nxt is not None)
        current = nxt or current
    assert steps == [False, False, True, False, True]
    assert rotation_step(current, ACTIVATE_AT) is None  # nothing else is due
    assert current.previous == old and current.prepared is None
    assert current.activated_at == ACTIVATE_AT
    new = current.intermediate
    assert new.cert != old.cert
    assert current.root == ca.root and current.bundle_pem == ca.bundle_pem  # no trust split
    assert sorted(p.name for p in ca_dir.iterdir()) == sorted([*LEGACY_FILES, PREVIOUS_SLOT])
    assert stat.S_IMODE((ca_dir / PREVIOUS_SLOT).stat().st_mode) == 0o600
    assert (ca_dir / "intermediate.pem").read_bytes() == current.intermediate_pem
    slot = json.loads((ca_dir / PREVIOUS_SLOT).read_text())
    assert slot["activated_at"] == ACTIVATE_AT.isoformat()
    # Leaves from now on chain to the new intermediate.
    leaf = _leaf(current.intermediate, ACTIVATE_AT, 5)
    assert x509.load_pem_x509_certificates(current.chain_pem(leaf)) == [leaf, new.cert]
    _openssl_verify(current, current.chain_pem(leaf), ACTIVATE_AT + timedelta(minutes=1))
    # Retired once every leaf of the old one has expired.
    retire_at = ACTIVATE_AT + PREVIOUS_RETENTION
    assert rotation_step(current, retire_at - US) is None
    retired = rotation_step(current, retire_at)
    assert retired is not None and retired.previous is None and retired.activated_at is None
    assert sorted(p.name for p in ca_dir.iterdir()) == LEGACY_FILES
    assert len(_crls(retired.crl_pem([], retire_at, timedelta(hours=1)))) == 1
    reloaded = _load(ca_dir, retire_at)
    assert reloaded.intermediate.cert == new.cert and reloaded.previous is None


def test_leaves_of_the_old_intermediate_still_verify_after_the_activation(
    ca: CertificateAuthority,
) -> None:
    prepared = ca.prepare(PREPARE_AT)
    before = ACTIVATE_AT - timedelta(minutes=1)
    old_leaf = _leaf(prepared.intermediate, before, 1001)
    revoked_leaf = _leaf(prepared.intermediate, before, 1002)
    old_chain = prepared.chain_pem(old_leaf)
    active = prepared.activate(ACTIVATE_AT)
    new_leaf = _leaf(active.intermediate, ACTIVATE_AT, 2001)
    assert old_leaf.issuer != new_leaf.issuer  # two intermediates ...
    for leaf in (old_leaf, new_leaf):  # ... under one root
        active.issuer_of(leaf).cert.verify_directly_issued_by(active.root)
    # The chain handed out for a leaf is its signer's, whichever slot that is now.
    assert active.chain_pem(old_leaf) == old_chain
    assert x509.load_pem_x509_certificates(active.chain_pem(new_leaf))[1] == (
        active.intermediate.cert
    )
    at = ACTIVATE_AT + timedelta(hours=12)
    revocations = [(1002, ACTIVATE_AT + timedelta(hours=1))]
    crls = _crls(active.crl_pem(revocations, at, timedelta(hours=24)))
    assert [c.issuer for c in crls] == [
        active.intermediate.cert.subject,
        ca.intermediate.cert.subject,
    ]
    for crl, issuer in zip(crls, active.issuers, strict=True):
        assert crl.is_signature_valid(issuer.cert.public_key())  # type: ignore[arg-type]
        aki = crl.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        ski = issuer.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        assert aki.key_identifier == ski.digest
    # The revoked leaf of the old intermediate is in its CRL.
    assert crls[1].get_revoked_certificate_by_serial_number(1002) is not None
    _openssl_verify(active, active.chain_pem(old_leaf), at, crls)
    _openssl_verify(active, active.chain_pem(new_leaf), at, crls)
    with pytest.raises(crypto.X509StoreContextError, match="certificate revoked"):
        _openssl_verify(active, active.chain_pem(revoked_leaf), at, crls)
    # Without the previous intermediate's CRL, its leaves would fail: why it is kept.
    with pytest.raises(crypto.X509StoreContextError, match="unable to get certificate CRL"):
        _openssl_verify(active, active.chain_pem(old_leaf), at, crls[:1])


def test_a_restart_between_prepare_and_activate_keeps_the_prepared_intermediate(
    ca: CertificateAuthority, ca_dir: Path
) -> None:
    prepared = ca.prepare(PREPARE_AT)
    reloaded = _load(ca_dir, PREPARE_AT + timedelta(days=1))
    assert _same_issuer(reloaded.prepared, prepared.prepared)
    assert _same_issuer(reloaded.intermediate, ca.intermediate)
    assert reloaded.previous is None
    assert not reloaded.should_prepare(PREPARE_AT + timedelta(days=1))
    active = reloaded.activate(ACTIVATE_AT)
    assert _same_issuer(active.intermediate, prepared.prepared)
    again = _load(ca_dir, ACTIVATE_AT)
    assert _same_issuer(again.intermediate, prepared.prepared)
    assert _same_issuer(again.previous, ca.intermediate)
    assert again.activated_at == ACTIVATE_AT and again.prepared is None


def test_activate_without_a_prepared_intermediate_is_refused(ca: CertificateAuthority) -> None:
    with pytest.raises(AttestmeshError) as info:
        ca.activate(ACTIVATE_AT)
    assert info.value.reason == "ca_nothing_prepared"


def test_a_ca_without_a_directory_cannot_rotate(ca: CertificateAuthority) -> None:
    with pytest.raises(AttestmeshError) as info:
        replace(ca, directory=None).prepare(PREPARE_AT)
    assert info.value.reason == "ca_not_persisted"


def test_leftover_temporary_files_are_ignored(ca: CertificateAuthority, ca_dir: Path) -> None:
    for name in ("intermediate.tmp", "intermediate-next.tmp", "intermediate-previous.tmp"):
        (ca_dir / name).write_bytes(b"half written")
    reloaded = _load(ca_dir)
    assert _same_issuer(reloaded.intermediate, ca.intermediate)
    assert reloaded.prepared is None and reloaded.previous is None


def _foreign_slot(ca_dir: Path, tmp: Path, kind: str) -> bytes:
    """A well-formed slot whose intermediate another root signed, or this root for another
    trust domain."""
    if kind == "other-root":
        other = CertificateAuthority.load_or_create(tmp / "other", TRUST_DOMAIN, NOW)
        other.prepare(PREPARE_AT)
        return (tmp / "other" / NEXT_SLOT).read_bytes()
    root = x509.load_pem_x509_certificate((ca_dir / "root.pem").read_bytes())
    root_key = serialization.load_pem_private_key((ca_dir / "root.key").read_bytes(), None)
    assert isinstance(root_key, ec.EllipticCurvePrivateKey)
    key = new_key()
    cert = ca_certificate(
        "attestmesh intermediate other",
        key,
        Issuer(root, root_key),
        NOW,
        INTERMEDIATE_LIFETIME,
        1,
        "other.example",
        0,
        "other",
    )
    return slots_module.slot_json(Issuer(cert, key), None)


@pytest.mark.parametrize("slot", [NEXT_SLOT, PREVIOUS_SLOT])
@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "ca_inconsistent"),
        (b"[]", "ca_inconsistent"),
        (b'{"certificate": "x", "key": "y"}', "ca_inconsistent"),
        (b"{" + b" " * 70000 + b"}", "ca_inconsistent"),
        ("other-root", "ca_inconsistent"),
        ("other-domain", "ca_trust_domain_mismatch"),
    ],
    ids=["empty", "not-object", "not-pem", "too-large", "other-root", "other-domain"],
)
def test_a_damaged_or_foreign_slot_is_refused(
    ca_dir: Path, tmp_path: Path, slot: str, content: bytes | str, reason: str
) -> None:
    if content in ("other-root", "other-domain"):
        content = _foreign_slot(ca_dir, tmp_path, str(content))
    assert isinstance(content, bytes)
    if slot == PREVIOUS_SLOT and content.startswith(b"{") and b"certificate" in content:
        doc = json.loads(content)
        doc["activated_at"] = ACTIVATE_AT.isoformat()
        content = json.dumps(doc).encode()
    (ca_dir / slot).write_bytes(content)
    with pytest.raises(AttestmeshError) as info:
        _load(ca_dir)
    assert info.value.reason == reason


def test_a_previous_slot_without_its_activation_time_is_refused(
    ca: CertificateAuthority, ca_dir: Path
) -> None:
    ca.prepare(PREPARE_AT).activate(ACTIVATE_AT)
    doc = json.loads((ca_dir / PREVIOUS_SLOT).read_text())
    del doc["activated_at"]
    (ca_dir / PREVIOUS_SLOT).write_text(json.dumps(doc))
    with pytest.raises(AttestmeshError) as info:
        _load(ca_dir)
    assert info.value.reason == "ca_inconsistent"


def test_a_key_swap_is_still_refused_while_an_intermediate_is_prepared(
    ca: CertificateAuthority, ca_dir: Path
) -> None:
    """Recovery finishes an activation only on evidence of one (the prepared slot's key or
    certificate in the signing files, or the signing certificate in the previous slot)."""
    ca.prepare(PREPARE_AT)
    (ca_dir / "intermediate.key").write_bytes((ca_dir / "root.key").read_bytes())
    with pytest.raises(AttestmeshError) as info:
        _load(ca_dir)
    assert info.value.reason == "ca_inconsistent"


# ---------------------------------------------------------------------------------------------
# crash after every file operation


class Crash(Exception):
    """The process died here."""


class FileOps:
    """Counts the CA's file operations (renames and removals) and dies at operation ``crash_at``
    (that operation does not happen; every one before it did)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.crash_at: int | None = None
        commit, remove = slots_module.commit, slots_module.remove

        def counted_commit(tmp: Path, path: Path) -> None:
            self._step()
            commit(tmp, path)

        def counted_remove(path: Path) -> None:
            self._step()
            remove(path)

        monkeypatch.setattr(slots_module, "commit", counted_commit)
        monkeypatch.setattr(slots_module, "remove", counted_remove)

    def _step(self) -> None:
        if self.count == self.crash_at:
            raise Crash(f"crash at file operation {self.count}")
        self.count += 1

    def arm(self, crash_at: int | None) -> None:
        self.count, self.crash_at = 0, crash_at


RETIRE_AT = ACTIVATE_AT + PREVIOUS_RETENTION
NEW_KEY = ec.generate_private_key(ec.SECP256R1())


def _full_rotation(ca: CertificateAuthority) -> CertificateAuthority:
    ca = ca.prepare(PREPARE_AT, key=NEW_KEY)
    ca = ca.activate(ACTIVATE_AT)
    return ca.retire()


def _tick(ca: CertificateAuthority, now: datetime) -> CertificateAuthority:
    for _ in range(3):
        nxt = rotation_step(ca, now)
        if nxt is None:
            break
        ca = nxt
    return ca


def _assert_consistent(ca: CertificateAuthority, old: Issuer, retire_done: bool) -> str:
    """Signs with the old or the new intermediate, with the matching key; keeps whatever a
    leaf may still need. Returns which one signs."""
    signer = ca.intermediate
    assert signer.key.public_key() == signer.cert.public_key()
    assert signer.cert.public_key() in (old.cert.public_key(), NEW_KEY.public_key())
    leaf = _leaf(signer, ACTIVATE_AT, 9)
    _openssl_verify(ca, ca.chain_pem(leaf), ACTIVATE_AT + timedelta(minutes=1))
    if signer.cert.public_key() == NEW_KEY.public_key():
        assert ca.prepared is None
        if not retire_done:  # the old intermediate's leaves may be alive: it stays
            assert _same_issuer(ca.previous, old)
            assert ca.activated_at == ACTIVATE_AT
        return "new"
    assert _same_issuer(signer, old)
    assert ca.previous is None
    if ca.prepared is not None:  # the prepared one, whole, or nothing
        assert ca.prepared.key.public_key() == NEW_KEY.public_key()
        assert ca.prepared.cert.public_key() == NEW_KEY.public_key()
    return "old"


def _crash_points(ca_dir: Path, ops: FileOps) -> Iterator[tuple[int, Path]]:
    """For each file operation of a full rotation, a copy of the CA directory where the
    rotation died at that operation."""
    probe = ca_dir.parent / "probe"
    shutil.copytree(ca_dir, probe)
    ops.arm(None)
    _full_rotation(_load(probe))
    total = ops.count
    assert total == 6  # next; previous, key, certificate, -next; -previous
    for k in range(total):
        directory = ca_dir.parent / f"crash-{k}"
        shutil.copytree(ca_dir, directory)
        ops.arm(k)
        with pytest.raises(Crash):
            _full_rotation(_load(directory))
        ops.arm(None)
        yield k, directory


def test_a_crash_after_any_file_operation_leaves_a_consistent_ca(
    ca: CertificateAuthority, ca_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    for k, directory in _crash_points(ca_dir, FileOps(monkeypatch)):
        reloaded = _load(directory, RETIRE_AT)
        signer = _assert_consistent(reloaded, ca.intermediate, retire_done=False)
        seen.append((k, signer))
        # Loading twice changes nothing more: recovery is complete and idempotent.
        again = _load(directory, RETIRE_AT)
        assert _same_issuer(again.intermediate, reloaded.intermediate)
        assert _same_issuer(again.previous, reloaded.previous)
        assert _same_issuer(again.prepared, reloaded.prepared)
        # The ticker then finishes the rotation.
        done = _tick(_tick(reloaded, ACTIVATE_AT), RETIRE_AT)
        assert done.intermediate.cert.public_key() == NEW_KEY.public_key() or k == 0
        final = _load(directory, RETIRE_AT)
        assert _same_issuer(final.intermediate, done.intermediate)
        assert final.previous is None and final.prepared is None
        assert sorted(p.name for p in directory.iterdir() if p.suffix != ".tmp") == LEGACY_FILES
    # Before the first activation write: old; once it is written, the activation finishes.
    assert seen == [(0, "old"), (1, "old"), (2, "new"), (3, "new"), (4, "new"), (5, "new")]


def test_a_crash_during_recovery_is_recovered_too(
    ca: CertificateAuthority, ca_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = FileOps(monkeypatch)
    crashed_during_recovery = 0
    for _k, directory in _crash_points(ca_dir, ops):
        for j in range(3):
            copy = directory.parent / f"{directory.name}-recovery-{j}"
            shutil.copytree(directory, copy)
            ops.arm(j)
            try:
                _load(copy, RETIRE_AT)
            except Crash:
                crashed_during_recovery += 1
            ops.arm(None)
            _assert_consistent(_load(copy, RETIRE_AT), ca.intermediate, retire_done=False)
    assert crashed_during_recovery > 0  # some states did need repair writes
