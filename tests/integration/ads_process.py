"""An ADS server in a process of its own, serving fixed snapshots from a JSON file, so that
integration tests can kill it (SIGKILL: connections die as in a crash) and start it again, as a
control plane restarts. It has no state but the file: whatever a restarted server avoids
resending, it learnt from the client (``initial_resource_versions``).

    python -m tests.integration.ads_process SNAPSHOTS.json PORT

Prints ``READY`` once listening.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from attestmesh.metrics import Metrics
from xds.build import Snapshot
from xds.cache import SnapshotCache
from xds.resources import TypeUrl
from xds.server import start_ads


def dump_snapshots(snapshots: Mapping[str, Snapshot], path: Path) -> None:
    doc = {
        node: {
            "resources": {
                str(t): {n: base64.b64encode(b).decode() for n, b in s.get(t).items()}
                for t in TypeUrl
            },
            "references": {str(t): sorted(names) for t, names in s.references.items()},
        }
        for node, s in snapshots.items()
    }
    path.write_text(json.dumps(doc))


def load_snapshots(path: Path) -> dict[str, Snapshot]:
    out = {}
    for node, doc in json.loads(path.read_text()).items():
        resources = {
            TypeUrl(t): {n: base64.b64decode(b) for n, b in named.items()}
            for t, named in doc["resources"].items()
        }
        references = {TypeUrl(t): frozenset(names) for t, names in doc["references"].items()}
        out[node] = Snapshot.of(resources, references)
    return out


async def serve(path: Path, port: int) -> None:
    cache = SnapshotCache()
    cache.set_snapshots(load_snapshots(path))
    server, _ = await start_ads(cache, "127.0.0.1", port, Metrics())
    print("READY", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        server.close()


def main(argv: list[str]) -> None:
    asyncio.run(serve(Path(argv[0]), int(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
