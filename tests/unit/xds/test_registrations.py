from __future__ import annotations

from typing import Any

import pytest

from certs.errors import PolicyError
from xds.registrations import parse_endpoint, parse_registrations
from xds.state import Endpoint, Registration

TOKEN = "0123456789abcdef" * 4


def _item(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "web-1", "inbound": "127.0.0.1:15001", "appPort": 8080}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


def _problems(doc: Any) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_registrations(doc)
    return info.value.problems


def test_valid_registrations() -> None:
    full = _item(
        name="web-1",
        namespace="shop",
        serviceAccount="web",
        service="web",
        inbound="10.0.0.7:15006",
        appPort=8080,
        outbound={"db": 15101, "cache": 15102},
        labels={"app": "web", "tier": "front"},
        tokenSha256=TOKEN,
    )
    minimal = _item(name="db-0", inbound="[::1]:15001", appPort=5432)
    assert parse_registrations({"workloads": [full, minimal]}) == (
        Registration(
            name="web-1",
            namespace="shop",
            service_account="web",
            service="web",
            inbound=Endpoint("10.0.0.7", 15006),
            app_port=8080,
            outbound={"db": 15101, "cache": 15102},
            labels={"app": "web", "tier": "front"},
            token_sha256=TOKEN,
        ),
        Registration(
            name="db-0",
            namespace="default",
            service_account="db-0",  # defaults to the name
            service="db-0",
            inbound=Endpoint("::1", 15001),
            app_port=5432,
        ),
    )
    assert parse_registrations({"workloads": []}) == ()


@pytest.mark.parametrize("doc", [None, [], {"workloads": {}}, {"workload": []}, "x"])
def test_the_document_must_hold_a_list(doc: Any) -> None:
    assert _problems(doc) == ["workloads: must be a list"]


def test_every_problem_of_an_item_is_listed() -> None:
    bad = {
        "name": "Web_1",
        "namespace": 7,
        "serviceAccount": "",
        "service": "web.default",
        "inbound": "nohost",
        "appPort": 70000,
        "outbound": {"db": 0, "Bad": 15001},
        "tokenSha256": TOKEN.upper(),
        "labels": ["a"],
        "colour": "red",
    }
    assert _problems({"workloads": [bad]}) == [
        "workloads[0].colour: unknown field",
        "workloads[0].name: must be a DNS-1123 label",
        "workloads[0].namespace: must be a DNS-1123 label",
        "workloads[0].serviceAccount: must be a DNS-1123 label",
        "workloads[0].service: must be a DNS-1123 label",
        "workloads[0].inbound: must be host:port",
        "workloads[0].appPort: must be a port number",
        "workloads[0].outbound.db: needs a service (name, or name.namespace for another namespace) and a port",
        "workloads[0].outbound.Bad: needs a service (name, or name.namespace for another namespace) and a port",
        "workloads[0].tokenSha256: must be 64 lowercase hex characters",
        "workloads[0].labels: must map strings to strings",
    ]


def test_problems_of_every_item_and_duplicates_are_listed_together() -> None:
    # A problem in the first item must not hide the duplicate among the later ones.
    doc = {"workloads": ["not an object", _item(name="a"), _item(name="a"), _item(name="b")]}
    assert _problems(doc) == ["workloads[0]: must be an object", "a: registered more than once"]


def test_each_duplicated_name_is_listed_once_in_order() -> None:
    names = ["c", "a", "c", "b", "c", "a", "d"]
    doc = {"workloads": [_item(name=n) for n in names]}
    assert _problems(doc) == ["a: registered more than once", "c: registered more than once"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "web\n"),  # a trailing newline must not pass as a DNS label
        ("namespace", "shop\n"),
        ("service", 42),
        ("service", {"a": 1}),
        ("labels", {"app": 1}),
        ("labels", {"app": None}),
        ("outbound", {"db\n": 15001}),
        ("outbound", {"db": True}),
        ("outbound", ["db"]),
        ("appPort", True),
        ("appPort", "8080"),
        ("inbound", 15001),
    ],
)
def test_invalid_values_are_problems(field: str, value: Any) -> None:
    item = _item(serviceAccount="web", service="web")  # not derived from the name
    item[field] = value
    problems = _problems({"workloads": [item]})
    assert len(problems) == 1 and problems[0].startswith(f"workloads[0].{field}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:15001", Endpoint("127.0.0.1", 15001)),
        ("[::1]:80", Endpoint("::1", 80)),
        ("web.default.svc:65535", Endpoint("web.default.svc", 65535)),
        ("host:0", None),
        ("host:65536", None),
        ("host:", None),
        (":80", None),
        ("host", None),
        ("host:http", None),
        ("host:\u00b2", None),  # a Unicode digit: str.isdigit() is true, int() refuses
        ("host:\u0661\u0662", None),  # Arabic-Indic digits
        ("host:-1", None),
        ("host: 80", None),
        (None, None),
        (80, None),
    ],
)
def test_parse_endpoint(text: Any, expected: Endpoint | None) -> None:
    assert parse_endpoint(text) == expected


def test_unicode_digit_port_is_a_problem_not_a_crash() -> None:
    assert _problems({"workloads": [_item(inbound="127.0.0.1:\u00b2")]}) == [
        "workloads[0].inbound: must be host:port"
    ]
