"""A fake Kubernetes API server that the real ``kubernetes`` Python client can talk to.

Kept only for what the real API servers the tests start (tests/kube_real: kube-apiserver
1.20.2, apiextensions-apiserver 1.36.4) cannot be made to produce: a failure answering one
chosen request (``fail``: a 500 on a TokenReview or a first list, a 503 on a read, a 409 on a
create that lost a race), a 410 ending an open watch at the moment a test chooses
(``compact(drop_watches=True)``), and discovery.k8s.io/v1 EndpointSlices (1.20 serves
v1beta1). Everything else runs against the real servers; what the remaining tests do not need
(strategic merge patch, evictions and disruption budgets, events.k8s.io) is gone.

It implements, over real HTTP, the slice of the REST protocol those tests use:

- list with ``metadata.resourceVersion`` (a global counter), label and field selectors;
- watch (``?watch=true``): newline-delimited JSON events ADDED/MODIFIED/DELETED, BOOKMARK when
  ``allowWatchBookmarks=true``, synthetic ADDED events for a watch without a resourceVersion,
  and an ERROR event with a 410 ``Expired`` Status when the resourceVersion is older than the
  compacted history (``compact()``), as the real server does;
- get, create (``generateName``), update (PUT, optimistic concurrency: 409 on a stale
  resourceVersion), delete;
- patch: JSON patch and JSON merge patch (anything else: 415);
- the ``status`` subresource: writes to the main resource keep status, writes to ``/status``
  change only status; ``metadata.generation`` moves only on spec changes;
- core/v1 events, coordination.k8s.io/v1 leases,
  authentication.k8s.io/v1 tokenreviews (tokens registered with ``add_token``; a token bound
  to a pod is answered as the real server answers a projected token: ``user.extra`` carries
  ``authentication.kubernetes.io/pod-name`` / ``pod-uid``, and the token is invalid once that
  pod is gone or replaced by another of the same name; a successful review is cached for
  ``token_cache_ttl``, 10 s, as the real server's; answers checked against kube-apiserver
  1.20.2's in ``tokenreview_1.20.2.json``), and the
  project's attestmesh.dev/v1alpha1 attestationpolicies and meshpolicies.

Errors are ``Status`` objects with the real reasons (NotFound, AlreadyExists, Conflict, Invalid,
Expired, TooManyRequests, UnsupportedMediaType). Every request is recorded in ``requests``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import copy
import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from tests.unit.inject.jsonpatch import PatchError, apply_patch


@dataclass(frozen=True, slots=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = False
    builtin: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        return f"{self.group}/{self.version}/{self.plural}"


RESOURCES = (
    ResourceType("", "v1", "pods", "Pod", True, True),
    ResourceType("", "v1", "nodes", "Node", False, True),
    ResourceType("", "v1", "namespaces", "Namespace", False, True),
    ResourceType("", "v1", "services", "Service", True, True),
    ResourceType("", "v1", "events", "Event", True),
    ResourceType("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
    ResourceType(
        "attestmesh.dev", "v1alpha1", "attestationpolicies", "AttestationPolicy", True, True, False
    ),
    ResourceType("attestmesh.dev", "v1alpha1", "meshpolicies", "MeshPolicy", True, True, False),
)

# Opt-in (``FakeKube(extra_resources=(CONFIGMAPS,))``): core/v1 ConfigMaps, no status
# subresource and no metadata.generation, as on a real server. Not served by default so that
# a test can still use them as a resource this server does not know.
CONFIGMAPS = ResourceType("", "v1", "configmaps", "ConfigMap", True)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        return status_object(self.code, self.reason, self.message, self.details)


def status_object(
    code: int, reason: str, message: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        out["details"] = details
    return out


@dataclass(slots=True)
class _Token:
    username: str
    uid: str  # the service account's uid, as the real server reports it
    groups: list[str]
    audiences: list[str]
    namespace: str
    pod: tuple[str, str] | None = None  # (name, uid) the token is bound to


@dataclass(slots=True)
class _Watch:
    rtype: ResourceType
    namespace: str | None


def _ts(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


_SET = re.compile(r"^([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)$")


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for req in _split_selector(selector):
        if m := _SET.match(req):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in" and labels.get(key) not in values:
                return False
            if op == "notin" and labels.get(key) in values:
                return False
        elif "!=" in req:
            k, v = (s.strip() for s in req.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in req:
            k, v = (s.strip() for s in req.replace("==", "=").split("=", 1))
            if labels.get(k) != v:
                return False
        elif req.startswith("!"):
            if req[1:].strip() in labels:
                return False
        elif req not in labels:
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def field_selector_matches(selector: str, obj: dict[str, Any]) -> bool:
    for req in _split_selector(selector):
        if "!=" in req:
            k, v = req.split("!=", 1)
            if _field(obj, k.strip()) == v.strip():
                return False
        else:
            k, v = req.replace("==", "=").split("=", 1)
            if _field(obj, k.strip()) != v.strip():
                return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeKube:
    """In-process API server. ``async with FakeKube() as kube: kube.url``."""

    def __init__(
        self,
        *,
        now: Callable[[], datetime] | None = None,
        bookmark_interval: float = 0.2,
        extra_resources: Iterable[ResourceType] = (),
        token_cache_ttl: timedelta = timedelta(seconds=10),
    ) -> None:
        self.now = now or (lambda: datetime.now(UTC))
        # kube-apiserver caches a successful token authentication (--token-success-cache-ttl,
        # 10 s by default, by token and audiences; failures are not cached): for that long a
        # deleted or replaced pod's token is still vouched for
        self.token_cache_ttl = token_cache_ttl
        self._token_cache: dict[tuple[str, tuple[str, ...]], tuple[datetime, dict[str, Any]]] = {}
        self.bookmark_interval = bookmark_interval
        self.types = {(r.group, r.version, r.plural): r for r in (*RESOURCES, *extra_resources)}
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.rv = 0
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []
        self.compacted = 0
        self.tokens: dict[str, _Token] = {}
        self._sa_uids: dict[tuple[str, str], str] = {}
        self.token_reviews: list[dict[str, Any]] = []  # the spec of every TokenReview asked
        self.fail_next: list[tuple[str, str, int]] = []
        self.requests: list[tuple[str, str, str]] = []
        self._changed = asyncio.Condition()
        self._closing = False
        self._epoch = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> FakeKube:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> str:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []  # aiohttp keeps them here
        port = int(sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        self._closing = True
        async with self._changed:
            self._changed.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()

    def configuration(self) -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return cfg

    # -- test controls -----------------------------------------------------------------------

    def add_token(
        self,
        token: str,
        namespace: str,
        service_account: str,
        audiences: Iterable[str] = ("attestmesh",),
        *,
        pod: str | None = None,
        pod_uid: str | None = None,
    ) -> None:
        """A service-account token. With ``pod``, bound to that pod as the kubelet's projected
        token is (TokenRequest with a Pod ``boundObjectRef``): the pod must exist, and its
        current uid is the claim unless ``pod_uid`` names another (an earlier pod's). Without
        ``pod``: an unbound token, as a legacy secret-based one (no pod claims)."""
        bound = None
        if pod is not None:
            obj = self.get("pods", namespace, pod)
            if obj is None and pod_uid is None:
                raise ValueError(f"no pod {namespace}/{pod} to bind a token to")
            bound = (pod, pod_uid or str((obj or {}).get("metadata", {}).get("uid")))
        self.tokens[token] = _Token(
            f"system:serviceaccount:{namespace}:{service_account}",
            self._sa_uids.setdefault((namespace, service_account), str(uuid.uuid4())),
            [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ],
            list(audiences),
            namespace,
            bound,
        )

    def expire_token_cache(self) -> None:
        """As if ``token_cache_ttl`` had passed: every TokenReview is decided afresh."""
        self._token_cache.clear()

    def fail(self, method: str, path_contains: str, code: int) -> None:
        """Answer the next matching request with ``code`` (a Status)."""
        self.fail_next.append((method, path_contains, code))

    def compact(self, *, drop_watches: bool = False) -> int:
        """Drop the watch history: watches from an older resourceVersion get 410 Gone. With
        ``drop_watches`` open watches also end with a 410 ERROR event (as when the server's
        watch cache is reset under them)."""
        self.compacted = self.rv
        self.history.clear()
        if drop_watches:
            self._epoch += 1
            self._notify_soon()
        return self.compacted

    def _notify_soon(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        task = asyncio.get_running_loop().create_task(notify())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def rtype(self, plural: str, group: str = "", version: str = "") -> ResourceType:
        for (g, v, p), r in self.types.items():
            if p == plural and g == group and (not version or v == version):
                return r
        raise KeyError(plural)

    def get(self, plural: str, namespace: str, name: str, group: str = "") -> dict[str, Any] | None:
        r = self.rtype(plural, group)
        obj = self.objects.get((r.key, namespace if r.namespaced else "", name))
        return copy.deepcopy(obj) if obj else None

    def list(
        self, plural: str, namespace: str | None = None, group: str = ""
    ) -> list[dict[str, Any]]:
        r = self.rtype(plural, group)
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self.objects.items())
            if k == r.key and (namespace is None or ns == namespace)
        ]

    async def put_object(self, plural: str, obj: dict[str, Any], group: str = "") -> dict[str, Any]:
        """Create or replace an object directly (a test's way to seed or change state)."""
        r = self.rtype(plural, group)
        meta = obj.get("metadata", {})
        key = (r.key, meta.get("namespace", "") if r.namespaced else "", meta["name"])
        if key in self.objects:
            current = self.objects[key]
            new = copy.deepcopy(obj)
            new["metadata"] = {**current["metadata"], **new.get("metadata", {})}
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            return await self._store(r, key, new, "MODIFIED", old=current)
        return await self._create(r, key[1], copy.deepcopy(obj))

    async def delete_object(self, plural: str, namespace: str, name: str, group: str = "") -> None:
        r = self.rtype(plural, group)
        await self._delete(r, namespace if r.namespaced else "", name)

    # -- storage -----------------------------------------------------------------------------

    async def _emit(self, r: ResourceType, kind: str, obj: dict[str, Any]) -> None:
        self.history.append((self.rv, r.key, kind, copy.deepcopy(obj)))
        async with self._changed:
            self._changed.notify_all()

    async def _create(self, r: ResourceType, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        if r.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match "
                    "the namespace sent on the request",
                )
            meta["namespace"] = namespace
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", f"{r.kind} metadata.name: Required value")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (r.key, namespace if r.namespaced else "", meta["name"])
        if key in self.objects:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{r.plural} "{meta["name"]}" already exists',
                {"name": meta["name"], "group": r.group, "kind": r.plural},
            )
        obj["apiVersion"], obj["kind"] = r.api_version, r.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _ts(self.now())
        if "spec" in obj or not r.builtin:
            meta["generation"] = 1
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        await self._emit(r, "ADDED", obj)
        return copy.deepcopy(obj)

    async def _store(
        self,
        r: ResourceType,
        key: tuple[str, str, str],
        new: dict[str, Any],
        kind: str,
        *,
        old: dict[str, Any],
    ) -> dict[str, Any]:
        meta = new.setdefault("metadata", {})
        meta["creationTimestamp"] = old["metadata"][
            "creationTimestamp"
        ]  # reset, as the server does
        for immutable in ("name", "namespace", "uid"):
            if immutable in old["metadata"]:
                if meta.get(immutable, old["metadata"][immutable]) != old["metadata"][immutable]:
                    raise ApiError(422, "Invalid", f"metadata.{immutable}: field is immutable")
                meta[immutable] = old["metadata"][immutable]
        if "generation" in old["metadata"]:
            gen = old["metadata"]["generation"]
            meta["generation"] = gen + 1 if new.get("spec") != old.get("spec") else gen
        new["apiVersion"], new["kind"] = r.api_version, r.kind
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)  # no-op writes do not bump the resourceVersion
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[key] = new
        await self._emit(r, kind, new)
        return copy.deepcopy(new)

    async def _delete(self, r: ResourceType, namespace: str, name: str) -> dict[str, Any]:
        key = (r.key, namespace, name)
        obj = self.objects.pop(key, None)
        if obj is None:
            raise ApiError(
                404,
                "NotFound",
                f'{r.plural} "{name}" not found',
                {"name": name, "group": r.group, "kind": r.plural},
            )
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        await self._emit(r, "DELETED", obj)
        return copy.deepcopy(obj)

    # -- HTTP --------------------------------------------------------------------------------

    def _route(
        self, path: str
    ) -> tuple[ResourceType | None, str | None, str | None, str | None, builtins.list[str]]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource {path}"
            )
        namespace: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        r = self.types.get((group, version, rest[0]))
        if r is None:
            return None, group, version, namespace, rest
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if len(rest) > 3 or (namespace is not None and not r.namespaced):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return r, namespace, name, sub, rest

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        ctype = request.headers.get("Content-Type", "")
        self.requests.append((request.method, request.path_qs, ctype))
        for i, (method, needle, code) in enumerate(self.fail_next):
            if method == request.method and needle in request.path_qs:
                del self.fail_next[i]
                reasons = {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}
                return web.json_response(
                    status_object(code, reasons.get(code, "Unknown"), "injected failure"),
                    status=code,
                )
        try:
            return await self._dispatch(request, ctype)
        except ApiError as exc:
            return web.json_response(exc.status(), status=exc.code)

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"invalid JSON body: {exc}") from None

    async def _dispatch(self, request: web.Request, ctype: str) -> web.StreamResponse:
        if request.path == "/apis/authentication.k8s.io/v1/tokenreviews":
            if request.method != "POST":
                raise ApiError(405, "MethodNotAllowed", "tokenreviews only support create")
            return web.json_response(self._token_review(await self._body(request)), status=201)
        r, namespace, name, sub, _ = self._route(request.path)
        if r is None:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource {request.path}"
            )
        ns = namespace or ""
        q = request.query
        if name is None:
            if request.method == "GET":
                if q.get("watch") in ("true", "1"):
                    return await self._watch(request, r, namespace)
                return web.json_response(self._list(r, namespace, q))
            if request.method == "POST":
                if r.namespaced and namespace is None:
                    raise ApiError(405, "MethodNotAllowed", "create needs a namespace")
                body = await self._body(request)
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "body must be an object")
                if r.status_subresource and r.builtin is False:
                    body.pop("status", None)
                return web.json_response(await self._create(r, ns, body), status=201)
            raise ApiError(405, "MethodNotAllowed", f"{request.method} not allowed on a collection")
        key = (r.key, ns, name)
        if sub not in (None, "status") or (sub == "status" and not r.status_subresource):
            raise ApiError(404, "NotFound", f"{r.plural} has no subresource {sub}")
        if request.method == "GET":
            obj = self.objects.get(key)
            if obj is None:
                raise ApiError(
                    404,
                    "NotFound",
                    f'{r.plural} "{name}" not found',
                    {"name": name, "group": r.group, "kind": r.plural},
                )
            return web.json_response(obj)
        if request.method == "DELETE":
            return web.json_response(await self._delete(r, ns, name))
        if request.method in ("PUT", "PATCH"):
            old = self.objects.get(key)
            if old is None:
                raise ApiError(
                    404,
                    "NotFound",
                    f'{r.plural} "{name}" not found',
                    {"name": name, "group": r.group, "kind": r.plural},
                )
            body = await self._body(request)
            if request.method == "PUT":
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "body must be an object")
                new, precondition = body, body.get("metadata", {}).get("resourceVersion")
            else:
                new, precondition = self._patched(r, old, body, ctype)
            if precondition and precondition != old["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {r.plural}.{r.group or "core"} "{name}": '
                    "the object has been modified; please apply your changes to the latest "
                    "version and try again",
                    {"name": name, "group": r.group, "kind": r.plural},
                )
            if r.status_subresource:
                if sub == "status":
                    new = {**copy.deepcopy(old), "status": new.get("status")}
                    if new["status"] is None:
                        new.pop("status")
                elif "status" in old:
                    new = {**new, "status": copy.deepcopy(old["status"])}
                else:
                    new.pop("status", None)
            new.setdefault("metadata", {})
            new["metadata"].pop("resourceVersion", None)
            meta = {**{k: v for k, v in old["metadata"].items() if k != "resourceVersion"}}
            if request.method == "PUT":
                for k in ("uid", "creationTimestamp", "generation", "namespace", "name"):
                    if k in meta:
                        new["metadata"].setdefault(k, meta[k])
            return web.json_response(await self._store(r, key, new, "MODIFIED", old=old))
        raise ApiError(405, "MethodNotAllowed", f"{request.method} not allowed")

    def _patched(
        self, r: ResourceType, old: dict[str, Any], body: Any, ctype: str
    ) -> tuple[dict[str, Any], str | None]:
        media = ctype.split(";")[0].strip()
        precondition = None
        if isinstance(body, dict) and isinstance(body.get("metadata"), dict):
            precondition = body["metadata"].get("resourceVersion")
        if media == "application/json-patch+json":
            if not isinstance(body, list):
                raise ApiError(400, "BadRequest", "json patch must be a list of operations")
            try:
                new = apply_patch(old, body)
            except (PatchError, KeyError, TypeError) as exc:
                raise ApiError(422, "Invalid", f"the JSON patch failed: {exc}") from None
            return new, None
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "patch body must be an object")
        if media == "application/merge-patch+json":
            return merge_patch(old, body), precondition
        raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {media!r}")

    def _list(self, r: ResourceType, namespace: str | None, q: Any) -> dict[str, Any]:
        items = [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self.objects.items())
            if k == r.key and (namespace is None or ns == namespace) and self._selected(o, q)
        ]
        return {
            "kind": f"{r.kind}List",
            "apiVersion": r.api_version,
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }

    @staticmethod
    def _selected(obj: dict[str, Any], q: Any) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        if q.get("labelSelector") and not label_selector_matches(q["labelSelector"], labels):
            return False
        return not (q.get("fieldSelector") and not field_selector_matches(q["fieldSelector"], obj))

    async def _watch(
        self, request: web.Request, r: ResourceType, namespace: str | None
    ) -> web.StreamResponse:
        q = request.query
        rv_text = q.get("resourceVersion", "")
        timeout = float(q.get("timeoutSeconds", "0") or 0) or 1800.0
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await resp.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())

        if rv_text in ("", "0"):
            start = self.rv
            for (k, ns, _), obj in sorted(self.objects.items()):
                if k == r.key and (namespace is None or ns == namespace) and self._selected(obj, q):
                    await send("ADDED", obj)
        else:
            try:
                start = int(rv_text)
            except ValueError:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv_text!r}") from None
            if start < self.compacted:
                await send(
                    "ERROR",
                    status_object(
                        410, "Expired", f"too old resource version: {start} ({self.compacted})"
                    ),
                )
                return resp
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_bookmark = loop.time()
        sent, epoch = start, self._epoch
        try:
            while not self._closing:
                if sent < self.compacted or epoch != self._epoch:
                    await send("ERROR", status_object(410, "Expired", "too old resource version"))
                    break
                snapshot, top = list(self.history), self.rv
                for rv, key, kind, obj in snapshot:
                    if rv <= sent or key != r.key:
                        continue
                    ns = obj.get("metadata", {}).get("namespace", "")
                    if (namespace is None or ns == namespace) and self._selected(obj, q):
                        await send(kind, obj)
                sent = max(sent, top)
                now = loop.time()
                if now >= deadline:
                    break
                if bookmarks and now - last_bookmark >= self.bookmark_interval:
                    last_bookmark = now
                    await send(
                        "BOOKMARK",
                        {
                            "kind": r.kind,
                            "apiVersion": r.api_version,
                            "metadata": {"resourceVersion": str(self.rv)},
                        },
                    )
                wait = min(deadline - now, self.bookmark_interval if bookmarks else deadline - now)
                async with self._changed:
                    if self.rv == sent and not self._closing and epoch == self._epoch:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), max(wait, 0.01))
        except ConnectionResetError:
            pass  # the client went away
        return resp

    def _bound_pod_invalid(self, token: _Token) -> str:
        """Why a pod-bound token no longer validates ("" when it does): the real server looks
        the pod up on every review (kube-apiserver 1.20 pkg/serviceaccount/claims.go)."""
        if token.pod is None:
            return ""
        obj = self.get("pods", token.namespace, token.pod[0])
        if obj is None:
            return "Token has been invalidated"
        uid = obj["metadata"]["uid"]
        return (
            "" if uid == token.pod[1] else f"Pod UID ({uid}) does not match claim ({token.pod[1]})"
        )

    def _token_review(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or body.get("kind", "TokenReview") != "TokenReview":
            raise ApiError(
                400, "BadRequest", "body must be an authentication.k8s.io/v1 TokenReview"
            )
        spec = body.get("spec") or {}
        self.token_reviews.append(copy.deepcopy(spec))
        token = spec.get("token")
        if not isinstance(token, str) or not token:
            raise ApiError(422, "Invalid", "spec.token: Required value")
        wanted = spec.get("audiences") or ["https://kubernetes.default.svc.cluster.local"]
        key = (token, tuple(wanted))
        cached = self._token_cache.get(key)
        if cached is not None and cached[0] > self.now():
            return self._review(spec, copy.deepcopy(cached[1]))
        # the real server omits ``authenticated`` (false) and ``audiences`` from a refusal
        status: dict[str, Any] = {"user": {}}
        known = self.tokens.get(token)
        if known is None:
            status["error"] = (
                "[invalid bearer token, square/go-jose: error in cryptographic primitive]"
            )
        else:
            common = [a for a in wanted if a in known.audiences]
            invalid = self._bound_pod_invalid(known)
            if not common:
                status["error"] = (
                    f"[invalid bearer token, token audiences {json.dumps(known.audiences)} is "
                    f"invalid for the target audiences {json.dumps(wanted)}]"
                )
            elif invalid:
                status["error"] = f"[invalid bearer token, {invalid}]"
            else:
                user: dict[str, Any] = {
                    "username": known.username,
                    "uid": known.uid,
                    "groups": known.groups,
                }
                if known.pod is not None:
                    user["extra"] = {
                        "authentication.kubernetes.io/pod-name": [known.pod[0]],
                        "authentication.kubernetes.io/pod-uid": [known.pod[1]],
                    }
                status = {"authenticated": True, "user": user, "audiences": common}
                if self.token_cache_ttl:
                    self._token_cache[key] = (self.now() + self.token_cache_ttl, status)
        return self._review(spec, copy.deepcopy(status))

    @staticmethod
    def _review(spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        return {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }


__all__ = [
    "CONFIGMAPS",
    "RESOURCES",
    "ApiError",
    "FakeKube",
    "ResourceType",
    "field_selector_matches",
    "label_selector_matches",
    "merge_patch",
    "status_object",
]
