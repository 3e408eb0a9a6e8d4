"""``attestmesh status``: the mesh at a glance (like ``istioctl proxy-status``).

One row per workload: namespace, TEE, a short measurement, status, when its newest certificate
expires, when it last attested, the xDS sync state of its node per type (``xds.sync_status``:
SYNCED, STALE, NACKED, NOT SENT; ``-`` without an open stream) and, when quarantined, the
trigger and reason (or, while a TCB change's grace period runs, when it will be quarantined
unless it re-attests). The control plane serves it on its ops port at ``/v1/admin/status`` (bearer
token, loopback: in Kubernetes mode reach it with ``kubectl port-forward``); ``--json`` prints
the rows as served.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from aiohttp import web

from xds import sync_status
from xds.state import MeshState

PATH = "/v1/admin/status"
XDS_TYPES = ("cds", "eds", "lds", "rds", "sds")
MEASUREMENT_KEYS = ("measurement", "mrtd", "mrenclave", "pcr0", "measurement_2")


def short_measurement(measurements: Mapping[str, str]) -> str:
    """The TEE's primary measurement, first 12 hex digits (``-`` when none)."""
    for key in MEASUREMENT_KEYS:
        if key in measurements:
            return measurements[key][:12]
    first = next(iter(sorted(measurements.items())), None)
    return first[1][:12] if first else "-"


def status_rows(
    state: MeshState, sync: Mapping[str, Mapping[str, str]], now: datetime
) -> list[dict[str, Any]]:
    """The status view of ``state`` (pure)."""
    rows = []
    for name in sorted(state.workloads):
        w = state.workloads[name]
        reg, rec, q, d = w.registration, w.attestation, w.quarantine, w.tcb_deferral
        newest = max((c.not_after for c in w.certificates), default=None)
        node = sync.get(name)
        rows.append(
            {
                "name": name,
                "namespace": reg.namespace,
                "spiffe_id": reg.spiffe_id(state.trust_domain),
                "tee": rec.tee if rec is not None else None,
                "measurement": short_measurement(rec.measurements) if rec is not None else None,
                "status": w.status.value,
                "certificate_expires": newest.isoformat() if newest is not None else None,
                "certificate_expires_in_s": (
                    int((newest - now).total_seconds()) if newest is not None else None
                ),
                "last_attested": rec.at.isoformat() if rec is not None else None,
                "xds": {
                    t: (node.get(t, sync_status.DISCONNECTED) if node is not None else None)
                    for t in XDS_TYPES
                },
                "xds_connected": node is not None,
                "quarantine": None
                if q is None
                else {"trigger": q.trigger.value, "reason": q.reason, "at": q.at.isoformat()},
                # a TCB change's deferred quarantine: at ``at`` unless it re-attests first
                "tcb_quarantine": None
                if d is None
                else {"at": d.due.isoformat(), "reason": d.reason, "revoked": d.revoked},
            }
        )
    return rows


def add_route(
    app: web.Application, state: Callable[[], MeshState], cache: Any, clock: Callable[[], datetime]
) -> None:
    """GET /v1/admin/status on the ops app (its guard applies)."""

    async def handle(request: web.Request) -> web.Response:
        return web.json_response(status_rows(state(), sync_status.node_states(cache), clock()))

    app.router.add_get(PATH, handle)


def _ago(seconds: float) -> str:
    s = int(abs(seconds))
    text = f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
    return text if seconds >= 0 else f"-{text}"


def render(rows: list[dict[str, Any]], now: datetime, out: TextIO) -> None:
    header = ["NAME", "NAMESPACE", "TEE", "MEASUREMENT", "STATUS", "CERT EXPIRES",
              "ATTESTED", *(t.upper() for t in XDS_TYPES), "QUARANTINE"]  # fmt: skip
    table = [header]
    for r in rows:
        expires = r["certificate_expires_in_s"]
        attested = r["last_attested"]
        xds = r["xds"] if r["xds_connected"] else {}
        q = r["quarantine"]
        d = r.get("tcb_quarantine")
        pending = ""
        if d:
            due = (datetime.fromisoformat(d["at"]) - now).total_seconds()
            pending = f"tcb: in {_ago(due)} unless re-attested: {d['reason']}"
        table.append(
            [
                r["name"],
                r["namespace"],
                r["tee"] or "-",
                r["measurement"] or "-",
                r["status"],
                f"in {_ago(expires)}" if expires is not None else "-",
                f"{_ago((now - datetime.fromisoformat(attested)).total_seconds())} ago"
                if attested
                else "-",
                *(xds.get(t) or sync_status.DISCONNECTED for t in XDS_TYPES),
                f"{q['trigger']}: {q['reason']}" if q else pending,
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)] + [row[-1]]
        out.write("  ".join(cells).rstrip() + "\n")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "status", help="every workload: TEE, measurement, status, certificate, xDS sync"
    )
    p.add_argument("--ops-port", type=int, default=9090, help="control plane ops port")
    p.add_argument("--state-dir", type=Path, help="the control plane's state dir (ops-token)")
    p.add_argument("--ops-token-file", type=Path, help="file holding the ops token")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from datetime import UTC

    from attestmesh.cli import _admin

    rows = _admin(args, "GET", PATH)
    if not isinstance(rows, list):
        out.write(f"unexpected answer from the control plane: {rows!r}\n")
        return 1
    if args.json:
        import json

        json.dump(rows, out, indent=2, sort_keys=True)
        out.write("\n")
    else:
        render(rows, datetime.now(UTC), out)
    return 0
