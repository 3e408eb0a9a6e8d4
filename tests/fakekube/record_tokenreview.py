"""Record what a real kube-apiserver answers to the TokenReviews attestmesh makes, so the fake's
answers can be held to it (``tokenreview_1.20.2.json``, checked by
``tests/component/test_pod_identity.py``).

Not a test: it needs a kube-apiserver and etcd binary (see /work/shared/design/KUBE-APISERVER.md
for building kube-apiserver 1.20.2 from Debian's sources). Run::

    python -m tests.fakekube.record_tokenreview --apiserver PATH --etcd PATH > out.json

It starts etcd and kube-apiserver on loopback in a temporary directory, creates namespace
``shop``, service account ``web`` and pod ``web-0``, requests tokens with the TokenRequest API
(bound to the pod as the kubelet's projected token is, and unbound), reviews them for audience
``attestmesh``, deletes the pod (reviewing at once, then after the success cache expired) and
recreates it, and prints every answer's ``status``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

CACHE_TTL_S = 10  # kube-apiserver's default --token-success-cache-ttl (failures: not cached)
ADMIN_TOKEN = "recorder-admin-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Api:
    def __init__(self, url: str, ca: Path) -> None:
        self.url = url
        self.ctx = ssl.create_default_context(cafile=str(ca))
        self.ctx.check_hostname = False  # the self-signed serving cert names no 127.0.0.1 SAN

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)  # noqa: S310
        req.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=10) as resp:  # noqa: S310
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")  # /readyz answers text


@contextlib.contextmanager
def servers(apiserver: Path, etcd: Path, work: Path) -> Iterator[Api]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (work / "sa.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    (work / "sa.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (work / "tokens.csv").write_text(f"{ADMIN_TOKEN},admin,admin,system:masters\n")
    etcd_port, peer_port, port = _free_port(), _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    log = (work / "servers.log").open("wb")
    try:
        procs.append(
            subprocess.Popen(
                [
                    str(etcd), "--data-dir", str(work / "etcd"),
                    "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                    "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                    "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                    "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
                ],
                stdout=log, stderr=log,
            )
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [
                    str(apiserver),
                    f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                    "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                    f"--secure-port={port}", "--insecure-port=0",
                    f"--cert-dir={work / 'certs'}",
                    f"--token-auth-file={work / 'tokens.csv'}",
                    "--authorization-mode=RBAC",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    f"--service-account-key-file={work / 'sa.pub'}",
                    f"--service-account-signing-key-file={work / 'sa.key'}",
                    "--service-cluster-ip-range=10.0.0.0/24",
                    "--enable-admission-plugins=NamespaceLifecycle",
                    "--disable-admission-plugins=ServiceAccount",
                    "--endpoint-reconciler-type=none",
                ],
                stdout=log, stderr=log,
            )
        )  # fmt: skip
        ca = work / "certs" / "apiserver.crt"
        deadline = time.monotonic() + 60
        while True:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError((work / "servers.log").read_text()[-4000:])
            if ca.exists():
                with contextlib.suppress(OSError, ssl.SSLError):
                    if Api(f"https://127.0.0.1:{port}", ca).call("GET", "/readyz")[0] == 200:
                        break
            time.sleep(0.2)
        yield Api(f"https://127.0.0.1:{port}", ca)
    finally:
        for p in reversed(procs):
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        log.close()


def record(api: Api) -> dict[str, Any]:
    def ok(result: tuple[int, Any]) -> Any:
        status, body = result
        if status not in (200, 201):
            raise RuntimeError(f"{status}: {body}")
        return body

    ok(api.call("POST", "/api/v1/namespaces", {"metadata": {"name": "shop"}}))
    ok(api.call("POST", "/api/v1/namespaces/shop/serviceaccounts", {"metadata": {"name": "web"}}))
    pod = {
        "metadata": {"name": "web-0"},
        "spec": {"serviceAccountName": "web", "containers": [{"name": "app", "image": "web:1"}]},
    }
    uid = ok(api.call("POST", "/api/v1/namespaces/shop/pods", pod))["metadata"]["uid"]

    def token(bound: bool, audiences: list[str], pod_uid: str) -> str:
        spec: dict[str, Any] = {"audiences": audiences, "expirationSeconds": 3600}
        if bound:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": "web-0",
                                      "uid": pod_uid}  # fmt: skip
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = "/api/v1/namespaces/shop/serviceaccounts/web/token"
        return str(ok(api.call("POST", path, body))["status"]["token"])

    def review(tok: str) -> Any:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": tok, "audiences": ["attestmesh"]},
        }
        return ok(api.call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", body))["status"]

    bound = token(True, ["attestmesh"], uid)
    out: dict[str, Any] = {
        "pod_uid": uid,
        "bound": review(bound),
        "unbound": review(token(False, ["attestmesh"], uid)),
        "other_audience": review(token(True, ["vault"], uid)),
    }
    ok(api.call("DELETE", "/api/v1/namespaces/shop/pods/web-0?gracePeriodSeconds=0"))
    deadline = time.monotonic() + 10
    while api.call("GET", "/api/v1/namespaces/shop/pods/web-0")[0] != 404:
        if time.monotonic() > deadline:
            raise RuntimeError("pod web-0 was not deleted")
        time.sleep(0.1)
    # a successful authentication is cached (kube-apiserver --token-success-cache-ttl, 10 s
    # by default, keyed by token and audiences): the gone pod's token is still vouched for
    out["pod_gone_cached"] = review(bound)
    time.sleep(CACHE_TTL_S + 1)
    out["pod_gone"] = review(bound)
    out["new_pod_uid"] = ok(api.call("POST", "/api/v1/namespaces/shop/pods", pod))["metadata"][
        "uid"
    ]
    out["pod_recreated"] = review(bound)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--apiserver", type=Path, required=True)
    p.add_argument("--etcd", type=Path, required=True)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, servers(args.apiserver, args.etcd, Path(tmp)) as api:
        version = api.call("GET", "/version")[1]
        out = {"server": version.get("gitVersion"), **record(api)}
    json.dump(out, sys.stdout, indent=2, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
