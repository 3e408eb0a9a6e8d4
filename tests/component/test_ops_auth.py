"""The ops admin API is authenticated (a bearer token from ``<state_dir>/ops-token``), refuses
browser requests (any Origin header), foreign Host names and non-JSON bodies; /metrics,
/healthz and /readyz stay open. In-process aiohttp server on a real loopback port, a real
ControlPlane on temporary state; the ``attestmesh quarantine`` CLI against it."""

from __future__ import annotations

import asyncio
import stat
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.cli import main as cli_main
from attestmesh.serve import build_ops_app, ensure_ops_token, ops_token_path
from certs.errors import AttestmeshError
from tests.unit.fixtures_core import NOW, Clock, Plane, make_control_plane, registration
from xds.state import Status, Trigger

PLATFORM = ec.generate_private_key(ec.SECP256R1())
EVIL = "https://evil.example"


@dataclass
class Ops:
    plane: Plane
    client: TestClient[Any, Any]
    token: str
    state_dir: Path

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def snapshot(self) -> tuple[Any, ...]:
        """What an attack must not change: every workload, and the event log."""
        cp = self.plane.cp
        return (dict(cp.state.workloads), len(cp.events()))


@pytest.fixture
async def ops(tmp_path: Path) -> AsyncIterator[Ops]:
    plane = make_control_plane(
        tmp_path,
        clock=Clock(NOW),
        platform_key=PLATFORM,
        registrations=[registration("web-1"), registration("web-2")],
    )
    plane.cp.quarantine("web-2", Trigger.OPERATOR, "held by the operator")
    state_dir = tmp_path / "state"
    token = ensure_ops_token(state_dir)
    try:
        server = TestServer(build_ops_app(plane.cp, plane.metrics, token), host="127.0.0.1")
        async with TestClient(server) as client:
            yield Ops(plane, client, token, state_dir)
    finally:
        plane.store.close()


async def _refused(resp: Any, status: int, error: str) -> None:
    body = await resp.json()
    assert (resp.status, body["error"]) == (status, error), body
    assert body["detail"]


# ---------------------------------------------------------------------------------------------
# the attacks of issue 8, item 8


async def test_cross_site_text_plain_post_changes_nothing(ops: Ops) -> None:
    # what a page on any web site can make a browser send without a preflight
    before = ops.snapshot()
    headers = {"Origin": EVIL, "Content-Type": "text/plain"}
    for path in ("/v1/admin/workloads/web-1/quarantine", "/v1/admin/workloads/web-2/release"):
        resp = await ops.client.post(path, data='{"reason": "x"}', headers=headers)
        await _refused(resp, 403, "origin_refused")
        # even carrying the right token (a browser never has it), an Origin is refused
        resp = await ops.client.post(path, json={}, headers={"Origin": EVIL, **ops.auth()})
        await _refused(resp, 403, "origin_refused")
    assert ops.snapshot() == before
    assert ops.plane.cp.status_of("web-1") is Status.PENDING
    assert ops.plane.cp.status_of("web-2") is Status.QUARANTINED


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer wrong",
        "Basic d2ViOndlYg==",
        "Bearer {token}x",
        "Bearer {prefix}",
        "Token {token}",
    ],
)
async def test_missing_or_wrong_token_changes_nothing(ops: Ops, authorization: str | None) -> None:
    before = ops.snapshot()
    headers = {}
    if authorization is not None:
        headers["Authorization"] = authorization.format(token=ops.token, prefix=ops.token[:-1])
    for method, path in (
        ("POST", "/v1/admin/workloads/web-1/quarantine"),
        ("POST", "/v1/admin/workloads/web-2/release"),
        ("GET", "/v1/admin/workloads"),
        ("GET", "/v1/admin/events"),
        ("GET", "/v1/admin/anything-else"),
    ):
        resp = await ops.client.request(method, path, json={}, headers=headers)
        await _refused(resp, 401, "unauthenticated")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert ops.snapshot() == before


async def test_a_foreign_host_name_is_refused(ops: Ops) -> None:
    # DNS rebinding: a name the attacker controls resolves to 127.0.0.1
    before = ops.snapshot()
    resp = await ops.client.post(
        "/v1/admin/workloads/web-1/quarantine",
        json={},
        headers={"Host": f"evil.example:{ops.client.port}", **ops.auth()},
    )
    await _refused(resp, 403, "host_refused")
    assert ops.snapshot() == before


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_a_body_that_is_not_json_is_415(ops: Ops, content_type: str) -> None:
    before = ops.snapshot()
    resp = await ops.client.post(
        "/v1/admin/workloads/web-1/quarantine",
        data=b'{"reason": "x"}',
        headers={"Content-Type": content_type, **ops.auth()},
    )
    await _refused(resp, 415, "unsupported_media_type")
    assert ops.snapshot() == before


@pytest.mark.parametrize("body", [b"{not json", b"[" * 30_000 + b"]" * 30_000, b"\xff\xfe"])
async def test_malformed_json_is_400_not_500(ops: Ops, body: bytes) -> None:
    resp = await ops.client.post(
        "/v1/admin/workloads/web-1/quarantine",
        data=body,
        headers={"Content-Type": "application/json", **ops.auth()},
    )
    await _refused(resp, 400, "request_malformed")
    assert ops.plane.cp.status_of("web-1") is Status.PENDING


