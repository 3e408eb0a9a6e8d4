"""xDS sync state per node and type, for ``attestmesh status`` (like ``istioctl proxy-status``).

The ADS server registers each open stream's session here (per snapshot cache, so several
control planes in one process stay apart); ``node_states`` reads the sessions' protocol state:

* ``SYNCED``: the last response of that type was ACKed (or nothing was due);
* ``STALE``: a response was sent and not answered yet;
* ``NACKED``: the client rejected the last response (it keeps its previous configuration);
* ``NOT SENT``: subscribed, nothing sent yet.

A node with no open stream has no entry: ``DISCONNECTED`` in the status view.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

SYNCED, STALE, NACKED, NOT_SENT, DISCONNECTED = "SYNCED", "STALE", "NACKED", "NOT SENT", "-"

_open: weakref.WeakKeyDictionary[Any, dict[str, list[Any]]] = weakref.WeakKeyDictionary()


def opened(cache: Any, node: str, session: Any) -> None:
    _open.setdefault(cache, {}).setdefault(node, []).append(session)


def closed(cache: Any, node: str, session: Any) -> None:
    streams = _open.get(cache, {}).get(node)
    if streams is None:
        return
    if session in streams:
        streams.remove(session)
    if not streams:
        del _open[cache][node]


def _sotw_states(session: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for type_url, st in session._types.items():
        if not st.subscribed:
            continue
        if not st.sent:
            out[type_url.short] = NOT_SENT
            continue
        last = st.sent[next(reversed(st.sent))]
        out[type_url.short] = NACKED if last.nacked else SYNCED if last.acked else STALE
    return out


def _delta_states(session: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for type_url, st in session._types.items():
        if st.rejected:
            out[type_url.short] = NACKED
        elif st.sent:
            out[type_url.short] = STALE
        else:
            out[type_url.short] = SYNCED
    return out


def session_states(session: Any) -> dict[str, str]:
    """One stream's state per type (short type names: cds, eds, lds, rds, sds)."""
    if session.__class__.__name__ == "DeltaSession":
        return _delta_states(session)
    return _sotw_states(session)


def node_states(cache: Any) -> Mapping[str, dict[str, str]]:
    """node -> type -> state, over the node's open streams (the newest stream wins)."""
    out: dict[str, dict[str, str]] = {}
    for node, sessions in list(_open.get(cache, {}).items()):
        merged: dict[str, str] = {}
        for session in sessions:
            merged.update(session_states(session))
        out[node] = merged
    return out
