"""TEE evidence through configfs-tsm (``/sys/kernel/config/tsm/report``), SNP and TDX alike.

The kernel ABI (Documentation/ABI/testing/configfs-tsm): ``mkdir`` a report entry; write
``inblob`` (up to 64 bytes: our report data) and optionally ``privlevel`` (SNP VMPL, 0..3);
read ``outblob`` (the SNP report or the TDX quote) and ``auxblob`` (SNP: the certificate table,
may be empty); ``provider`` names the backend (``sev_guest``, ``tdx_guest``); ``generation``
counts writes to the entry. Another writer on the same entry between our write and our read
would change ``generation``; we detect that, discard the entry and retry. ``rmdir`` afterwards.

Filesystem access sits behind ``TsmFs`` (``OsTsmFs`` in production), so tests can emulate the
kernel, which a plain directory cannot (it does not produce ``outblob``).
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from certs.errors import AttestmeshError

__all__ = [
    "DEFAULT_ROOT",
    "ConfigfsTsmCollector",
    "OsTsmFs",
    "TsmError",
    "TsmFs",
    "TsmReport",
]

log = logging.getLogger(__name__)

DEFAULT_ROOT: Final = Path("/sys/kernel/config/tsm/report")
INBLOB_MAX: Final = 64
OUTBLOB_MAX: Final = 32 * 1024
PROVIDER_SEV: Final = "sev_guest"
PROVIDER_TDX: Final = "tdx_guest"
# Where each known provider's evidence carries the 64 report-data bytes.
_REPORT_DATA_AT: Final = {PROVIDER_SEV: 0x50, PROVIDER_TDX: 48 + 520}


class TsmError(AttestmeshError):
    """No report from configfs-tsm (reason: ``tsm_unavailable``, ``tsm_io``,
    ``tsm_generation_race``, ``tsm_provider_unexpected``, ``tsm_outblob_invalid``)."""


@dataclass(frozen=True, slots=True)
class TsmReport:
    provider: str
    outblob: bytes
    auxblob: bytes | None
    generation: int


class TsmFs(Protocol):
    """The few filesystem operations configfs-tsm needs."""

    def mkdir(self, path: Path) -> None: ...

    def rmdir(self, path: Path) -> None: ...

    def read(self, path: Path, limit: int) -> bytes: ...

    def write(self, path: Path, data: bytes) -> None: ...


class OsTsmFs:
    """The real filesystem. Writes are a single ``write(2)``, as configfs attributes expect."""

    def mkdir(self, path: Path) -> None:
        path.mkdir()

    def rmdir(self, path: Path) -> None:
        path.rmdir()

    def read(self, path: Path, limit: int) -> bytes:
        with path.open("rb", buffering=0) as f:
            data = f.read(limit + 1)
        if data is None or len(data) > limit:
            raise OSError(errno.EFBIG, f"{path.name} larger than {limit} bytes")
        return data

    def write(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            written = os.write(fd, data)
        finally:
            os.close(fd)
        if written != len(data):
            raise OSError(errno.EIO, f"short write to {path.name}")


def _entry_name() -> str:
    return f"attestmesh-{uuid.uuid4().hex}"


class ConfigfsTsmCollector:
    """Collect TEE evidence carrying ``report_data`` through configfs-tsm."""

    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        *,
        fs: TsmFs | None = None,
        privlevel: int | None = None,
        expected_provider: str | None = None,
        attempts: int = 3,
        entry_name: Callable[[], str] = _entry_name,
    ) -> None:
        if privlevel is not None and not 0 <= privlevel <= 3:
            raise ValueError(f"privlevel must be 0..3, got {privlevel}")
        self._root = root
        self._fs = fs if fs is not None else OsTsmFs()
        self._privlevel = privlevel
        self._expected_provider = expected_provider
        self._attempts = max(1, attempts)
        self._entry_name = entry_name

    def collect(self, report_data: bytes) -> TsmReport:
        if not 0 < len(report_data) <= INBLOB_MAX:
            raise ValueError(f"report_data must be 1..{INBLOB_MAX} bytes")
        for attempt in range(1, self._attempts + 1):
            try:
                return self._collect_once(report_data)
            except TsmError as exc:
                if exc.reason != "tsm_generation_race" or attempt == self._attempts:
                    raise
                log.warning("configfs-tsm entry raced (attempt %d): %s", attempt, exc.detail)
        raise AssertionError("unreachable")  # pragma: no cover

    def _collect_once(self, report_data: bytes) -> TsmReport:
        entry = self._root / self._entry_name()
        try:
            self._fs.mkdir(entry)
        except OSError as exc:
            raise TsmError("tsm_unavailable", f"cannot create {entry}: {exc}") from exc
        try:
            return self._use(entry, report_data)
        finally:
            try:
                self._fs.rmdir(entry)
            except OSError as exc:
                log.warning("could not remove configfs-tsm entry %s: %s", entry, exc)

    def _use(self, entry: Path, report_data: bytes) -> TsmReport:
        fs = self._fs
        try:
            provider = fs.read(entry / "provider", 256).decode("ascii", "replace").strip()
            if self._expected_provider and provider != self._expected_provider:
                raise TsmError(
                    "tsm_provider_unexpected",
                    f"provider {provider!r}, expected {self._expected_provider!r}",
                )
            writes = 0
            if self._privlevel is not None:
                fs.write(entry / "privlevel", f"{self._privlevel}\n".encode())
                writes += 1
            fs.write(entry / "inblob", report_data)
            writes += 1
            outblob = fs.read(entry / "outblob", OUTBLOB_MAX)
            auxblob = self._read_optional(entry / "auxblob")
            generation = int(fs.read(entry / "generation", 32).decode("ascii").strip())
        except OSError as exc:
            raise TsmError("tsm_io", f"{entry}: {exc}") from exc
        except ValueError as exc:
            raise TsmError("tsm_io", f"{entry}/generation: {exc}") from exc
        if generation != writes:
            raise TsmError(
                "tsm_generation_race",
                f"generation {generation} after our {writes} write(s): another writer",
            )
        if not outblob:
            raise TsmError("tsm_outblob_invalid", "empty outblob")
        at = _REPORT_DATA_AT.get(provider)
        if at is not None and outblob[at : at + INBLOB_MAX][: len(report_data)] != report_data:
            raise TsmError("tsm_outblob_invalid", "outblob does not carry our report data")
        return TsmReport(provider, outblob, auxblob or None, generation)

    def _read_optional(self, path: Path) -> bytes | None:
        try:
            return self._fs.read(path, OUTBLOB_MAX)
        except FileNotFoundError:
            return None
