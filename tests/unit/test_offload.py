"""certs.offload and what a job carries between processes: errors pickle as themselves, the
CA's signing intermediate as bytes, a job run as a worker runs it equals the call on a thread."""

from __future__ import annotations

import pickle
from dataclasses import replace
from datetime import UTC, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs import offload
from certs.binding import expected_report_data
from certs.ca import CertificateAuthority, SigningMaterial
from certs.csr import CsrError
from certs.errors import AttestmeshError, EvidenceFormatError, PolicyError
from certs.evidence.claims import Tee
from certs.evidence.sim import SimVerifier, build_report
from certs.issuance import AttestRequest, EvidenceRejected
from certs.keystore import KeyStoreError, Pkcs11PrivateKey
from certs.nonces import NonceError
from certs.policy import parse_policies
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    OTHER_MEASUREMENT,
    TRUST_DOMAIN,
    csr_pem,
    new_key,
    policy_doc,
    spki,
)

PLATFORM = ec.generate_private_key(ec.SECP256R1())
PLATFORM_PEM = PLATFORM.public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
)
POLICIES = tuple(parse_policies([policy_doc()]))
SPIFFE = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/web"
NONCE = bytes(range(32))


def _across(value: Any) -> Any:
    """``value`` as another process gets it."""
    return pickle.loads(pickle.dumps(value))  # noqa: S301


def sim_request(
    measurement: bytes = MEASUREMENT, key: Any = None, nonce: bytes = NONCE
) -> AttestRequest:
    """web-1's request with sim evidence of ``PLATFORM`` binding ``nonce`` and ``key``."""
    key = key or new_key()
    evidence = build_report(
        PLATFORM, report_data=expected_report_data(nonce, spki(key)), measurement=measurement
    )
    return AttestRequest("web-1", "sim", evidence, csr_pem(key), nonce)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(
        tmp_path_factory.mktemp("ca") / "ca", TRUST_DOMAIN, NOW - timedelta(days=1)
    )


