"""run_control_plane holds automatic cycle collection during start-up (gcpolicy.hold_collections)
and never leaves it off: GcPolicy ends the hold once serving, and a start-up that fails ends it
too."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import free_port
from attestmesh.serve import ControlPlaneSettings, Running, run_control_plane
from certs.errors import AttestmeshError
from tests.unit.fixtures_core import policy_doc


def _settings(tmp_path: Path, policy: Path) -> ControlPlaneSettings:
    pub = tmp_path / "platform.pub"
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    pub.write_bytes(key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    workloads = tmp_path / "workloads.yaml"
    workloads.write_text(yaml.safe_dump({"workloads": [
        {"name": "web-1", "serviceAccount": "web", "service": "web",
         "inbound": "127.0.0.1:15001", "appPort": 8080},
    ]}))  # fmt: skip
    return ControlPlaneSettings(
        state_dir=tmp_path / "state", policy_file=policy, registrations_file=workloads,
        allow_unauthenticated_registrations=True, api_port=free_port(),
        xds_port=free_port(), ops_port=free_port(), sim_platform_keys=(pub,),
    )  # fmt: skip


async def test_collection_is_on_again_once_the_control_plane_serves(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(policy_doc()))
    assert gc.isenabled()
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_control_plane(_settings(tmp_path, policy), stop, ready))
    try:
        await asyncio.wait_for(ready, 20)
        for _ in range(100):  # GcPolicy starts in the serving task group
            if gc.isenabled():
                break
            await asyncio.sleep(0.05)
        assert gc.isenabled()
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert gc.isenabled()


async def test_a_failed_start_up_leaves_collection_on(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("kind: AttestationPolicy\nspec: [not, a, mapping]\n")
    assert gc.isenabled()
    with pytest.raises((AttestmeshError, ValueError, TypeError)):
        await run_control_plane(_settings(tmp_path, policy), asyncio.Event())
    assert gc.isenabled()
