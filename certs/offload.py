"""An attestation's CPU-bound step as a job for a worker process: verify the evidence and the
CSR's key binding, appraise, sign the leaf (``verify_and_sign``, the one function the control
plane runs on a thread or sends here).

A job carries plain values: the request, the governing policies, the CA's signing intermediate
as bytes (``SigningMaterial``; a worker parses each one once, by its identity), the serial
number and the time, both chosen by the caller. A worker builds its verifiers once, from a
``VerifierRecipe`` (a module-level function and its arguments): what it returns is the
appraisal's ``Admitted`` and the signed ``Leaf``, or the refusal it raised (``certs.errors``
pickles as itself).

On the pipe (``JobEncoder`` / ``JobDecoder``, ``encode_answer`` / ``decode_answer``) a job and
its answer are tuples of builtins, not pickled dataclasses and enums (which pickle field by
field through Python code: encoding and decoding them cost the control plane's event loop about
a sixth of an attestation), and a worker is sent each policy and signing intermediate once: later
jobs name them by number.
"""

from __future__ import annotations

import operator
import pickle
import signal
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, TypeGuard

from certs.ca import CertificateAuthority, Leaf, SigningMaterial, issue
from certs.collateral.roots import load_roots
from certs.evidence.claims import Claims, Tee, Verifier
from certs.evidence.composite import attach_gpus
from certs.evidence.registry import build_verifiers
from certs.evidence.sim import load_platform_public_key
from certs.issuance import AttestRequest, decide, verify_request
from certs.keystore import KeyStore, open_key_store
from certs.policy import Admitted, AttestationPolicy


def verify_and_sign(
    req: AttestRequest,
    verifiers: Mapping[Tee, Verifier],
    governing: Sequence[AttestationPolicy],
    ca: CertificateAuthority,
    spiffe_id: str,
    serial: int,
    now: datetime,
) -> tuple[Admitted, Leaf]:
    """verify -> bind -> appraise, and only the ``Admission`` that comes out reaches the CA.
    Raises ``CsrError`` or ``EvidenceRejected``."""
    admission = decide(verify_request(req, verifiers, now), governing, now)
    return admission.admitted, issue(admission, ca, spiffe_id=spiffe_id, serial=serial, now=now)


def configured_verifiers(
    roots_dir: Path | None, sim_key_pems: tuple[bytes, ...]
) -> dict[Tee, Verifier]:
    """The control plane's verifiers: every TEE anchored at the roots in ``roots_dir`` (the
    bundled ones where absent), sim only with platform keys, GPUs attachable to SEV-SNP and
    TDX evidence."""
    sim_keys = [load_platform_public_key(pem) for pem in sim_key_pems]
    return attach_gpus(build_verifiers(load_roots(roots_dir), sim_keys=sim_keys or None))


@dataclass(frozen=True, slots=True)
class VerifierRecipe:
    """How a worker process builds its verifiers: ``build(*args)``; ``build`` is a module-level
    function (pickled by name)."""

    build: Callable[..., Mapping[Tee, Verifier]]
    args: tuple[object, ...] = ()


@dataclass(frozen=True, slots=True)
class Job:
    req: AttestRequest
    governing: tuple[AttestationPolicy, ...]
    signing: SigningMaterial
    spiffe_id: str
    serial: int
    now: datetime


# -- the worker process's side ----------------------------------------------------------------
_KEPT_CAS = 4  # signing intermediates a worker keeps parsed (a rotation needs two)
_verifiers: Mapping[Tee, Verifier] | None = None
_cas: OrderedDict[bytes, CertificateAuthority] = OrderedDict()
_stores: dict[str, KeyStore] = {}  # tokens opened by this worker, by URI


def init_worker(recipe: VerifierRecipe) -> None:
    """The worker process's initializer: its verifiers, built once."""
    global _verifiers
    _verifiers = recipe.build(*recipe.args)
    _cas.clear()


class Connection(Protocol):
    """The worker's end of its pipe (``multiprocessing.connection.Connection``)."""

    def recv_bytes(self) -> bytes: ...

    def send_bytes(self, buf: bytes) -> None: ...


READY = b"ready"


def main(argv: Sequence[str]) -> int:
    """``python -m certs.offload FD``: a worker process on the socket inherited as ``FD``. Its
    first frame is ``(sys.path, VerifierRecipe)``, pickled by the control plane."""
    from multiprocessing.connection import Connection as Pipe

    conn = Pipe(int(argv[1]))
    try:
        path, recipe = pickle.loads(conn.recv_bytes())  # noqa: S301 (our parent, our socket)
    except (EOFError, OSError):
        return 1
    sys.path[:] = path
    serve(conn, recipe)
    return 0


