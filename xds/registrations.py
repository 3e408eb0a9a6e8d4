"""Local-mode workload registrations (in Kubernetes they come from Pods). Strict parser."""

from __future__ import annotations

import re
from typing import Any

from certs.errors import PolicyError
from xds.state import Endpoint, Registration

_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # used with fullmatch: no trailing "\n"
_PORT = re.compile(r"[0-9]{1,5}")
# an outbound service: "name" (the caller's namespace) or "name.namespace" (explicitly another)
_SERVICE_REF = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)?")
_FIELDS = {
    "name",
    "namespace",
    "serviceAccount",
    "service",
    "inbound",
    "appPort",
    "outbound",
    "labels",
    "tokenSha256",
}


def _port(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536:
        return value
    return None


def parse_endpoint(text: Any) -> Endpoint | None:
    if not isinstance(text, str) or ":" not in text:
        return None
    host, _, port = text.rpartition(":")
    p = _port(int(port)) if _PORT.fullmatch(port) else None
    return Endpoint(host.strip("[]"), p) if host and p else None


def parse_registrations(doc: Any) -> tuple[Registration, ...]:
    """``{workloads: [...]}`` -> registrations; raise PolicyError listing every problem."""
    problems: list[str] = []
    items = doc.get("workloads") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise PolicyError(["workloads: must be a list"])
    out: list[Registration] = []
    for i, item in enumerate(items):
        where = f"workloads[{i}]"
        known = len(problems)
        if not isinstance(item, dict):
            problems.append(f"{where}: must be an object")
            continue
        for key in sorted(set(item) - _FIELDS):
            problems.append(f"{where}.{key}: unknown field")
        name = item.get("name")
        ns = item.get("namespace", "default")
        sa = item.get("serviceAccount", name)
        service = item.get("service", name)
        for field_name, value in (
            ("name", name),
            ("namespace", ns),
            ("serviceAccount", sa),
            ("service", service),
        ):
            if not isinstance(value, str) or not _NAME.fullmatch(value):
                problems.append(f"{where}.{field_name}: must be a DNS-1123 label")
        inbound = parse_endpoint(item.get("inbound"))
        if inbound is None:
            problems.append(f"{where}.inbound: must be host:port")
        app_port = _port(item.get("appPort"))
        if app_port is None:
            problems.append(f"{where}.appPort: must be a port number")
        outbound_raw = item.get("outbound", {})
        outbound: dict[str, int] = {}
        if not isinstance(outbound_raw, dict):
            problems.append(f"{where}.outbound: must map service names to local ports")
        else:
            for svc, port in outbound_raw.items():
                p = _port(port)
                if not isinstance(svc, str) or not _SERVICE_REF.fullmatch(svc) or p is None:
                    problems.append(
                        f"{where}.outbound.{svc}: needs a service (name, or name.namespace for "
                        "another namespace) and a port"
                    )
                else:
                    outbound[svc] = p
        token = item.get("tokenSha256")
        if token is not None and not (
            isinstance(token, str) and re.fullmatch(r"[0-9a-f]{64}", token)
        ):
            problems.append(f"{where}.tokenSha256: must be 64 lowercase hex characters")
        labels = item.get("labels", {})
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            problems.append(f"{where}.labels: must map strings to strings")
            labels = {}
        if len(problems) > known or inbound is None or app_port is None:
            continue
        out.append(
            Registration(
                name=str(name),
                namespace=str(ns),
                service_account=str(sa),
                service=str(service),
                inbound=inbound,
                app_port=app_port,
                outbound=outbound,
                labels=dict(labels),
                token_sha256=token,
            )
        )
    seen: set[str] = set()
    twice: set[str] = set()
    for r in out:
        (twice if r.name in seen else seen).add(r.name)
    problems += [f"{n}: registered more than once" for n in sorted(twice)]
    if problems:
        raise PolicyError(problems)
    return tuple(out)
