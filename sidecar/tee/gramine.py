"""SGX DCAP quotes from inside a Gramine enclave through its ``/dev/attestation`` pseudo-files.

Gramine's interface: ``attestation_type`` reads ``none``, ``epid`` or ``dcap``; writing 64 bytes
to ``user_report_data`` sets the report data of the next quote; reading ``quote`` returns an
ECDSA (DCAP) quote v3 over those bytes. The files are process-global, so collection is
serialised with a lock and the returned quote is checked to carry exactly our report data.
The root directory is a parameter, so tests use a plain directory.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Final

from certs.errors import AttestmeshError
from certs.evidence.dcap import MAX_QUOTE_BYTES, TEE_TYPE_SGX, quote_tee_type

__all__ = ["DEFAULT_ROOT", "GramineCollector", "GramineError"]

DEFAULT_ROOT: Final = Path("/dev/attestation")
REPORT_DATA_LEN: Final = 64
_REPORT_DATA_AT: Final = 48 + 320  # header + SGX report body offset of report_data
_TYPE_MAX: Final = 64


class GramineError(AttestmeshError):
    """No quote from Gramine (reason: ``gramine_unavailable``, ``gramine_not_dcap``,
    ``gramine_io``, ``gramine_quote_invalid``)."""


class GramineCollector:
    """Collects an SGX DCAP quote binding ``report_data`` via Gramine's ``/dev/attestation``."""

    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        self._root = root
        self._lock = threading.Lock()

    def attestation_type(self) -> str:
        path = self._root / "attestation_type"
        try:
            with path.open("rb") as f:
                raw = f.read(_TYPE_MAX + 1)
        except FileNotFoundError as exc:
            raise GramineError("gramine_unavailable", f"{path} does not exist") from exc
        except OSError as exc:
            raise GramineError("gramine_io", f"{path}: {exc}") from exc
        return raw[:_TYPE_MAX].decode("ascii", "replace").strip("\x00 \n\r\t")

    def collect(self, report_data: bytes) -> bytes:
        """The quote bytes for ``report_data`` (exactly 64 bytes)."""
        if len(report_data) != REPORT_DATA_LEN:
            raise ValueError(f"report data must be {REPORT_DATA_LEN} bytes")
        kind = self.attestation_type()
        if kind != "dcap":
            raise GramineError("gramine_not_dcap", f"attestation_type is {kind!r}")
        with self._lock:
            try:
                with (self._root / "user_report_data").open("wb") as f:
                    f.write(report_data)
                with (self._root / "quote").open("rb") as f:
                    quote = f.read(MAX_QUOTE_BYTES + 1)
            except OSError as exc:
                raise GramineError("gramine_io", str(exc)) from exc
        if len(quote) > MAX_QUOTE_BYTES:
            raise GramineError("gramine_quote_invalid", "quote larger than the bound")
        if quote_tee_type(quote) != TEE_TYPE_SGX:
            raise GramineError("gramine_quote_invalid", "not an SGX ECDSA quote")
        if quote[_REPORT_DATA_AT : _REPORT_DATA_AT + REPORT_DATA_LEN] != report_data:
            raise GramineError("gramine_quote_invalid", "quote does not carry our report data")
        return quote