# ---------------------------------------------------------------------------------------------
# the operator, with the token


async def test_with_the_token_the_operator_lists_quarantines_and_releases(ops: Ops) -> None:
    resp = await ops.client.get("/v1/admin/workloads?status=quarantined", headers=ops.auth())
    assert resp.status == 200
    assert [w["name"] for w in await resp.json()] == ["web-2"]
    resp = await ops.client.post(
        "/v1/admin/workloads/web-1/quarantine",
        json={"reason": "suspected compromise"},
        headers=ops.auth(),
    )
    assert resp.status == 200 and (await resp.json())["status"] == "quarantined"
    assert ops.plane.cp.state.get("web-1").quarantine.reason == "suspected compromise"
    # a POST without a body needs no content type
    resp = await ops.client.post("/v1/admin/workloads/web-2/release", headers=ops.auth())
    assert resp.status == 200 and (await resp.json())["status"] == "pending"
    resp = await ops.client.get("/v1/admin/events?workload=web-1", headers=ops.auth())
    assert [e["kind"] for e in await resp.json()][-1] == "quarantined"
    resp = await ops.client.post("/v1/admin/workloads/ghost/quarantine", headers=ops.auth())
    assert resp.status == 404


async def test_metrics_and_probes_stay_open(ops: Ops) -> None:
    for path in ("/metrics", "/healthz", "/readyz"):
        resp = await ops.client.get(path, headers={"Origin": EVIL})
        assert resp.status == 200, path
    resp = await ops.client.get("/metrics")
    assert "attestmesh_quarantined_workloads" in await resp.text()


# ---------------------------------------------------------------------------------------------
# the token file


def test_the_token_is_made_private_once_and_reused(tmp_path: Path) -> None:
    state_dir = tmp_path / "new" / "state"  # made if missing
    token = ensure_ops_token(state_dir)
    path = ops_token_path(state_dir)
    assert path == state_dir / "ops-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == token + "\n"
    assert len(token) == 43 and token.isascii()  # 32 random bytes, base64url without padding
    assert ensure_ops_token(state_dir) == token  # a restart reuses it
    assert ensure_ops_token(tmp_path / "other") != token
    assert sorted(p.name for p in state_dir.iterdir()) == ["ops-token"]  # no temporary left


def test_the_randomness_is_injected(tmp_path: Path) -> None:
    token = ensure_ops_token(tmp_path, random=lambda n: b"\xab" * n)
    assert token == "q6urq6urq6urq6urq6urq6urq6urq6urq6urq6urq6s"


def test_racing_creators_agree_on_one_token(tmp_path: Path) -> None:
    results: list[str] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        results.append(ensure_ops_token(tmp_path))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert (tmp_path / "ops-token").read_text() == results[0] + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ops-token"]


def test_a_token_others_can_read_is_refused(tmp_path: Path) -> None:
    ensure_ops_token(tmp_path)
    (tmp_path / "ops-token").chmod(0o644)
    with pytest.raises(AttestmeshError) as info:
        ensure_ops_token(tmp_path)
    assert info.value.reason == "ops_token_insecure" and "644" in info.value.detail


def test_a_file_that_is_not_a_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ops-token"
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(AttestmeshError) as info:
        ensure_ops_token(tmp_path)
    assert info.value.reason == "ops_token_invalid"


# ---------------------------------------------------------------------------------------------
# the CLI uses the same credential


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(cli_main, list(argv))


async def test_cli_authenticates_with_the_state_dir_or_a_token_file(
    ops: Ops, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = str(ops.client.port)
    state = str(ops.state_dir)
    assert await _cli("quarantine", "add", "web-1", "--ops-port", port, "--state-dir", state) == 0
    assert "web-1: quarantined" in capsys.readouterr().out
    token_file = tmp_path / "copied-token"
    token_file.write_text(ops.token + "\n")
    argv = ("--ops-port", port, "--ops-token-file", str(token_file))
    assert await _cli("quarantine", "list", *argv) == 0
    listed = capsys.readouterr().out
    assert "web-1\t" in listed and "web-2\t" in listed
    assert await _cli("quarantine", "release", "web-1", *argv) == 0
    assert "web-1: pending (released)" in capsys.readouterr().out


async def test_cli_without_or_with_a_wrong_token_is_a_clear_error(
    ops: Ops, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = str(ops.client.port)
    before = ops.snapshot()
    assert await _cli("quarantine", "add", "web-1", "--ops-port", port) == 2
    err = capsys.readouterr().err
    assert "ops_unauthenticated" in err and "is required" in err and "--state-dir" in err
    wrong = tmp_path / "wrong"
    ensure_ops_token(wrong)
    assert (
        await _cli("quarantine", "add", "web-1", "--ops-port", port, "--state-dir", str(wrong)) == 2
    )
    assert "ops token was refused" in capsys.readouterr().err
    assert await _cli("quarantine", "list", "--ops-port", port, "--state-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "ops_token_unreadable" in err and "Traceback" not in err
    assert ops.snapshot() == before
