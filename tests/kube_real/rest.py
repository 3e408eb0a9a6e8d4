"""A thin REST helper over the real ``kubernetes`` ApiClient for the real-server tests: apply
any manifest by its apiVersion and kind (found through the server's own discovery), get,
list, patch and delete by path, and wait for a condition. Raw JSON in and out."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

T = TypeVar("T")


class Rest:
    def __init__(self, kubeconfig: Path) -> None:
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)  # type: ignore[no-untyped-call]
        self.api = client.ApiClient(cfg)
        self._discovery: dict[str, dict[str, tuple[str, bool]]] = {}

    def close(self) -> None:
        self.api.close()  # type: ignore[no-untyped-call]

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        method_, url, headers, body_, post = self.api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(method_, url, headers, body_, post, _request_timeout=30)
        resp.read()  # type: ignore[no-untyped-call]
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        data = resp.data
        return json.loads(data) if data else None

    def exact_status_of(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(the server's exact HTTP status, e.g. 201 for a create, decoded body)."""
        method_, url, headers, body_, post = self.api.param_serialize(
            method,
            path,
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self.api.call_api(method_, url, headers, body_, post, _request_timeout=30)
            resp.read()  # type: ignore[no-untyped-call]
            status, data = int(resp.status), resp.data
        except ApiException as exc:
            status, data = int(exc.status), exc.body
        try:
            return status, json.loads(data) if data else None
        except (TypeError, ValueError):
            return status, data

    def status_of(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        """(HTTP status, decoded body) without raising on an error status."""
        try:
            return 200, self.call(method, path, body, **kw)
        except ApiException as exc:
            try:
                return int(exc.status), json.loads(exc.body or "")
            except (TypeError, ValueError):
                return int(exc.status), exc.body

    # discovery-based paths

    def _resources(self, api_version: str) -> dict[str, tuple[str, bool]]:
        if api_version not in self._discovery:
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            found = self.call("GET", base)
            self._discovery[api_version] = {
                r["kind"]: (r["name"], bool(r["namespaced"]))
                for r in found["resources"]
                if "/" not in r["name"]
            }
        return self._discovery[api_version]

    def forget_discovery(self) -> None:
        self._discovery.clear()

    def path(self, api_version: str, kind: str, namespace: str | None, name: str = "") -> str:
        try:
            plural, namespaced = self._resources(api_version)[kind]
        except ApiException as exc:
            raise LookupError(f"the server does not serve {api_version}: {exc.status}") from None
        except KeyError:
            raise LookupError(f"the server does not serve {kind} in {api_version}") from None
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        if namespaced:
            base += f"/namespaces/{namespace or 'default'}"
        return f"{base}/{plural}" + (f"/{name}" if name else "")

    def doc_path(self, doc: Mapping[str, Any], *, named: bool = True) -> str:
        meta = doc.get("metadata") or {}
        return self.path(
            doc["apiVersion"], doc["kind"], meta.get("namespace"), meta["name"] if named else ""
        )

    def create(self, doc: Mapping[str, Any]) -> Any:
        return self.call("POST", self.doc_path(doc, named=False), dict(doc))

    def apply(self, doc: Mapping[str, Any]) -> Any:
        """Create, or replace (keeping the stored resourceVersion) if it exists."""
        try:
            return self.create(doc)
        except ApiException as exc:
            if exc.status != 409:
                raise
        current = self.call("GET", self.doc_path(doc))
        body = json.loads(json.dumps(doc))
        body.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
        return self.call("PUT", self.doc_path(doc), body)

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        return self.call("GET", self.path(api_version, kind, namespace, name))

    def get_or_none(self, api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        status, body = self.status_of("GET", self.path(api_version, kind, namespace, name))
        return body if status == 200 else None

    def items(self, api_version: str, kind: str, namespace: str | None = None) -> list[Any]:
        return list(self.call("GET", self.path(api_version, kind, namespace))["items"])

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Any,
        *,
        subresource: str = "",
        content_type: str = "application/merge-patch+json",
    ) -> Any:
        path = self.path(api_version, kind, namespace, name) + (
            f"/{subresource}" if subresource else ""
        )
        return self.call("PATCH", path, patch, content_type=content_type)

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        self.status_of("DELETE", self.path(api_version, kind, namespace, name))


def load_docs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        out += [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    return out


def wait_for(check: Callable[[], T | None], timeout: float = 20.0, what: str = "") -> T:
    """Poll ``check`` until it returns something truthy; its value."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception as exc:
            last, value = exc, None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or check}: {last}")


async def until(check: Callable[[], T | None], timeout: float = 20.0, what: str = "") -> T:  # noqa: ASYNC109
    """``wait_for`` for async tests: the check runs in a thread (it may call the API server,
    which may call back into a webhook served by this very event loop)."""
    import asyncio

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = await asyncio.to_thread(check)
        except Exception as exc:
            last, value = exc, None
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or check}: {last}")
