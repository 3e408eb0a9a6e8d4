"""The seam to the API server: the real ``kubernetes`` client, run in worker threads.

The ``kubernetes`` client is synchronous; every call runs in a worker thread and answers raw
JSON (``_preload_content=False``), so the adapter works on the same dicts the API server sends.
Its errors become ``KubeError`` (``status``: the HTTP status, 0 when nothing answered).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from certs.errors import AttestmeshError


class KubeError(AttestmeshError):
    """A Kubernetes API call failed. ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, reason: str, detail: str = "", status: int = 0) -> None:
        super().__init__(reason, detail)
        self.status = status


Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], datetime]


class KubeClient:
    """The seam to the API server: the real ``kubernetes`` client, run in threads, raw JSON."""

    def __init__(self, api_client: Any, *, request_timeout: float = 10.0) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.discovery = client.DiscoveryV1Api(api_client)
        self.auth = client.AuthenticationV1Api(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)
        self.request_timeout = request_timeout

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call an API method in a worker thread; return the decoded JSON body."""
        from kubernetes.client.exceptions import ApiException

        def run() -> Any:
            resp = fn(
                *args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs
            )
            data = resp.data if hasattr(resp, "data") else resp.read()
            return json.loads(data) if data else None

        try:
            return await asyncio.to_thread(run)
        except ApiException as exc:
            raise translate(exc) from None
        except (OSError, ValueError) as exc:
            raise KubeError("kube_unreachable", str(exc)) from None
        except Exception as exc:  # urllib3's errors are not OSError subclasses
            if type(exc).__module__.startswith("urllib3"):
                raise KubeError("kube_unreachable", str(exc)) from None
            raise


def translate(exc: Any) -> KubeError:
    """An ``ApiException`` (or a watch stream's error status) -> ``KubeError``."""
    status = int(getattr(exc, "status", 0) or 0)
    reason = {
        404: "not_found",
        409: "conflict",
        410: "gone",
        422: "invalid",
        429: "too_many_requests",
        403: "forbidden",
    }.get(status, "api_error")
    body = getattr(exc, "body", None) or getattr(exc, "reason", "")
    try:
        message = json.loads(body).get("message", body) if isinstance(body, str | bytes) else body
    except ValueError:
        message = body
    return KubeError(reason, str(message), status)


class KubeConfigError(AttestmeshError):
    """No usable Kubernetes client configuration."""


def connect(kubeconfig: Path | None, request_timeout: float = 10.0) -> KubeClient:
    """A client from a kubeconfig file, or the in-cluster service account when None."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig is not None:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig), client_configuration=cfg
            )
        else:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError, ValueError) as exc:
        where = str(kubeconfig) if kubeconfig else "the in-cluster service account"
        raise KubeConfigError(
            "kube_config_invalid", f"cannot load Kubernetes configuration from {where}: {exc}"
        ) from None
    return KubeClient(client.ApiClient(cfg), request_timeout=request_timeout)


__all__ = ["Clock", "KubeClient", "KubeConfigError", "KubeError", "Sleep", "connect", "translate"]
