"""A throwaway PostgreSQL cluster for tests and benchmarks: initdb in a temporary directory as an
unprivileged user, a server on a free loopback port, removed afterwards.

Debian's postgresql 15 must be installed (``.ci/run`` installs it when missing). A missing
installation is an error, never a skip: the tests that use it are part of ``make test``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attestmesh.demo import free_port

_BIN_DIRS = (
    "/usr/lib/postgresql/15/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/17/bin",
)


def pg_bin() -> Path:
    for d in _BIN_DIRS:
        if (Path(d) / "postgres").exists():
            return Path(d)
    found = shutil.which("postgres")
    if found:
        return Path(found).parent
    raise RuntimeError(
        "PostgreSQL server binaries not found: install Debian's postgresql "
        "(sudo apt-get install -y postgresql), as .ci/run does"
    )


@dataclass
class PgCluster:
    """One running throwaway server. ``url(db)`` is a libpq URL for the superuser."""

    directory: Path
    port: int
    user: str
    process: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.directory / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def _as_owner(self) -> dict[str, object]:
        if os.geteuid() != 0:
            return {}
        pw = pwd.getpwnam(self.user)
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}

    def start(self) -> None:
        log = (self.directory / "server.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(pg_bin() / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                "-k",
                str(self.directory),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=on",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=64MB",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **self._as_owner(),  # type: ignore[arg-type]
        )
        log.close()
        # crash recovery on a machine whose disk other work saturates can take long
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited: {self.log_tail()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                ready = subprocess.run(
                    [str(pg_bin() / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                    capture_output=True,
                    check=False,
                )
                if ready.returncode == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"postgres did not become ready: {self.log_tail()}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20) -> None:
        """SIGINT: fast shutdown (clients are disconnected); SIGKILL: a crash."""
        p, self.process = self.process, None
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self) -> str:
        try:
            return (self.directory / "server.log").read_text()[-2000:]
        except OSError:
            return ""

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _owner() -> str:
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name
    for candidate in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(candidate)
            return candidate
    raise RuntimeError("no unprivileged user to run PostgreSQL as (postgres or nobody)")


@contextlib.contextmanager
def pg_cluster() -> Iterator[PgCluster]:
    """initdb + start; yields the running cluster; stops it and removes the directory."""
    user = _owner()
    directory = Path(tempfile.mkdtemp(prefix="attestmesh-pg-"))
    cluster = PgCluster(directory, free_port(), user)
    try:
        if os.geteuid() == 0:
            pw = pwd.getpwnam(user)
            os.chown(directory, pw.pw_uid, pw.pw_gid)
        init = subprocess.run(
            [
                str(pg_bin() / "initdb"),
                "-D",
                str(cluster.data),
                "-U",
                user,
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            capture_output=True,
            check=False,
            **cluster._as_owner(),  # type: ignore[arg-type]
        )
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed: {init.stderr.decode(errors='replace')}")
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)
