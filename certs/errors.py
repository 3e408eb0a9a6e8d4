"""The project's own exception hierarchy for evidence and issuance.

Every failure carries a machine-readable ``reason`` drawn from a bounded vocabulary, so it can
be returned to clients and used as a metric label without unbounded cardinality.
"""

from __future__ import annotations

from typing import Any


class AttestmeshError(Exception):
    """Base of every error attestmesh raises on purpose.

    Pickles as what it is (class, message and attributes, whatever its ``__init__`` takes): a
    refusal decided in a worker process (``certs.offload``) reaches the control plane intact.
    """

    reason: str = "error"

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        # (Exception's own reduce calls ``cls(*args)``: wrong for every subclass whose
        # ``__init__`` takes other arguments than its message)
        return (_restore, (type(self), self.args, dict(self.__dict__)))


def _restore(
    cls: type[AttestmeshError], args: tuple[object, ...], attrs: dict[str, Any]
) -> AttestmeshError:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attrs)
    return exc


class EvidenceFormatError(AttestmeshError):
    """Evidence bytes do not parse (truncated, wrong magic, bad lengths, bad encoding).

    Parsers raise only this error, whatever bytes they are given.
    """


class EvidenceVerificationError(AttestmeshError):
    """Evidence parsed but is not authentic at the verification time.

    Reasons are precise and distinct, e.g. ``signature_invalid``, ``chain_invalid``,
    ``untrusted_root``, ``certificate_expired``, ``collateral_expired``, ``revoked``,
    ``tcb_mismatch``, ``tcb_level_not_found``, ``collateral_missing``.
    """


class CollateralError(AttestmeshError):
    """Vendor collateral could not be obtained or parsed."""


class PolicyError(AttestmeshError):
    """A policy document is invalid. ``problems`` lists every problem found, not only the first."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("policy_invalid", "; ".join(problems))
        self.problems = problems
