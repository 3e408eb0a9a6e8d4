"""Real Kubernetes servers for tests: etcd + kube-apiserver 1.20.2 (+ kube-controller-manager,
+ kube-scheduler on demand) on loopback with throwaway PKI.

The binaries come from ``tools/kube-build`` (cached outside the repository, in
``$ATTESTMESH_KUBE_CACHE`` or ``~/.cache/attestmesh-kube``). ``ensure_built`` runs it when they
are missing: the first build takes several minutes, later runs find them at once.

Every process is started by ``Cluster.start`` and stopped by ``Cluster.stop`` (SIGTERM, then
SIGKILL); ``restart_apiserver`` stops and starts the API server on the same port and etcd, for
tests of watches that must survive it. Logs stay in the cluster's work directory and are
printed on a start failure.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import json
import os
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from attestmesh.demo import free_port as free_port  # one port picker (see there)

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tools" / "kube-build"
SERVERS = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "apiextensions-apiserver",
    "etcd",
)


def cache_dir() -> Path:
    env = os.environ.get("ATTESTMESH_KUBE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "attestmesh-kube"


def bin_dir() -> Path:
    return cache_dir() / "bin"


def ensure_built() -> Path:
    """The directory holding the server binaries; builds them with tools/kube-build if missing.
    Raises RuntimeError (naming the command) if the build fails."""
    bins = bin_dir()
    if all(os.access(bins / b, os.X_OK) for b in SERVERS):
        return bins
    proc = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not all(os.access(bins / b, os.X_OK) for b in SERVERS):
        raise RuntimeError(
            f"the real Kubernetes servers are not built and `{BUILD_SCRIPT}` failed "
            f"(exit {proc.returncode}); run it by hand to see why:\n{proc.stdout}\n{proc.stderr}"
        )
    return bins


# --- throwaway PKI ---------------------------------------------------------------------------


def _pem_key(key: Any) -> bytes:
    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@dataclass
class Pki:
    ca_key: ec.EllipticCurvePrivateKey
    ca_cert: x509.Certificate

    @classmethod
    def create(cls) -> Pki:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "attestmesh-test-kube-ca")])
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def ca_pem(self) -> bytes:
        return self.ca_cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self, cn: str, orgs: tuple[str, ...] = (), *, server: bool = False
    ) -> tuple[bytes, bytes]:
        """(cert PEM, key PEM): a client certificate (CN user, O groups) or a serving one."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        now = dt.datetime.now(dt.UTC)
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH]
                    if server
                    else [ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.DNSName("localhost"),
                    ]
                ),
                critical=False,
            )
        cert = b.sign(self.ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def kubeconfig(
    server: str,
    ca_pem: bytes,
    *,
    user: str,
    cert: tuple[bytes, bytes] | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    creds: dict[str, str] = {}
    if cert is not None:
        creds["client-certificate-data"] = base64.b64encode(cert[0]).decode()
        creds["client-key-data"] = base64.b64encode(cert[1]).decode()
    if token is not None:
        creds["token"] = token
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        "current-context": "test",
    }


# --- processes -------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        out = self.log.open("ab")
        try:
            self.popen = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            out.close()

    def stop(self, kill: bool = False) -> None:
        p, self.popen = self.popen, None
        if p is None or p.poll() is not None:
            return
        if kill:
            p.kill()
        else:
            p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


@dataclass
class Cluster:
    """etcd + kube-apiserver (+ controller-manager: service-account tokens and namespace
    deletion; + scheduler when ``start_scheduler`` is called) in ``workdir``."""

    workdir: Path
    bins: Path = field(default_factory=bin_dir)
    pki: Pki = field(default_factory=Pki.create)
    api_port: int = field(default_factory=free_port)
    etcd_port: int = field(default_factory=free_port)
    etcd_peer_port: int = field(default_factory=free_port)
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    def _write(self, name: str, data: bytes, mode: int = 0o600) -> Path:
        path = self.workdir / "pki" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
        return path

    def write_kubeconfig(self, name: str, config: dict[str, Any]) -> Path:
        path = self.workdir / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def user_kubeconfig(self, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig authenticating as ``user`` (client certificate, O = groups)."""
        return self.write_kubeconfig(
            user.replace(":", "_"),
            kubeconfig(self.server, self.pki.ca_pem, user=user, cert=self.pki.issue(user, groups)),
        )

    def token_kubeconfig(self, name: str, token: str) -> Path:
        return self.write_kubeconfig(
            name, kubeconfig(self.server, self.pki.ca_pem, user=name, token=token)
        )

    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert, key = self.pki.issue("kube-apiserver", server=True)
        self.serving = (self._write("apiserver.crt", cert), self._write("apiserver.key", key))
        self.ca_file = self._write("ca.crt", self.pki.ca_pem, 0o644)
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_key = self._write("sa.key", _pem_key(sa))
        self.sa_pub = self._write(
            "sa.pub",
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )
        self.admin = self.user_kubeconfig("test-admin", ("system:masters",))
        # a user that is not a service account, with a static bearer token
        self.static_user = ("alice", f"alice-{os.urandom(8).hex()}")
        self.token_file = self._write(
            "tokens.csv", f"{self.static_user[1]},alice,u-alice\n".encode()
        )
        # every request of a service account, at Metadata level (who, verb, resource, code):
        # what the control plane's RBAC is checked against
        self.audit_policy = self.workdir / "audit-policy.yaml"
        self.audit_policy.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    "rules": [
                        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                        {"level": "None"},
                    ],
                }
            )
        )
        self.audit_log = self.workdir / "audit.log"
        self.procs["etcd"] = Proc(
            "etcd",
            [
                str(self.bins / "etcd"),
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                self.etcd_url,
                "--advertise-client-urls",
                self.etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{self.etcd_peer_port}",
                "--log-level",
                "warn",
            ],
            self.workdir / "etcd.log",
        )
        self.procs["kube-apiserver"] = Proc(
            "kube-apiserver",
            [
                str(self.bins / "kube-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                "--insecure-port=0",
                f"--cert-dir={self.workdir / 'pki'}",
                f"--tls-cert-file={self.serving[0]}",
                f"--tls-private-key-file={self.serving[1]}",
                f"--client-ca-file={self.ca_file}",
                f"--token-auth-file={self.token_file}",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={self.sa_pub}",
                f"--service-account-signing-key-file={self.sa_key}",
                # attestmesh among them: audience-unaware authenticators (the static tokens
                # below, as OIDC or webhook ones in a real cluster) vouch for it too
                f"--api-audiences={self.server},attestmesh",
                "--authorization-mode=RBAC",
                "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,"
                "MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
                "--endpoint-reconciler-type=none",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--enable-priority-and-fairness=false",
                f"--audit-policy-file={self.audit_policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--v=1",
            ],
            self.workdir / "kube-apiserver.log",
        )
        self.procs["kube-controller-manager"] = Proc(
            "kube-controller-manager",
            [
                str(self.bins / "kube-controller-manager"),
                f"--kubeconfig={self.admin}",
                "--controllers=serviceaccount-token,serviceaccount,namespace,garbagecollector",
                f"--service-account-private-key-file={self.sa_key}",
                f"--root-ca-file={self.ca_file}",
                "--leader-elect=false",
                "--port=0",
                "--secure-port=0",
                "--v=1",
            ],
            self.workdir / "kube-controller-manager.log",
        )
        self.procs["kube-scheduler"] = Proc(
            "kube-scheduler",
            [
                str(self.bins / "kube-scheduler"),
                f"--kubeconfig={self.admin}",
                "--leader-elect=false",
                "--port=0",
                "--secure-port=0",
                "--v=2",
            ],
            self.workdir / "kube-scheduler.log",
        )

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cadata=self.pki.ca_pem.decode())
        cert, key = self._write("probe.crt", b""), self._write("probe.key", b"")
        c, k = self.pki.issue("test-probe", ("system:masters",))
        cert.write_bytes(c)
        key.write_bytes(k)
        ctx.load_cert_chain(cert, key)
        return ctx

    def _wait(self, what: str, ok: Any, timeout: float, proc: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.procs[proc].alive():
                raise RuntimeError(f"{proc} exited:\n{self.procs[proc].tail()}")
            with contextlib.suppress(Exception):
                if ok():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{what} not ready in {timeout}s:\n{self.procs[proc].tail()}")

    def _readyz(self) -> bool:
        req = urllib.request.Request(self.server + "/readyz")  # noqa: S310 (https, loopback)
        with urllib.request.urlopen(req, context=self._probe_ctx, timeout=2) as resp:  # noqa: S310
            return bool(resp.status == 200)

    def start_apiserver(self) -> None:
        self.procs["kube-apiserver"].start()
        self._wait("kube-apiserver /readyz", self._readyz, 60, "kube-apiserver")

    def stop_apiserver(self) -> None:
        self.procs["kube-apiserver"].stop()

    def restart_apiserver(self) -> None:
        self.stop_apiserver()
        self.start_apiserver()

    def start(self, *, controller_manager: bool = True) -> None:
        self.prepare()
        self._probe_ctx = self._ssl()
        try:
            self.procs["etcd"].start()

            def etcd_ok() -> bool:
                with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as r:  # noqa: S310
                    return bool(json.loads(r.read()).get("health") == "true")

            self._wait("etcd", etcd_ok, 30, "etcd")
            self.start_apiserver()
            if controller_manager:
                self.procs["kube-controller-manager"].start()
        except BaseException:
            self.stop()
            raise

    def start_second_apiserver(self) -> Path:
        """Another kube-apiserver on the same etcd (as in an HA control plane), on its own
        port; returns an admin kubeconfig for it. Writes through it reach etcd while the first
        one is down."""
        port = free_port()
        swap = {"--secure-port=": f"--secure-port={port}",
                "--audit-log-path=": f"--audit-log-path={self.workdir / 'audit-2.log'}"}  # fmt: skip
        argv = [
            next((v for k, v in swap.items() if a.startswith(k)), a)
            for a in self.procs["kube-apiserver"].argv
        ]
        proc = Proc("kube-apiserver-2", argv, self.workdir / "kube-apiserver-2.log")
        self.procs[proc.name] = proc
        proc.start()
        server = f"https://127.0.0.1:{port}"

        def ready() -> bool:
            req = urllib.request.Request(server + "/readyz")  # noqa: S310 (https, loopback)
            with urllib.request.urlopen(req, context=self._probe_ctx, timeout=2) as resp:  # noqa: S310
                return bool(resp.status == 200)

        self._wait("second kube-apiserver /readyz", ready, 60, proc.name)
        cert = self.pki.issue("test-admin-2", ("system:masters",))
        return self.write_kubeconfig(
            "admin-2", kubeconfig(server, self.pki.ca_pem, user="test-admin-2", cert=cert)
        )

    def start_scheduler(self) -> None:
        if not self.procs["kube-scheduler"].alive():
            self.procs["kube-scheduler"].start()

    def stop_scheduler(self) -> None:
        self.procs["kube-scheduler"].stop()

    def audit_events(self, user: str) -> list[dict[str, Any]]:
        """The audit events (ResponseComplete stage) of requests made as ``user``."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.audit_log.read_text().splitlines():
                event = json.loads(line)
                if event.get("stage") == "ResponseComplete" and (
                    event.get("user", {}).get("username") == user
                ):
                    out.append(event)
        return out

    def etcd_compact(self) -> int:
        """Compact etcd's history to its current revision (what the API server does every
        five minutes): older resourceVersions become 410 Gone. Returns the revision."""

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            req = urllib.request.Request(  # noqa: S310 (loopback etcd)
                self.etcd_url + path, data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310
                return dict(json.loads(r.read()))

        rev = int(
            post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"]
        )
        post("/v3/kv/compaction", {"revision": str(rev), "physical": True})
        return rev

    def stop(self) -> None:
        for name in (
            "kube-scheduler",
            "kube-controller-manager",
            "kube-apiserver-2",
            "kube-apiserver",
            "etcd",
        ):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop()


@dataclass
class CrdServer:
    """etcd + apiextensions-apiserver 1.36 (CRDs and custom resources only, CEL validation
    rules enforced), client-certificate authentication (``pki``'s CA), in ``workdir``; ``core``:
    an admin kubeconfig of the kube-apiserver it delegates to (namespaces, token and access
    reviews)."""

    workdir: Path
    core: Path
    pki: Pki
    bins: Path = field(default_factory=bin_dir)
    api_port: int = field(default_factory=free_port)
    etcd_port: int = field(default_factory=free_port)
    etcd_peer_port: int = field(default_factory=free_port)
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    def start(self) -> None:
        pki_dir = self.workdir / "pki"
        pki_dir.mkdir(parents=True, exist_ok=True)

        def write(name: str, data: bytes) -> Path:
            path = pki_dir / name
            path.write_bytes(data)
            path.chmod(0o600)
            return path

        cert, key = self.pki.issue("apiextensions-apiserver", server=True)
        crt, keyf = write("server.crt", cert), write("server.key", key)
        ca = write("ca.crt", self.pki.ca_pem)
        admin = self.pki.issue("test-admin", ("system:masters",))
        self.admin = self.workdir / "admin.kubeconfig"
        self.admin.write_text(
            yaml.safe_dump(kubeconfig(self.server, self.pki.ca_pem, user="test-admin", cert=admin))
        )
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self.procs["etcd"] = Proc(
            "etcd",
            [str(self.bins / "etcd"), "--data-dir", str(self.workdir / "etcd"),
             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}", "--log-level", "warn"],
            self.workdir / "etcd.log",
        )  # fmt: skip
        self.procs["apiextensions-apiserver"] = Proc(
            "apiextensions-apiserver",
            [str(self.bins / "apiextensions-apiserver"), f"--etcd-servers={etcd_url}",
             "--bind-address=127.0.0.1", f"--secure-port={self.api_port}",
             f"--cert-dir={pki_dir}", f"--tls-cert-file={crt}", f"--tls-private-key-file={keyf}",
             f"--client-ca-file={ca}", "--authentication-skip-lookup",
             # the core API it delegates to (namespaces for admission, token reviews, access
             # reviews), as under a kube-apiserver's aggregator; client certificates are checked
             # locally and system:masters is always allowed
             f"--kubeconfig={self.core}", f"--authentication-kubeconfig={self.core}",
             f"--authorization-kubeconfig={self.core}",
             # their informers watch admissionregistration v1 policies a 1.20 core does not
             # serve, and would keep every request 'not yet ready'
             "--disable-admission-plugins=ValidatingAdmissionPolicy,MutatingAdmissionPolicy",
             "--enable-priority-and-fairness=false", "--v=1"],
            self.workdir / "apiextensions-apiserver.log",
        )  # fmt: skip
        probe_cert, probe_key = write("probe.crt", admin[0]), write("probe.key", admin[1])
        ctx = ssl.create_default_context(cadata=self.pki.ca_pem.decode())
        ctx.load_cert_chain(probe_cert, probe_key)

        def wait(what: str, ok: Any, proc: str) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if not self.procs[proc].alive():
                    raise RuntimeError(f"{proc} exited:\n{self.procs[proc].tail()}")
                with contextlib.suppress(Exception):
                    if ok():
                        return
                time.sleep(0.1)
            raise RuntimeError(f"{what} not ready in 60s:\n{self.procs[proc].tail()}")

        def etcd_ok() -> bool:
            with urllib.request.urlopen(etcd_url + "/health", timeout=2) as r:  # noqa: S310
                return bool(json.loads(r.read()).get("health") == "true")

        def livez() -> bool:  # /readyz never turns green: no core API to reach
            req = urllib.request.Request(self.server + "/livez")  # noqa: S310 (loopback)
            with urllib.request.urlopen(req, context=ctx, timeout=2) as r:  # noqa: S310
                return bool(r.status == 200)

        try:
            self.procs["etcd"].start()
            wait("etcd", etcd_ok, "etcd")
            self.procs["apiextensions-apiserver"].start()
            wait("apiextensions-apiserver /livez", livez, "apiextensions-apiserver")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for name in ("apiextensions-apiserver", "etcd"):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop()