@pytest.mark.parametrize(
    "exc",
    [
        AttestmeshError("nonce_expired", "too late"),
        EvidenceRejected(
            "measurement_mismatch", "no match", "sim", ("a: b", "c: d"), appraisal=True
        ),
        EvidenceRejected("signature_invalid", "bad", "sim"),
        PolicyError(["one problem", "another"]),
        CsrError("csr_malformed", "not PEM"),
        NonceError("nonce_unknown", "forged"),
        EvidenceFormatError("truncated", "3 bytes"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_as_themselves(exc: AttestmeshError) -> None:
    """Exception's own pickling calls cls(*args): EvidenceRejected could not be rebuilt at all
    and the rest came back with the whole message as their reason."""
    back = _across(exc)
    assert type(back) is type(exc)
    assert back.args == exc.args and str(back) == str(exc)
    assert back.__dict__ == exc.__dict__
    assert back.reason == exc.reason and back.detail == exc.detail


def test_signing_material_signs_as_the_ca(ca: CertificateAuthority) -> None:
    material = ca.signing_material()
    assert material is not None
    assert repr(material) == f"SigningMaterial({material.ident.hex()[:16]})"  # no key in logs
    copy = CertificateAuthority.signing_only(_across(material))
    assert copy.intermediate.cert == ca.intermediate.cert and copy.root == ca.root
    assert copy.bundle_pem == ca.bundle_pem and copy.intermediate.pem == ca.intermediate.pem
    data = b"to be signed"
    sig = copy.intermediate.key.sign(data, ec.ECDSA(hashes.SHA256()))
    public = ca.intermediate.cert.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    public.verify(sig, data, ec.ECDSA(hashes.SHA256()))


def test_signing_material_of_a_mismatched_key_is_refused(ca: CertificateAuthority) -> None:
    material = ca.signing_material()
    assert material is not None
    other = new_key().private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    forged = SigningMaterial(
        material.ident, material.root_der, material.cert_der, other, material.trust_domain
    )
    with pytest.raises(AttestmeshError, match="key and certificate differ"):
        CertificateAuthority.signing_only(forged)


def test_a_key_that_cannot_be_written_out_of_a_file_store_yields_none(
    ca: CertificateAuthority,
) -> None:
    """A token's key held by a CA whose store is not that token (a mismatch): no material, it
    signs in the control plane's process (a token's own store yields its reference: the
    PKCS#11 test in tests/component/test_worker_processes.py)."""
    token_key = Pkcs11PrivateKey.__new__(Pkcs11PrivateKey)
    with pytest.raises(KeyStoreError):
        token_key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    in_token = CertificateAuthority(
        root=ca.root,
        intermediate=type(ca.intermediate).__new__(type(ca.intermediate)),
        trust_domain=ca.trust_domain,
    )
    object.__setattr__(in_token.intermediate, "cert", ca.intermediate.cert)
    object.__setattr__(in_token.intermediate, "key", token_key)
    assert in_token.signing_material() is None


def test_a_job_run_as_a_worker_runs_it_equals_the_call_on_a_thread(
    ca: CertificateAuthority,
) -> None:
    offload.init_worker(
        offload.VerifierRecipe(offload.configured_verifiers, (None, (PLATFORM_PEM,)))
    )
    material = ca.signing_material()
    assert material is not None
    key = new_key()
    req = sim_request(key=key)
    job = offload.Job(req, POLICIES, material, SPIFFE, 0x1234, NOW)
    across = offload.JobDecoder().decode(offload.JobEncoder().encode(job))
    assert across == job and across.now.tzinfo is UTC  # (crossed as naive UTC)
    with pytest.raises(ValueError, match="naive"):  # a time of unknown zone never crosses
        offload.JobEncoder().encode(replace(job, now=NOW.replace(tzinfo=None)))
    answer = offload.decode_answer(offload.encode_answer(*offload.run_job(across)))
    assert not isinstance(answer, BaseException)
    admitted, leaf = answer
    assert admitted.at.tzinfo is UTC and leaf.not_after.tzinfo is UTC
    here_admitted, here_leaf = offload.verify_and_sign(
        req, {Tee.SIM: SimVerifier([PLATFORM.public_key()])}, POLICIES, ca, SPIFFE, 0x1234, NOW
    )
    assert admitted == here_admitted
    assert isinstance(admitted.claims.measurements, MappingProxyType)  # read-only again
    cert = x509.load_der_x509_certificate(leaf.der)
    cert.verify_directly_issued_by(ca.intermediate.cert)
    assert cert.public_key() == key.public_key() and leaf.serial == 0x1234 == cert.serial_number
    assert leaf.chain_pem.endswith(ca.intermediate.pem)
    assert (leaf.not_after, leaf.serial) == (here_leaf.not_after, here_leaf.serial)
    # the worker keeps what it parsed, by the intermediate's identity
    assert list(offload._cas) == [material.ident]


def test_a_refusal_in_a_job_is_raised_as_on_a_thread(ca: CertificateAuthority) -> None:
    offload.init_worker(
        offload.VerifierRecipe(offload.configured_verifiers, (None, (PLATFORM_PEM,)))
    )
    material = ca.signing_material()
    assert material is not None
    job = offload.Job(sim_request(OTHER_MEASUREMENT), POLICIES, material, SPIFFE, 1, NOW)
    with pytest.raises(EvidenceRejected) as info:
        offload.run_job(job)
    back = _across(info.value)
    assert back.appraisal and back.reason == info.value.reason and back.tee == "sim"


def test_without_sim_keys_sim_evidence_is_refused(ca: CertificateAuthority) -> None:
    """The recipe builds what the control plane has: no sim verifier unless keys are given."""
    offload.init_worker(offload.VerifierRecipe(offload.configured_verifiers, (None, ())))
    material = ca.signing_material()
    assert material is not None
    with pytest.raises(EvidenceRejected) as info:
        offload.run_job(offload.Job(sim_request(), POLICIES, material, SPIFFE, 1, NOW))
    assert info.value.reason == "tee_not_supported"


class _Pipe:
    """A worker's connection, in memory: jobs in, answers out."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames, self.sent = list(frames), list[bytes]()

    def recv_bytes(self) -> bytes:
        if not self.frames:
            raise EOFError
        return self.frames.pop(0)

    def send_bytes(self, buf: bytes) -> None:
        self.sent.append(buf)


def test_serve_answers_each_job_in_order_and_ends_with_its_pipe(
    ca: CertificateAuthority,
) -> None:
    material = ca.signing_material()
    assert material is not None
    good = offload.Job(sim_request(), POLICIES, material, SPIFFE, 7, NOW)
    bad = offload.Job(sim_request(OTHER_MEASUREMENT), POLICIES, material, SPIFFE, 8, NOW)
    jobs = offload.JobEncoder()
    pipe = _Pipe([jobs.encode(good), jobs.encode(bad), b"not a pickle", jobs.encode(good)])
    offload.serve(
        pipe, offload.VerifierRecipe(offload.configured_verifiers, (None, (PLATFORM_PEM,)))
    )
    assert pipe.sent[0] == offload.READY
    first, refused, garbage, again = (offload.decode_answer(b) for b in pipe.sent[1:])
    assert not isinstance(first, BaseException) and first[1].serial == 7
    assert isinstance(refused, EvidenceRejected) and refused.appraisal
    assert isinstance(garbage, pickle.UnpicklingError)
    assert not isinstance(again, BaseException) and again[1].serial == 7


def test_a_worker_is_sent_each_policy_and_intermediate_once(ca: CertificateAuthority) -> None:
    material = ca.signing_material()
    assert material is not None
    other = tuple(parse_policies([policy_doc(name="other")]))
    jobs, worker = offload.JobEncoder(), offload.JobDecoder()
    first = offload.Job(sim_request(), POLICIES, material, SPIFFE, 1, NOW)
    second = offload.Job(sim_request(), POLICIES + other, material, SPIFFE, 2, NOW)
    frames = [jobs.encode(first), jobs.encode(first), jobs.encode(second)]
    assert [len(pickle.loads(f)[1]) for f in frames] == [2, 0, 1]  # noqa: S301 (new values)
    assert len(frames[1]) < len(frames[0]) / 2  # the request and a few numbers
    assert [worker.decode(f) for f in frames] == [first, first, second]
    # a worker that was not sent them (a new one, say) refuses the job, never guesses
    with pytest.raises(RuntimeError, match="not sent"):
        offload.JobDecoder().decode(frames[1])


def test_past_its_limit_the_table_starts_over_on_both_sides(ca: CertificateAuthority) -> None:
    material = ca.signing_material()
    assert material is not None
    policies = [tuple(parse_policies([policy_doc(name=f"p{i}")])) for i in range(5)]
    jobs, worker = offload.JobEncoder(reset_after=4), offload.JobDecoder()
    for round_ in range(3):
        for i, governing in enumerate(policies):
            job = offload.Job(sim_request(), governing, material, SPIFFE, i, NOW)
            assert worker.decode(jobs.encode(job)) == job, (round_, i)
    assert len(jobs._numbers) <= 4 and len(worker._held) <= 4


def test_a_job_that_cannot_be_encoded_leaves_the_table_as_the_worker_has_it(
    ca: CertificateAuthority,
) -> None:
    material = ca.signing_material()
    assert material is not None
    jobs, worker = offload.JobEncoder(reset_after=2), offload.JobDecoder()
    good = offload.Job(sim_request(), POLICIES, material, SPIFFE, 1, NOW)
    unpicklable = replace(sim_request(), collateral=MappingProxyType({"x": lambda: None}))
    for _ in range(3):  # (with reset_after=2 every frame starts the table over)
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            jobs.encode(replace(good, req=unpicklable))
        assert worker.decode(jobs.encode(good)) == good  # what it names was sent after all
    other = offload.JobEncoder()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        other.encode(replace(good, req=unpicklable))
    assert offload.JobDecoder().decode(other.encode(good)) == good


def test_an_answer_crosses_with_every_claim_and_read_only_mappings(
    ca: CertificateAuthority,
) -> None:
    admitted, leaf = offload.verify_and_sign(
        sim_request(), {Tee.SIM: SimVerifier([PLATFORM.public_key()])}, POLICIES, ca, SPIFFE, 9,
        NOW,
    )  # fmt: skip
    full = replace(
        admitted.claims,
        signer="ab" * 32, product_id=3, svn=4, platform_id="p", tcb=MappingProxyType({"snp": 7}),
        tcb_status="UpToDate", advisories=("INTEL-SA-1",),
        details=MappingProxyType({"policy_debug": False, "version": 2, "name": "x"}),
    )  # fmt: skip
    answer = offload.decode_answer(offload.encode_answer(replace(admitted, claims=full), leaf))
    assert answer == (replace(admitted, claims=full), leaf)
    assert not isinstance(answer, BaseException)
    claims = answer[0].claims
    assert claims.tee is Tee.SIM
    for name in ("measurements", "tcb", "details"):  # every mapping field, read-only again
        assert isinstance(getattr(claims, name), MappingProxyType), name
    assert {offload._CLAIMS[i] for i in offload._MAPPINGS} == {"measurements", "tcb", "details"}


@pytest.mark.parametrize(
    ("cpu_max", "affinity", "cores"),
    [
        ("max 100000\n", 8, 8.0),  # no quota: the cores it may run on
        ("200000 100000\n", 8, 2.0),  # a container's limit of 2 cores on an 8-core node
        ("150000 100000\n", 8, 1.5),
        ("50000 100000\n", 8, 1.0),  # below one core: one
        ("800000 100000\n", 2, 2.0),  # a quota above the affinity: the affinity
        (None, 3, 3.0),  # no cgroup v2 file
        ("garbage", 3, 3.0),
    ],
)
def test_available_cpus_follow_the_cgroup_quota_and_affinity(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpu_max: str | None,
    affinity: int,
    cores: float,
) -> None:
    from attestmesh import serve

    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max)
    assert serve.available_cpus(tmp_path) == cores


def test_worker_processes_leave_the_loop_a_core() -> None:
    from attestmesh.serve import default_attest_processes

    assert [default_attest_processes(c) for c in (1, 1.5, 2, 3, 5, 64)] == [0, 0, 1, 2, 4, 4]


def test_the_attest_processes_flag() -> None:
    from attestmesh.cli import build_parser

    args = ["controlplane", "--state-dir", "/tmp/x", "--policy", "p.yaml"]
    assert build_parser().parse_args(args).attest_processes is None  # the default: by cores
    parsed = build_parser().parse_args([*args, "--attest-processes", "0"])
    assert parsed.attest_processes == 0