def serve(conn: Connection, recipe: VerifierRecipe) -> None:
    """A worker process's life: build the verifiers, say ``READY``, then answer each job (a
    ``JobEncoder`` frame) in order with an ``encode_answer`` or ``encode_error`` frame, until
    the other end closes. Ctrl-C in a terminal is the control plane's to handle: its worker
    ends with its pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_worker(recipe)
    conn.send_bytes(READY)
    jobs = JobDecoder()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the control plane closed its end (or died): nothing more to do
        try:
            out = encode_answer(*run_job(jobs.decode(data)))
        except Exception as exc:  # the caller's to handle, as a call on a thread would be
            out = encode_error(exc)
        conn.send_bytes(out)


def run_job(job: Job) -> tuple[Admitted, Leaf]:
    """One attestation's verification and signing, in a worker process."""
    if _verifiers is None:
        raise RuntimeError("worker not initialised (init_worker)")
    ca = _cas.get(job.signing.ident)
    if ca is None:
        spec = job.signing.key_store
        store = None if spec == "file" else _stores.get(spec)
        if store is None and spec != "file":
            store = _stores[spec] = open_key_store(spec)  # this process's own session
        ca = CertificateAuthority.signing_only(job.signing, store)
        _cas[job.signing.ident] = ca
        while len(_cas) > _KEPT_CAS:
            _cas.popitem(last=False)
    else:
        _cas.move_to_end(job.signing.ident)
    return verify_and_sign(
        job.req, _verifiers, job.governing, ca, job.spiffe_id, job.serial, job.now
    )


# -- between processes ------------------------------------------------------------------------
_RESET_AFTER = 1_024  # policies and intermediates a worker is sent before its table starts over


class JobEncoder:
    """The control plane's side of one worker's pipe: a ``Job`` as a frame. The policies and
    signing intermediates the worker was sent before are named by number (it keeps them in the
    ``JobDecoder`` the frames are read with, in the order they are written); past
    ``reset_after`` of them the frame tells it to start over. Holds what it numbered (an
    ``id`` names one value only while that value lives)."""

    def __init__(self, reset_after: int = _RESET_AFTER) -> None:
        self._numbers: dict[int, tuple[object, int]] = {}
        self._next = 0
        self._reset_after = reset_after
        self._reset_due = False  # a frame that would have said so was never made

    def encode(self, job: Job) -> bytes:
        """The frame of ``job``; a job that cannot be encoded raises and leaves the table as
        the worker has it (nothing it names is taken as sent)."""
        reset = self._reset_due or len(self._numbers) + len(job.governing) >= self._reset_after
        if reset:
            self._numbers.clear()
        new: list[tuple[int, AttestationPolicy | SigningMaterial]] = []
        policies = tuple(self._number(p, new) for p in job.governing)
        signing = self._number(job.signing, new)
        request: list[Any] = list(_request_values(job.req))
        request[_COLLATERAL] = dict(request[_COLLATERAL])  # (a read-only mapping: no pickle)
        now = _naive_utc(job.now)
        frame = (reset, new, policies, signing, request, job.spiffe_id, job.serial, now)
        try:
            data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            for _, value in new:
                del self._numbers[id(value)]
            self._reset_due = reset
            raise
        self._reset_due = False
        return data

    def _number(
        self,
        value: AttestationPolicy | SigningMaterial,
        new: list[tuple[int, AttestationPolicy | SigningMaterial]],
    ) -> int:
        known = self._numbers.get(id(value))
        if known is not None:
            return known[1]
        number = self._next
        self._next += 1
        self._numbers[id(value)] = (value, number)
        new.append((number, value))
        return number


class JobDecoder:
    """A worker's side of its pipe: the ``Job`` a ``JobEncoder`` frame names."""

    def __init__(self) -> None:
        self._held: dict[int, AttestationPolicy | SigningMaterial] = {}

    def decode(self, frame: bytes) -> Job:
        reset, new, policies, signing, request, spiffe_id, serial, now = pickle.loads(frame)  # noqa: S301
        held = self._held
        if reset:
            held.clear()
        held.update(new)
        governing = tuple(held.get(n) for n in policies)
        material = held.get(signing)
        if not isinstance(material, SigningMaterial) or not _all_policies(governing):
            # (frames read out of order: a bug, never a request's fault)
            raise RuntimeError("worker: a job names a policy or intermediate it was not sent")
        return Job(
            AttestRequest(*request), governing, material, spiffe_id, serial, now.replace(tzinfo=UTC)
        )


