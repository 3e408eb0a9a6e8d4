"""``attestmesh`` with the agent's Nitro evidence source on the test NSM: the production
``NitroSource`` -> ``NsmCollector`` -> ``DevNsm`` path, whose ioctl is the test driver
(``tests.nitro_fake.nsm.ioctl``) on the ``--device`` file. Everything else is ``attestmesh``."""

from __future__ import annotations

import sys
from pathlib import Path

from attestmesh import agent_cmd, cli
from certs.errors import AttestmeshError
from sidecar.agent import EvidenceSource
from sidecar.collectors import NitroSource
from sidecar.tee.nitro_nsm import DevNsm, NsmCollector
from tests.nitro_fake import nsm


def test_device_source(tee: str, device: Path | None = None) -> EvidenceSource:
    if tee != "nitro" or device is None:
        raise AttestmeshError("usage", "the test NSM agent runs --tee nitro --device FILE")
    return NitroSource(NsmCollector(DevNsm(device, ioctl=nsm.ioctl)))


if __name__ == "__main__":
    agent_cmd.device_source = test_device_source  # type: ignore[attr-defined]
    sys.exit(cli.main())
