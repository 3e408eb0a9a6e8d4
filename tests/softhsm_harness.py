"""A real SoftHSM2 token for tests: a token directory and config in a temporary directory
(``SOFTHSM2_CONF``), initialised with ``softhsm2-util``. Needs the Debian package softhsm2
(.ci/run installs it); missing, the test fails, it never skips."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

MODULE_CANDIDATES = (
    Path("/usr/lib/softhsm/libsofthsm2.so"),
    Path("/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so"),
    Path("/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so"),
)


def softhsm_module() -> Path:
    for p in MODULE_CANDIDATES:
        if p.exists():
            return p
    raise RuntimeError("SoftHSM2 is not installed (apt-get install softhsm2; see .ci/run)")


@dataclass(frozen=True)
class Token:
    conf: Path
    module: Path
    label: str
    pin_file: Path
    pin: str

    @property
    def uri(self) -> str:
        return (
            f"pkcs11:token={quote(self.label, safe='')}"
            f"?module-path={quote(str(self.module), safe='/')}"
            f"&pin-source=file:{quote(str(self.pin_file), safe='/')}"
        )


def init_token(directory: Path, label: str | None = None) -> Token:
    """A fresh token in ``directory``. The caller points SOFTHSM2_CONF at ``token.conf`` (the
    module reads it when initialised; ``Pkcs11KeyStore`` re-initialises it for a token it has
    not seen), e.g. with pytest's monkeypatch."""
    util = shutil.which("softhsm2-util")
    if util is None:
        raise RuntimeError("softhsm2-util is missing (apt-get install softhsm2; see .ci/run)")
    module = softhsm_module()
    tokens = directory / "tokens"
    tokens.mkdir(parents=True, exist_ok=True)
    conf = directory / "softhsm2.conf"
    conf.write_text(
        f"directories.tokendir = {tokens}\nobjectstore.backend = file\nlog.level = ERROR\n"
    )
    label = label or f"am-{secrets.token_hex(4)}"
    pin = secrets.token_hex(8)
    pin_file = directory / "pin"
    pin_file.write_text(pin + "\n")
    pin_file.chmod(0o600)
    env = {**os.environ, "SOFTHSM2_CONF": str(conf)}
    subprocess.run(
        [util, "--init-token", "--free", "--label", label, "--pin", pin,
         "--so-pin", secrets.token_hex(8)],
        check=True, capture_output=True, env=env, timeout=60,
    )  # fmt: skip
    return Token(conf, module, label, pin_file, pin)
