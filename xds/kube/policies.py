"""Custom resources -> the policies in force. Pure.

Each CR is parsed on its own: an invalid one is refused (its problems listed) and its previous
valid version stays in force; a deleted one leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from certs.errors import PolicyError
from xds.kube.workloads import object_key
from xds.secretpolicy import SecretPolicy, parse_secret_policies


def clean(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a CR the parsers read (server-set metadata dropped)."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "generation", "labels") if k in meta
        },
        "spec": obj.get("spec"),
    }


@dataclass(frozen=True, slots=True)
class Refused:
    namespace: str
    name: str
    generation: int | None
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reconciled:
    """Policies in force (valid current versions, or the last valid version of a refused
    resource), and the resources refused this round."""

    in_force: Mapping[tuple[str, str], Any]
    accepted: tuple[tuple[str, str, int | None], ...]
    refused: tuple[Refused, ...]


def reconcile(
    objects: Sequence[Mapping[str, Any]],
    previous: Mapping[tuple[str, str], Any],
    parse: Callable[[list[Any]], Sequence[Any]],
) -> Reconciled:
    """Parse each CR on its own; a refused CR keeps its previous valid version in force; a
    deleted CR leaves. Pure."""
    in_force: dict[tuple[str, str], Any] = {}
    accepted: list[tuple[str, str, int | None]] = []
    refused: list[Refused] = []
    for obj in objects:
        key = object_key(obj)
        gen = (obj.get("metadata") or {}).get("generation")
        gen = gen if isinstance(gen, int) else None
        try:
            (policy,) = parse([clean(obj)])
        except PolicyError as exc:
            refused.append(Refused(key[0], key[1], gen, tuple(exc.problems)))
            if key in previous:
                in_force[key] = previous[key]
            continue
        in_force[key] = policy
        accepted.append((key[0], key[1], gen))
    return Reconciled(in_force, tuple(accepted), tuple(refused))


def parse_secret_policy(docs: list[Any]) -> Sequence[SecretPolicy]:
    """SecretPolicy documents -> policies (the parser ``reconcile`` takes)."""
    return parse_secret_policies(docs)


__all__ = ["Reconciled", "Refused", "clean", "parse_secret_policy", "reconcile"]
