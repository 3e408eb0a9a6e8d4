"""configfs-tsm collector against a temporary directory that behaves like the kernel's
report entries (the real OsTsmFs does the file I/O; the emulator adds what the kernel does)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from certs.evidence.sev_snp import SevSnpVerifier
from sidecar.tee.configfs_tsm import ConfigfsTsmCollector, OsTsmFs, TsmError, TsmReport
from tests.vectors import VECTORS, pin

SNP = VECTORS / "sev-snp"
REPORT = (SNP / "milan_v2_gosevguest" / "report.bin").read_bytes()
REPORT_DATA = REPORT[0x50:0x90]
CERT_TABLE = b"\x8d\x75\xda\x63" + bytes(60)  # stands in for the SNP certificate table


def snp_outblob(inblob: bytes, _privlevel: int) -> bytes:
    if inblob == REPORT_DATA:
        return REPORT
    padded = inblob.ljust(64, b"\0")
    return REPORT[:0x50] + padded + REPORT[0x90:]


def tdx_outblob(inblob: bytes, _privlevel: int) -> bytes:
    return bytes(48 + 520) + inblob.ljust(64, b"\0") + bytes(100)


class EmulatedConfigfs(OsTsmFs):
    """What the kernel adds on top of plain files: attribute files appear on mkdir, writes
    bump ``generation``, and ``outblob``/``auxblob`` reflect the current ``inblob``."""

    def __init__(
        self,
        provider: str = "sev_guest",
        make_outblob: Callable[[bytes, int], bytes] = snp_outblob,
        auxblob: bytes | None = CERT_TABLE,
    ) -> None:
        self.provider = provider
        self.make_outblob = make_outblob
        self.auxblob = auxblob
        self.writes: list[tuple[str, bytes]] = []
        self.removed: list[str] = []
        self.after_write: Callable[[Path, str], None] | None = None

    def mkdir(self, path: Path) -> None:
        super().mkdir(path)
        (path / "provider").write_text(self.provider + "\n")
        (path / "generation").write_text("0\n")
        (path / "privlevel_floor").write_text("0\n")
        for name in ("inblob", "privlevel", "outblob"):
            (path / name).write_bytes(b"")
        if self.auxblob is not None:
            (path / "auxblob").write_bytes(b"")

    def rmdir(self, path: Path) -> None:
        for child in path.iterdir():
            child.unlink()
        super().rmdir(path)
        self.removed.append(path.name)

    def write(self, path: Path, data: bytes) -> None:
        if path.name == "inblob" and len(data) > 64:
            raise OSError(22, "Invalid argument")
        super().write(path, data)
        self.writes.append((path.name, data))
        entry = path.parent
        generation = int((entry / "generation").read_text()) + 1
        (entry / "generation").write_text(f"{generation}\n")
        inblob = (entry / "inblob").read_bytes()
        privlevel = int((entry / "privlevel").read_text() or "0")
        (entry / "outblob").write_bytes(self.make_outblob(inblob, privlevel) if inblob else b"")
        if self.auxblob is not None:
            (entry / "auxblob").write_bytes(self.auxblob)
        if self.after_write is not None:
            self.after_write(entry, path.name)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "tsm" / "report"
    path.mkdir(parents=True)
    return path


def test_snp_report_through_configfs(root: Path) -> None:
    fs = EmulatedConfigfs()
    report = ConfigfsTsmCollector(root, fs=fs, expected_provider="sev_guest").collect(REPORT_DATA)
    assert report == TsmReport("sev_guest", REPORT, CERT_TABLE, 1)
    assert fs.writes == [("inblob", REPORT_DATA)]
    assert list(root.iterdir()) == []  # the entry was removed
    assert len(fs.removed) == 1
    verifier = SevSnpVerifier([(SNP / "amd" / "ask_ark_milan.pem").read_bytes()])
    claims = verifier.verify(
        report.outblob,
        now=pin("2023-01-01T00:00:00Z"),
        collateral={"vcek": (SNP / "milan_v2_gosevguest" / "vcek.der").read_bytes()},
    )
    assert claims.report_data == REPORT_DATA


def test_privlevel_is_written_before_inblob(root: Path) -> None:
    fs = EmulatedConfigfs()
    report = ConfigfsTsmCollector(root, fs=fs, privlevel=2).collect(bytes(range(64)))
    assert fs.writes == [("privlevel", b"2\n"), ("inblob", bytes(range(64)))]
    assert report.generation == 2
    assert report.outblob[0x50:0x90] == bytes(range(64))


def test_tdx_provider_without_auxblob(root: Path) -> None:
    fs = EmulatedConfigfs("tdx_guest", tdx_outblob, auxblob=None)
    report = ConfigfsTsmCollector(root, fs=fs).collect(b"\x07" * 64)
    assert report.provider == "tdx_guest"
    assert report.auxblob is None
    assert report.outblob[568:632] == b"\x07" * 64


def test_empty_auxblob_is_none(root: Path) -> None:
    fs = EmulatedConfigfs(auxblob=b"")
    assert ConfigfsTsmCollector(root, fs=fs).collect(REPORT_DATA).auxblob is None


def test_unexpected_provider(root: Path) -> None:
    fs = EmulatedConfigfs("tdx_guest", tdx_outblob)
    with pytest.raises(TsmError) as info:
        ConfigfsTsmCollector(root, fs=fs, expected_provider="sev_guest").collect(REPORT_DATA)
    assert info.value.reason == "tsm_provider_unexpected"
    assert list(root.iterdir()) == []


def test_concurrent_writer_is_detected_and_retried(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = EmulatedConfigfs()
    raced: list[str] = []

    def intruder(entry: Path, name: str) -> None:
        if name == "inblob" and not raced:
            raced.append(entry.name)
            fs.after_write = None
            fs.write(entry / "inblob", b"\xee" * 64)  # someone else's request
            fs.after_write = intruder

    fs.after_write = intruder
    names = iter(["first", "second"])
    collector = ConfigfsTsmCollector(root, fs=fs, entry_name=lambda: next(names))
    with caplog.at_level(logging.WARNING):
        report = collector.collect(REPORT_DATA)
    assert report.outblob == REPORT
    assert raced == ["first"]
    assert fs.removed == ["first", "second"]
    assert any("raced" in r.getMessage() for r in caplog.records)


def test_persistent_race_gives_up(root: Path) -> None:
    fs = EmulatedConfigfs()

    def intruder(entry: Path, name: str) -> None:
        if name == "inblob":
            (entry / "generation").write_text("7\n")

    fs.after_write = intruder
    with pytest.raises(TsmError) as info:
        ConfigfsTsmCollector(root, fs=fs, attempts=2).collect(REPORT_DATA)
    assert info.value.reason == "tsm_generation_race"
    assert len(fs.removed) == 2
    assert list(root.iterdir()) == []


def test_outblob_without_our_report_data_is_rejected(root: Path) -> None:
    fs = EmulatedConfigfs(make_outblob=lambda _i, _p: REPORT)
    with pytest.raises(TsmError) as info:
        ConfigfsTsmCollector(root, fs=fs).collect(bytes(64))
    assert info.value.reason == "tsm_outblob_invalid"


def test_missing_configfs_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(TsmError) as info:
        ConfigfsTsmCollector(tmp_path / "no" / "tsm").collect(REPORT_DATA)
    assert info.value.reason == "tsm_unavailable"


def test_plain_directory_is_an_io_error_and_is_cleaned_up(root: Path) -> None:
    """A directory without the kernel behind it has no attribute files."""

    class PlainFs(OsTsmFs):
        def rmdir(self, path: Path) -> None:
            shutil.rmtree(path)

    with pytest.raises(TsmError) as info:
        ConfigfsTsmCollector(root, fs=PlainFs()).collect(REPORT_DATA)
    assert info.value.reason == "tsm_io"
    assert list(root.iterdir()) == []


def test_cleanup_failure_is_logged_not_raised(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    class StickyFs(EmulatedConfigfs):
        def rmdir(self, path: Path) -> None:
            raise OSError(16, "Device or resource busy")

    with caplog.at_level(logging.WARNING):
        report = ConfigfsTsmCollector(root, fs=StickyFs()).collect(REPORT_DATA)
    assert report.outblob == REPORT
    assert any("could not remove" in r.getMessage() for r in caplog.records)


def test_argument_validation(root: Path) -> None:
    with pytest.raises(ValueError):
        ConfigfsTsmCollector(root, privlevel=4)
    collector = ConfigfsTsmCollector(root, fs=EmulatedConfigfs())
    with pytest.raises(ValueError):
        collector.collect(b"")
    with pytest.raises(ValueError):
        collector.collect(bytes(65))


def test_oversized_attribute_is_an_io_error(root: Path) -> None:
    fs = EmulatedConfigfs(make_outblob=lambda i, _p: REPORT[:0x50] + i + bytes(40 * 1024))
    with pytest.raises(TsmError) as info:
        ConfigfsTsmCollector(root, fs=fs).collect(REPORT_DATA)
    assert info.value.reason == "tsm_io"