def _naive_utc(t: datetime) -> datetime:
    """``t`` (aware, as every time here is) in UTC without its tzinfo: a naive datetime pickles
    in a third of the time (``timezone.utc`` pickles through ``copyreg`` every time); the
    other side attaches UTC again (the same instant: an aware datetime compares by it)."""
    if t.tzinfo is None:
        raise ValueError("a naive datetime does not cross to a worker: its zone is unknown")
    return t.astimezone(UTC).replace(tzinfo=None)


def _all_policies(values: tuple[object, ...]) -> TypeGuard[tuple[AttestationPolicy, ...]]:
    return all(isinstance(v, AttestationPolicy) for v in values)


_REQUEST = tuple(f.name for f in fields(AttestRequest))
_request_values = operator.attrgetter(*_REQUEST)
_COLLATERAL = _REQUEST.index("collateral")
_CLAIMS = tuple(f.name for f in fields(Claims))
_claim_values = operator.attrgetter(*_CLAIMS)
_TEE = _CLAIMS.index("tee")
# the mappings (read-only in the claims, plain dicts on the pipe)
_MAPPINGS = tuple(i for i, f in enumerate(fields(Claims)) if str(f.type).startswith("Mapping["))
if fields(Admitted)[0].name != "claims":  # (decode_answer: the claims, then the rest)
    raise ImportError("certs.offload: Admitted's first field must be its claims")
_ADMITTED = tuple(f.name for f in fields(Admitted)[1:])
_admitted_values = operator.attrgetter(*_ADMITTED)
_AT = _ADMITTED.index("at")
_LEAF = tuple(f.name for f in fields(Leaf))
_leaf_values = operator.attrgetter(*_LEAF)
_NOT_AFTER = _LEAF.index("not_after")


def encode_answer(admitted: Admitted, leaf: Leaf) -> bytes:
    """A worker's answer: ``("ok", claims, the rest of admitted, leaf)`` as builtins."""
    claims: list[Any] = list(_claim_values(admitted.claims))
    claims[_TEE] = str(claims[_TEE])
    for i in _MAPPINGS:
        claims[i] = dict(claims[i])
    rest: list[Any] = list(_admitted_values(admitted))
    rest[_AT] = _naive_utc(rest[_AT])
    values: list[Any] = list(_leaf_values(leaf))
    values[_NOT_AFTER] = _naive_utc(values[_NOT_AFTER])
    answer = ("ok", tuple(claims), tuple(rest), tuple(values))
    return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)


def encode_error(exc: Exception) -> bytes:
    """A worker's refusal: ``("error", exception)`` (``certs.errors`` pickle as themselves)."""
    try:
        return pickle.dumps(("error", exc), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as failed:  # (an exception that does not pickle)
        return pickle.dumps(("error", RuntimeError(f"worker: {exc!r} ({failed})")))


def decode_answer(frame: bytes) -> tuple[Admitted, Leaf] | BaseException:
    """What ``encode_answer`` sent, the claims read-only again as verification made them, or
    the refusal ``encode_error`` sent. Raises on a frame neither made."""
    answer = pickle.loads(frame)  # noqa: S301 (our own child, over our own pipe)
    if answer[0] == "error" and isinstance(answer[1], BaseException):
        return answer[1]
    if answer[0] != "ok":
        raise ValueError(f"worker answered {answer[0]!r}")
    _, values, rest, leaf = answer
    claims: list[Any] = list(values)
    claims[_TEE] = Tee(claims[_TEE])
    for i in _MAPPINGS:
        claims[i] = MappingProxyType(claims[i])
    admitted: list[Any] = list(rest)
    admitted[_AT] = admitted[_AT].replace(tzinfo=UTC)
    signed: list[Any] = list(leaf)
    signed[_NOT_AFTER] = signed[_NOT_AFTER].replace(tzinfo=UTC)
    return Admitted(Claims(*claims), *admitted), Leaf(*signed)


__all__ = [
    "READY",
    "Connection",
    "Job",
    "JobDecoder",
    "JobEncoder",
    "VerifierRecipe",
    "configured_verifiers",
    "decode_answer",
    "encode_answer",
    "encode_error",
    "init_worker",
    "main",
    "run_job",
    "serve",
    "verify_and_sign",
]


if __name__ == "__main__":  # (as a module of its own name: one copy of its state)
    from certs.offload import main as _main

    sys.exit(_main(sys.argv))
