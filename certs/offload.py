"""An attestation's CPU-bound step as a job for a worker process: verify the evidence and the
CSR's key binding, appraise, sign the leaf (``verify_and_sign``, the one function the control
plane runs on a thread or sends here).

Everything a job carries pickles as plain values: the request, the governing policies, the CA's
signing intermediate as bytes (``SigningMaterial``; a worker parses each one once, by its
identity), the serial number and the time, both chosen by the caller. A worker builds its
verifiers once, from a ``VerifierRecipe`` (a module-level function and its arguments), and holds
no other state: what it returns is the appraisal's ``Admitted`` and the signed ``Leaf``, or the
refusal it raised (``certs.errors`` pickles as itself).
"""

from __future__ import annotations

import pickle
import signal
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Protocol

from certs.ca import CertificateAuthority, Leaf, SigningMaterial, issue
from certs.collateral.roots import load_roots
from certs.evidence.claims import Tee, Verifier
from certs.evidence.composite import attach_gpus
from certs.evidence.registry import build_verifiers
from certs.evidence.sim import load_platform_public_key
from certs.issuance import AttestRequest, decide, read_only_claims, verify_request
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
    pickled ``Job``) in order with a pickled ``("ok", (Admitted, Leaf))`` or ``("error",
    exception)``, until the other end closes. Ctrl-C in a terminal is the control plane's to
    handle: its worker ends with its pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_worker(recipe)
    conn.send_bytes(READY)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the control plane closed its end (or died): nothing more to do
        try:
            answer: tuple[str, object] = ("ok", run_job(pickle.loads(data)))  # noqa: S301
        except Exception as exc:  # the caller's to handle, as a call on a thread would be
            answer = ("error", exc)
        try:
            out = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # (an exception that does not pickle)
            out = pickle.dumps(("error", RuntimeError(f"worker: {answer[1]!r} ({exc})")))
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
    admitted, leaf = verify_and_sign(
        job.req, _verifiers, job.governing, ca, job.spiffe_id, job.serial, job.now
    )
    return _portable(admitted), leaf


# -- between processes ------------------------------------------------------------------------
def _portable(admitted: Admitted) -> Admitted:
    """``admitted`` with plain-dict claim mappings (a read-only mapping does not pickle)."""
    c = admitted.claims
    return replace(
        admitted,
        claims=replace(
            c, measurements=dict(c.measurements), tcb=dict(c.tcb), details=dict(c.details)
        ),
    )


def received(admitted: Admitted) -> Admitted:
    """What a worker returned, its claims read-only again as verification made them."""
    return replace(admitted, claims=read_only_claims(admitted.claims))


__all__ = [
    "READY",
    "Connection",
    "Job",
    "VerifierRecipe",
    "configured_verifiers",
    "init_worker",
    "main",
    "received",
    "run_job",
    "serve",
    "verify_and_sign",
]


if __name__ == "__main__":  # (as a module of its own name: one copy of its state)
    from certs.offload import main as _main

    sys.exit(_main(sys.argv))
