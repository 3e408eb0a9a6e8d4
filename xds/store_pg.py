"""The PostgreSQL store: the same seam as ``SqliteStore``, for several control-plane replicas.

``PostgresStore`` is the synchronous backend (one connection, one transaction per commit, the
server's ``synchronous_commit`` decides durability: on by default, so a commit that returned is
in the server's WAL on disk). ``GroupCommitStore(PostgresStore(url))`` is what the control
plane runs: one writer thread, every batch waiting committed in one transaction.

Rows are the ones ``SqliteStore`` writes (``_Rows``: one JSON document per workload, serials and
timestamps as text), in bulk statements over arrays (``unnest``): one round trip per statement,
whatever the batch size.

Schema changes are ordered ``Migration``s (``PG_MIGRATIONS``) applied at open in one
transaction under a transaction-scoped advisory lock, so replicas starting together migrate
once; the applied versions are rows of ``schema_version``; a database written by newer code is
refused (``StoreError('store_schema_too_new')``) and a failing migration changes nothing
(PostgreSQL's DDL is transactional).

A connection that breaks (server restart, network) fails the commit in progress
(``store_commit_failed``: nothing of it is applied, or it was applied and the caller cannot
know; the control plane fails stop either way) and is replaced on the next use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from xds.state import Event, MeshState, Revocation, Revocations, WorkloadState
from xds.store import (
    _KIND,
    _TRIGGER,
    DEFAULT_MAX_EVENTS,
    CommitBackend,
    CountedBackend,
    GroupCommitStore,
    Migration,
    SqliteStore,
    StateStore,
    StoreConflict,
    StoreError,
    StoreReader,
    _from_iso,
    _Rows,
    decide_group,
    expected_names,
    workload_from_doc,
)

log = logging.getLogger(__name__)

__all__ = [
    "PG_MIGRATIONS",
    "PG_SCHEMA_VERSION",
    "ChangeFeed",
    "Changes",
    "Leadership",
    "Position",
    "PostgresStore",
    "StoredCrl",
    "download_ca",
    "follow",
    "follow_notifications",
    "is_postgres_url",
    "migrate_pg",
    "open_store",
    "pg_schema_version",
    "publish_ca",
    "read_crl",
    "read_rows",
    "redact_url",
    "revocations_at",
    "revoked_since",
    "share_ca",
    "store_crl",
]

# pg_advisory_xact_lock key serialising schema migrations ("attestms" in ASCII)
MIGRATION_LOCK = 0x6174_7465_7374_6D73
# the first key of the two-key advisory locks taken per workload name (hashtext) by a commit
ROW_LOCK_SPACE = 0x616D_7277  # "amrw"
# Changes are read in the order of their transaction ids, only below the oldest transaction
# still running (pg_snapshot_xmin): a change below that horizon never appears later, so commits
# need no lock of their own to be followed (a global one serialised every replica's commits,
# fsync included). A follower's position: (xid, seq) of the last change it delivered.
Position = tuple[int, int]
XMIN = "pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
CHANNEL = "attestmesh_changes"
CA_LOCK = 0x6174_6361  # serialises the first upload of the CA
LEADER_LOCK = 0x6174_6C65_6164_6572  # session lock: held by the leader's connection
# the CA directory's files shared through the database (certs.ca's layout)
CA_FILES = (
    "root.pem",
    "root.key",
    "intermediate.pem",
    "intermediate.key",
    "intermediate-next.json",
    "intermediate-previous.json",
)
DEFAULT_MAX_CHANGES = 100_000
CONNECT_TIMEOUT_SECONDS = 5
# a connection whose server went silent (cut off, not closed) fails within ~5 s instead of
# waiting for TCP's retransmissions (minutes): unacknowledged data, and idle keepalives
# and a session that stops inside a transaction (its replica frozen, or stuck between two
# statements) is ended by the server after IDLE_IN_TRANSACTION_MS, so the row locks it holds
# stop blocking the other replicas' decisions
IDLE_IN_TRANSACTION_MS = 10_000
LIVENESS: dict[str, Any] = {
    "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
    "tcp_user_timeout": 5000,
    "keepalives": 1,
    "keepalives_idle": 3,
    "keepalives_interval": 1,
    "keepalives_count": 2,
}

PG_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "workloads, revocations and the event log (with typed reasons)",
        (
            "CREATE TABLE workloads (name text PRIMARY KEY, doc text NOT NULL)",
            "CREATE TABLE revocations (serial text PRIMARY KEY, workload text NOT NULL, "
            "not_after text NOT NULL, revoked_at text NOT NULL)",
            "CREATE TABLE events (id bigserial PRIMARY KEY, at text NOT NULL, kind text NOT NULL, "
            "workload text NOT NULL, trigger text, reason text NOT NULL, "
            "code text NOT NULL DEFAULT '', platform integer NOT NULL DEFAULT 0)",
            "CREATE INDEX events_by_workload ON events(workload, id)",
        ),
    ),
    Migration(
        2,
        "the change log other replicas follow (LISTEN attestmesh_changes + catch-up by seq)",
        (
            "CREATE TABLE changes (seq bigserial PRIMARY KEY, kind text NOT NULL, "
            "key text NOT NULL, origin text NOT NULL)",
        ),
    ),
    Migration(
        3,
        "the mesh CA every replica signs with (one trust): its files, as the CA directory holds",
        ("CREATE TABLE ca_files (name text PRIMARY KEY, data bytea NOT NULL)",),
    ),
    Migration(
        4,
        "workload documents may carry a deferred TCB quarantine (tcb_deferral: its deadline); "
        "no DDL: the version keeps older code, which would drop the field when it rewrites a "
        "row, from opening the database",
        (),
    ),
    Migration(
        5,
        "the CRL set the leader signs and every replica serves (one row: the latest)",
        (
            "CREATE TABLE crl (id integer PRIMARY KEY CHECK (id = 1), number bigint NOT NULL, "
            "pem bytea NOT NULL, signed_at text NOT NULL, covers bigint NOT NULL, "
            "revoked integer NOT NULL, origin text NOT NULL)",
        ),
    ),
    Migration(
        6,
        "changes are followed in transaction order below the oldest running transaction (no "
        "lock serialising commits): each change records its transaction id; the last pruned "
        "position is kept",
        (
            "ALTER TABLE changes ADD COLUMN xid xid8 NOT NULL DEFAULT pg_current_xact_id()",
            "CREATE INDEX changes_by_xid ON changes(xid, seq)",
            "CREATE TABLE changes_pruned (id integer PRIMARY KEY CHECK (id = 1), "
            "xid bigint NOT NULL, seq bigint NOT NULL)",
        ),
    ),
)
PG_SCHEMA_VERSION = PG_MIGRATIONS[-1].version


def is_postgres_url(spec: str) -> bool:
    return spec.startswith(("postgresql://", "postgres://"))


def redact_url(url: str) -> str:
    """``url`` without its password (for logs and errors)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "postgresql://<unparsable>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _connect(url: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_SECONDS,
            application_name="attestmesh-controlplane",
            **LIVENESS,
        )
    except psycopg.Error as exc:
        raise StoreError(
            "store_unreachable", f"{redact_url(url)}: {type(exc).__name__}: {exc}"
        ) from exc


def pg_schema_version(conn: psycopg.Connection[Any]) -> int:
    """The schema version of a database: 0 if it has no ``schema_version`` table."""
    row = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    got = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(got[0]) if got and got[0] is not None else 0


def migrate_pg(
    conn: psycopg.Connection[Any],
    migrations: Sequence[Migration] = PG_MIGRATIONS,
    where: str = "",
) -> int:
    """Bring the schema up to the last of ``migrations`` in one transaction; return its version.

    Idempotent; concurrent openers (replicas starting together) serialise on an advisory lock
    held until the transaction ends and read the version after taking it. A database newer
    than the newest migration is refused; a failing migration rolls everything back."""
    latest = migrations[-1].version if migrations else 0
    where = where or "database"
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            current = pg_schema_version(conn)
            if current > latest:
                raise StoreError(
                    "store_schema_too_new",
                    f"{where} has schema version {current}; this attestmesh knows versions up "
                    f"to {latest}: run the newer attestmesh or restore a backup",
                )
            if current < latest:
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_version (version integer PRIMARY KEY, "
                    "description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
                )
                for m in migrations:
                    if m.version > current:
                        for statement in m.statements:
                            conn.execute(statement.encode())
                        conn.execute(
                            "INSERT INTO schema_version(version, description) VALUES (%s, %s)",
                            (m.version, m.description),
                        )
    except psycopg.Error as exc:
        raise StoreError("store_migration_failed", f"{where}: {type(exc).__name__}: {exc}") from exc
    return latest


def _load(conn: psycopg.Connection[Any], trust_domain: str) -> MeshState:
    return _load_at(conn, trust_domain)[0]


def _load_at(conn: psycopg.Connection[Any], trust_domain: str) -> tuple[MeshState, Position]:
    """Everything, and the change-feed position it includes (one snapshot)."""
    with conn.transaction():  # one snapshot for every table
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return _load_in(conn, trust_domain)


def _load_in(conn: psycopg.Connection[Any], trust_domain: str) -> tuple[MeshState, Position]:
    """``_load_at`` inside the caller's (repeatable read) transaction, before its first read:
    the position is just below the oldest transaction running at the snapshot (every change
    below it is in the snapshot; those above may be too, and are delivered again: rows as
    stored now, harmless)."""
    loads = json.loads
    got = conn.execute(f"SELECT {XMIN}".encode()).fetchone()  # takes the snapshot
    position = (int(got[0]) - 1 if got else 0, 2**63 - 1)
    rows = conn.execute("SELECT name, doc FROM workloads ORDER BY name").fetchall()
    revs = conn.execute(
        "SELECT serial, workload, not_after, revoked_at FROM revocations "
        "ORDER BY revoked_at, serial"
    ).fetchall()
    workloads = {name: workload_from_doc(loads(doc)) for name, doc in rows}
    revocations = Revocations(
        Revocation(int(s), _from_iso(na), _from_iso(ra), w) for s, w, na, ra in revs
    )
    return MeshState(trust_domain, workloads, revocations), position


def _events(conn: psycopg.Connection[Any], workload: str | None, limit: int) -> list[Event]:
    if workload is None:
        rows = conn.execute(
            "SELECT at, kind, workload, trigger, reason, code, platform FROM events "
            "ORDER BY id DESC LIMIT %s",
            (limit,),
        ).fetchall()
    else:
        rows = conn.execute(
            "SELECT at, kind, workload, trigger, reason, code, platform FROM events "
            "WHERE workload = %s ORDER BY id DESC LIMIT %s",
            (workload, limit),
        ).fetchall()
    return [
        Event(_KIND[k], w, _from_iso(at), reason, _TRIGGER[t] if t else None, code, bool(p))
        for at, k, w, t, reason, code, p in reversed(rows)
    ]


class _Connection:
    """One connection, replaced after it breaks; a lock makes it usable from several threads."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = _connect(url)

    def get(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._conn = None
            conn = self._conn = _connect(self.url)
        return conn

    def discard_if_broken(self) -> None:
        conn = self._conn
        if conn is not None and (conn.closed or conn.broken):
            conn.close()
            self._conn = None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _read(c: _Connection, what: str, fn: Any, *args: Any) -> Any:
    with c._lock:
        try:
            return fn(c.get(), *args)
        except psycopg.Error as exc:
            c.discard_if_broken()
            raise StoreError(
                "store_read_failed", f"{redact_url(c.url)}: {what}: {type(exc).__name__}: {exc}"
            ) from exc


class _PgReader:
    def __init__(self, url: str) -> None:
        self._c = _Connection(url)

    def load(self, trust_domain: str) -> MeshState:
        state: MeshState = _read(self._c, "load", _load, trust_domain)
        return state

    def load_at(self, trust_domain: str) -> tuple[MeshState, Position]:
        """``load`` and the change-feed position it includes (where a ``ChangeFeed`` starts)."""
        got: tuple[MeshState, Position] = _read(self._c, "load", _load_at, trust_domain)
        return got

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]:
        events: list[Event] = _read(self._c, "events", _events, workload, limit)
        return events

    def close(self) -> None:
        self._c.close()


class PostgresStore(CountedBackend):
    """The PostgreSQL backend: one connection, synchronous commits (see the module docstring).

    Not for concurrent writes from several threads: wrap it in ``GroupCommitStore`` (which then
    owns it). ``max_events`` / ``prune_slack`` bound the event log as in ``SqliteStore`` (the
    bound is shared by every replica writing to the database)."""

    def __init__(
        self,
        url: str,
        *,
        max_events: int = DEFAULT_MAX_EVENTS,
        prune_slack: int | None = None,
        migrations: Sequence[Migration] = PG_MIGRATIONS,
        origin: str | None = None,
        max_changes: int = DEFAULT_MAX_CHANGES,
    ) -> None:
        if max_events < 1 or max_changes < 1:
            raise ValueError("max_events and max_changes must be at least 1")
        if not is_postgres_url(url):
            raise ValueError(f"not a postgresql:// URL: {redact_url(url)}")
        super().__init__()
        self.url = url
        # who wrote a change (its own followers skip it); one per process
        self.origin = origin or secrets.token_hex(8)
        self.max_changes = max_changes
        self._changes_pruned_below = 0
        self.max_events = max_events
        self.prune_slack = max_events // 100 if prune_slack is None else prune_slack
        self._c = _Connection(url)
        try:
            self.version = migrate_pg(self._c.get(), migrations, where=self.where)
        except BaseException:
            self._c.close()
            raise
        self._pruned_below = 0

    @property
    def where(self) -> str:
        return redact_url(self.url)

    def close(self) -> None:
        self._c.close()

    def reader(self) -> StoreReader:
        return _PgReader(self.url)

    def load(self, trust_domain: str) -> MeshState:
        state: MeshState = _read(self._c, "load", _load, trust_domain)
        return state

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]:
        events: list[Event] = _read(self._c, "events", _events, workload, limit)
        return events

    def commit_group(self, group: Sequence[_Rows]) -> list[StoreConflict | None]:
        """Commit encoded batches in one transaction, each only if its expectations hold
        (``decide_group``). Every workload named by the group (expected or written) is locked
        first (a transaction-scoped advisory lock per name, taken in one order by every
        replica), so a row read for a decision cannot change before the decision is written."""
        if not any(r.count() or r.expect for r in group):
            return [None] * len(group)
        started = time.perf_counter()
        with self._c._lock:
            try:
                rows, outcomes, applied, pruned_below = self._commit(self._c.get(), group)
            except psycopg.Error as exc:
                self._c.discard_if_broken()
                self.failed_commits += 1
                raise StoreError(
                    "store_commit_failed", f"{self.where}: {type(exc).__name__}: {exc}"
                ) from exc
            except BaseException:
                self._c.discard_if_broken()
                self.failed_commits += 1
                raise
        self._pruned_below = pruned_below
        self._count_commit(rows, outcomes, applied, started)
        return outcomes

    def _commit(
        self, conn: psycopg.Connection[Any], group: Sequence[_Rows]
    ) -> tuple[_Rows, list[StoreConflict | None], int, int]:
        with conn.transaction():
            names = sorted({n for r in group for n in (*r.expect, *r.workloads)})
            if names:
                conn.execute(
                    "SELECT pg_advisory_xact_lock(%s, h) FROM "
                    "(SELECT DISTINCT hashtext(n) AS h FROM unnest(%s::text[]) AS n ORDER BY 1) s",
                    (ROW_LOCK_SPACE, names),
                )
            expected = expected_names(group)
            stored: dict[str, str | None] = {}
            if expected:
                stored.update(
                    conn.execute(
                        "SELECT name, doc FROM workloads WHERE name = ANY(%s::text[])",
                        (expected,),
                    ).fetchall()
                )
            rows, outcomes, applied = decide_group(stored, group)
            pruned_below = self._write_rows(conn, rows)
            self._log_changes(conn, rows)
        return rows, outcomes, applied, pruned_below

    def _log_changes(self, conn: psycopg.Connection[Any], rows: _Rows) -> None:
        """One change row per workload and revocation written, then NOTIFY (delivered on
        commit). No lock: followers read in transaction order below the running ones. Pruning
        deletes old changes of finished transactions and records the last position deleted
        (a follower behind it resyncs)."""
        kinds = ["w"] * len(rows.workloads) + ["r"] * len(rows.revocations)
        if not kinds:
            return
        got = conn.execute(
            "INSERT INTO changes(kind, key, origin) SELECT k, key, %s "
            "FROM unnest(%s::text[], %s::text[]) AS u(k, key) RETURNING seq",
            (self.origin, kinds, [*rows.workloads, *rows.revocations]),
        ).fetchall()
        last = max(seq for (seq,) in got)
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{last} {self.origin}"))
        if last - self.max_changes > self._changes_pruned_below + self.max_changes // 100:
            self._changes_pruned_below = last - self.max_changes
            conn.execute(
                "WITH d AS (DELETE FROM changes WHERE seq <= %s "
                "AND xid < pg_snapshot_xmin(pg_current_snapshot()) "
                "RETURNING xid::text::bigint AS x, seq) "
                "INSERT INTO changes_pruned(id, xid, seq) "
                "SELECT 1, x, seq FROM d ORDER BY x DESC, seq DESC LIMIT 1 "
                "ON CONFLICT (id) DO UPDATE SET xid = EXCLUDED.xid, seq = EXCLUDED.seq "
                "WHERE (changes_pruned.xid, changes_pruned.seq) < (EXCLUDED.xid, EXCLUDED.seq)",
                (self._changes_pruned_below,),
            )

    def _write_rows(self, conn: psycopg.Connection[Any], rows: _Rows) -> int:
        upserts = [(n, d) for n, d in rows.workloads.items() if d is not None]
        deletes = [n for n, d in rows.workloads.items() if d is None]
        revoked = [r for r in rows.revocations.values() if r is not None]
        unrevoked = [s for s, r in rows.revocations.items() if r is None]
        pruned_below = self._pruned_below
        if upserts:
            conn.execute(
                "INSERT INTO workloads(name, doc) "
                "SELECT * FROM unnest(%s::text[], %s::text[]) "
                "ON CONFLICT (name) DO UPDATE SET doc = EXCLUDED.doc",
                ([n for n, _ in upserts], [d for _, d in upserts]),
            )
        if deletes:
            conn.execute("DELETE FROM workloads WHERE name = ANY(%s::text[])", (deletes,))
        if revoked:
            conn.execute(
                "INSERT INTO revocations(serial, workload, not_after, revoked_at) "
                "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) "
                "ON CONFLICT (serial) DO UPDATE SET workload = EXCLUDED.workload, "
                "not_after = EXCLUDED.not_after, revoked_at = EXCLUDED.revoked_at",
                tuple([r[i] for r in revoked] for i in range(4)),
            )
        if unrevoked:
            conn.execute("DELETE FROM revocations WHERE serial = ANY(%s::text[])", (unrevoked,))
        if rows.events:
            columns = tuple([e[i] for e in rows.events] for i in range(7))
            conn.execute(
                "INSERT INTO events(at, kind, workload, trigger, reason, code, platform) "
                "SELECT at, kind, workload, trigger, reason, code, platform FROM unnest("
                "%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[], "
                "%s::integer[]) WITH ORDINALITY "
                "AS u(at, kind, workload, trigger, reason, code, platform, n) ORDER BY n",
                columns,
            )
            got = conn.execute("SELECT currval(pg_get_serial_sequence('events', 'id'))")
            last = int(got.fetchone()[0])  # type: ignore[index]
            if last - self.max_events > pruned_below + self.prune_slack:
                pruned_below = last - self.max_events
                conn.execute("DELETE FROM events WHERE id <= %s", (pruned_below,))
        return pruned_below


def open_store(spec: str | Path, **options: Any) -> GroupCommitStore:
    """The control plane's store: ``postgresql://...`` (or ``postgres://``) opens PostgreSQL,
    anything else is the path of a SQLite file; either behind group commit."""
    if isinstance(spec, str) and is_postgres_url(spec):
        return GroupCommitStore(PostgresStore(spec, **options), thread_name="attestmesh-store-pg")
    return GroupCommitStore(SqliteStore(Path(spec), **options))


if TYPE_CHECKING:

    def _conforms(a: PostgresStore) -> tuple[StateStore, CommitBackend]:
        return a, a


# ---------------------------------------------------------------------------------------------
# Following the other replicas


@dataclass(frozen=True, slots=True)
class Changes:
    """What other replicas committed since the follower's last read, as the rows are now.

    ``workloads``: name -> stored row (None: deleted); ``revoked``: revocations stored now;
    ``unrevoked``: serials no longer stored. ``resync``: the change log no longer reached back
    to where the follower was (pruned): ``workloads`` and ``revoked`` are then everything
    stored, and anything else the follower holds is gone. ``position``: the last change
    included (transaction id, change number)."""

    position: Position
    workloads: dict[str, WorkloadState | None]
    revoked: Sequence[Revocation] = ()
    unrevoked: frozenset[int] = frozenset()
    resync: bool = False
    ca: bool = False  # the leader changed the shared CA (rotation): reload it


def follow_notifications(
    url: str,
    *,
    name: str,
    closed: threading.Event,
    step: Callable[[psycopg.Connection[Any]], float],
    lost: Callable[[psycopg.Error], object],
    settle_seconds: float,
    retry_seconds: float,
) -> None:
    """Follow the change channel on the calling thread until ``closed`` is set: connect
    (autocommit, ``application_name`` ``name``), LISTEN on ``CHANNEL``, then call
    ``step(conn)`` at once (the catch-up read after every connect) and after every wake-up.
    ``step`` returns how long to wait for a notification before it is called again; a
    notification wakes it after ``settle_seconds``, and the notifications that arrived by
    then are dropped, so a burst of commits costs one step. On a ``psycopg.Error`` (connect,
    LISTEN, wait or ``step``): ``lost(exc)``, wait ``retry_seconds``, connect again."""
    while not closed.is_set():
        try:
            with psycopg.connect(
                url,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_SECONDS,
                application_name=name,
                **LIVENESS,
            ) as conn:
                conn.execute(f"LISTEN {CHANNEL}".encode())
                while not closed.is_set():
                    wait = step(conn)
                    woke = False
                    if not closed.is_set():
                        for _ in conn.notifies(timeout=wait, stop_after=1):
                            woke = True
                    if woke:
                        closed.wait(settle_seconds)
                        for _ in conn.notifies(timeout=0):
                            pass
        except psycopg.Error as exc:
            lost(exc)
            closed.wait(retry_seconds)


class ChangeFeed:
    """A thread that follows the change log of one PostgreSQL database for one replica.

    It LISTENs on ``attestmesh_changes`` and, on every notification (after
    ``settle_seconds``, so the commits of a burst cost one read and one delivery; and every
    ``poll_seconds`` as a backstop), reads the changes numbered after the last it delivered,
    skipping its own replica's (``origin``), with the rows they name as stored now, in one
    snapshot; ``deliver`` is called on this thread (the control plane hands it to its loop).
    After a lost connection it reconnects (every ``retry_seconds``) and catches up from the
    same number, so nothing is missed; if the log was pruned past that number it delivers a
    full ``resync``. ``last_contact`` (monotonic) is the last time the database answered.

    ``after_next_read(done)``: ``done`` is called on this thread once a read begun after the
    call has caught up (after the deliveries it made); ``reads_begun`` counts those reads."""

    def __init__(
        self,
        url: str,
        *,
        origin: str,
        after: Position,
        trust_domain: str,
        deliver: Callable[[Changes], object],
        poll_seconds: float = 0.5,
        retry_seconds: float = 0.5,
        batch: int = 5000,
        settle_seconds: float = 0.005,
    ) -> None:
        self.url = url
        self.origin = origin
        self.after = after
        self.trust_domain = trust_domain
        self._deliver = deliver
        self._poll = poll_seconds
        self._retry = retry_seconds
        self._batch = batch
        self._settle = settle_seconds
        self._closed = threading.Event()
        self.connected = False
        self.last_contact = time.monotonic()
        self.reconnects = 0
        self.delivered = 0
        self.reads_begun = 0
        self._waiting: list[Callable[[], object]] = []  # after_next_read's, not yet taken
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="attestmesh-changefeed", daemon=True)

    def start(self) -> ChangeFeed:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(10)

    def _run(self) -> None:
        follow_notifications(
            self.url,
            name="attestmesh-changefeed",
            closed=self._closed,
            step=self._step,
            lost=self._lost,
            settle_seconds=self._settle,
            retry_seconds=self._retry,
        )
        self.connected = False

    def after_next_read(self, done: Callable[[], object]) -> None:
        """Call ``done`` (on this thread) once a read begun after this call has caught up."""
        with self._lock:
            self._waiting.append(done)

    def _step(self, conn: psycopg.Connection[Any]) -> float:
        self.connected = True
        with self._lock:
            waiting, self._waiting = self._waiting, []
            self.reads_begun += 1
        try:
            self._catch_up(conn)
        except BaseException:  # (the connection is lost) the next connection's read serves them
            with self._lock:
                self._waiting[:0] = waiting
            raise
        for done in waiting:
            with contextlib.suppress(RuntimeError):  # the waiting loop is closed: shutting down
                done()
        # (those asked for while this read ran wait for the next one, on a notification or
        # the poll: reading again at once for them would let requests set the read rate)
        return self._poll

    def _lost(self, exc: psycopg.Error) -> None:
        if self.connected:
            log.warning("change feed lost %s: %s", redact_url(self.url), exc)
        self.connected = False
        self.reconnects += 1

    def _catch_up(self, conn: psycopg.Connection[Any]) -> None:
        while True:
            changes, full = self._read(conn)
            self.last_contact = time.monotonic()
            if changes is None:
                return
            self.after = changes.position
            if (
                changes.workloads
                or changes.revoked
                or changes.unrevoked
                or changes.resync
                or changes.ca
            ):
                try:
                    self._deliver(changes)
                except RuntimeError:  # the receiving loop is closed: shutting down
                    self._closed.set()
                    return
                self.delivered += 1
            if not full:
                return

    def _read(self, conn: psycopg.Connection[Any]) -> tuple[Changes | None, bool]:
        """One statement (one snapshot, one round trip): the changes after ``after`` in
        transaction order, of transactions older than any still running, each with the row it
        names as stored now (other replicas' only); and the last position pruned (the first
        row carries it, even when there is no change)."""
        loads = json.loads
        rows = conn.execute(
            "SELECT p.xid, p.seq, c.* FROM (SELECT 1) one "
            "LEFT JOIN changes_pruned p ON true LEFT JOIN LATERAL ("
            "SELECT c.xid::text::bigint, c.seq, c.kind, c.key, c.origin, w.doc, r.workload, "
            "r.not_after, r.revoked_at FROM changes c "
            "LEFT JOIN workloads w ON c.kind = 'w' AND c.origin <> %(me)s AND w.name = c.key "
            "LEFT JOIN revocations r ON c.kind = 'r' AND c.origin <> %(me)s AND r.serial = c.key "
            "WHERE (c.xid, c.seq) > (%(xid)s::text::xid8, %(seq)s) "
            "AND c.xid < pg_snapshot_xmin(pg_current_snapshot()) "
            "ORDER BY c.xid, c.seq LIMIT %(n)s) c ON true",
            {"me": self.origin, "xid": self.after[0], "seq": self.after[1], "n": self._batch},
        ).fetchall()
        pruned = (rows[0][0], rows[0][1])
        if pruned[0] is not None and (int(pruned[0]), int(pruned[1])) > self.after:
            # changes this follower has not read were pruned: everything, anew
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                state, position = _load_in(conn, self.trust_domain)
            return Changes(position, dict(state.workloads), state.revocations, resync=True), False
        if rows[0][2] is None:
            return None, False
        workloads: dict[str, WorkloadState | None] = {}
        revoked: dict[int, Revocation] = {}
        unrevoked: set[int] = set()
        ca = False
        for _, _, _, _, kind, key, origin, doc, workload, not_after, revoked_at in rows:
            if origin == self.origin:
                continue
            if kind == "c":
                ca = True
            elif kind == "l":  # the leader stored a CRL set: its ``CrlSigner``s follow it
                continue
            elif kind == "w":
                workloads[key] = None if doc is None else workload_from_doc(loads(doc))
            elif workload is None:
                unrevoked.add(int(key))
                revoked.pop(int(key), None)
            else:
                unrevoked.discard(int(key))
                revoked[int(key)] = Revocation(
                    int(key), _from_iso(not_after), _from_iso(revoked_at), workload
                )
        position = (int(rows[-1][2]), int(rows[-1][3]))
        changes = Changes(position, workloads, tuple(revoked.values()), frozenset(unrevoked), ca=ca)
        return changes, len(rows) == self._batch


def follow(
    store: GroupCommitStore,
    trust_domain: str,
    deliver: Callable[[Changes], object],
    **options: Any,
) -> tuple[MeshState, ChangeFeed | None]:
    """The state to start from and, for a PostgreSQL store, the feed of the other replicas'
    changes after it (not started). SQLite: the state and None (one replica)."""
    backend = store.backend
    if not isinstance(backend, PostgresStore):
        return store.load(trust_domain), None
    reader = _PgReader(backend.url)
    try:
        state, position = reader.load_at(trust_domain)
    finally:
        reader.close()
    feed = ChangeFeed(
        backend.url,
        origin=backend.origin,
        after=position,
        trust_domain=trust_domain,
        deliver=deliver,
        **options,
    )
    return state, feed


# ---------------------------------------------------------------------------------------------
# One CA for every replica; one leader


def _write_file(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(directory / name)


def share_ca(url: str, directory: Path, create: Callable[[], object]) -> str:
    """Make ``directory`` hold the CA every replica on this database signs with.

    The first replica (the database holds no CA yet) creates its CA (``create``: load or make
    the CA in ``directory``) and uploads its files; every later one writes the database's files
    into ``directory`` (replacing a CA of its own), before the CA is loaded from there. Returns
    "uploaded" or "downloaded". Serialised by an advisory lock (replicas starting together)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _connect(url) as conn:
        migrate_pg(conn, where=redact_url(url))
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (CA_LOCK,))
            rows = conn.execute("SELECT name, data FROM ca_files").fetchall()
            if not rows:
                create()
                _upload_ca(conn, directory)
                return "uploaded"
    stored = {str(n): bytes(d) for n, d in rows}
    for name in CA_FILES:
        if name in stored:
            _write_file(directory, name, stored[name])
        else:
            (directory / name).unlink(missing_ok=True)
    return "downloaded"


def _upload_ca(conn: psycopg.Connection[Any], directory: Path) -> None:
    files = {n: (directory / n).read_bytes() for n in CA_FILES if (directory / n).exists()}
    conn.execute("DELETE FROM ca_files")
    conn.execute(
        "INSERT INTO ca_files(name, data) SELECT * FROM unnest(%s::text[], %s::bytea[])",
        (list(files), list(files.values())),
    )


def publish_ca(url: str, directory: Path, origin: str) -> None:
    """The leader rotated the CA in ``directory``: store its files and tell the other replicas
    (a change of kind ``c``: their feeds deliver ``Changes.ca`` and they reload it)."""
    with _connect(url) as conn, conn.transaction():
        _upload_ca(conn, directory)
        conn.execute("INSERT INTO changes(kind, key, origin) VALUES ('c', 'ca', %s)", (origin,))
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"ca {origin}"))


def download_ca(url: str, directory: Path) -> None:
    """Write the database's CA files into ``directory`` (a follower, after a rotation)."""
    share_ca(url, directory, lambda: None)


class Leadership:
    """Exactly one leader among the replicas on one database: the replica whose connection
    holds the session advisory lock ``LEADER_LOCK``. A thread tries to take it every
    ``interval_seconds`` and, while leading, checks its connection as often; a leader that
    dies (its connection closes: kill -9 included), is cut off (server-side TCP keepalives
    end its session within ~11 s) or freezes (``idle_session_timeout``: 5 intervals, at least
    5 s) loses the lock, and the next try of another replica takes it. ``is_leader`` turns
    False as soon as this replica's own check fails.

    ``eligible`` (Kubernetes mode: "this replica holds the Lease"): the lock is taken only while
    it says yes, and given up within an interval once it says no, so the replica that acts on
    Kubernetes is also the one that rotates the CA and signs the CRL."""

    def __init__(
        self,
        url: str,
        *,
        interval_seconds: float = 1.0,
        on_change: Callable[[bool], object] | None = None,
        eligible: Callable[[], bool] | None = None,
    ) -> None:
        self.url = url
        self._interval = interval_seconds
        # a leader whose process is frozen (SIGSTOP, a paused VM) still answers TCP keepalives
        # from its kernel; the server ends its session once it has sent nothing for this long
        # (it checks every interval), which frees the lock. Above ``leading``'s 2 intervals,
        # so the frozen one has stopped acting by then.
        self._frozen_after_ms = int(max(5.0, 5 * interval_seconds) * 1000)
        self._on_change = on_change
        self._eligible = eligible
        self._closed = threading.Event()
        self.is_leader = False
        self.confirmed_at = 0.0  # monotonic: the last time the database confirmed the lock
        self.changes = 0
        # the server process of the connection holding the lock (0: none): writes only the
        # leader may make check it holds the lock when they commit (``store_crl``)
        self.backend_pid = 0
        self._thread = threading.Thread(target=self._run, name="attestmesh-leader", daemon=True)

    def start(self) -> Leadership:
        self._thread.start()
        return self

    @property
    def leading(self) -> bool:
        """Leader, and confirmed by the database within two intervals: a leader whose
        connection went silent stops acting before the server (keepalives: ~5 s) frees the
        lock for another, so two never act at once."""
        return self.is_leader and time.monotonic() - self.confirmed_at <= 2 * self._interval + 0.5

    def close(self) -> None:
        self._closed.set()
        self._thread.join(10)

    def _set(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            self.changes += 1
            log.warning("this replica is %s the leader", "now" if leader else "no longer")
            if self._on_change is not None:
                self._on_change(leader)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                with psycopg.connect(
                    self.url,
                    autocommit=True,
                    connect_timeout=CONNECT_TIMEOUT_SECONDS,
                    application_name=f"attestmesh-leader {os.getpid()}",
                    **LIVENESS,
                ) as conn:
                    for setting in (
                        "tcp_keepalives_idle = 5",
                        "tcp_keepalives_interval = 2",
                        "tcp_keepalives_count = 3",
                        f"idle_session_timeout = {self._frozen_after_ms}",
                    ):
                        conn.execute(f"SET {setting}".encode())
                    while not self._closed.is_set():
                        eligible = self._eligible is None or self._eligible()
                        if self.is_leader and not eligible:
                            conn.execute("SELECT pg_advisory_unlock(%s)", (LEADER_LOCK,))
                            self.backend_pid = 0
                            self._set(False)
                        elif self.is_leader:
                            conn.execute("SELECT 1")
                            self.confirmed_at = time.monotonic()
                        elif not eligible:  # another holds the Lease: leave the lock to it
                            conn.execute("SELECT 1")  # (a used session is not ended)
                        else:
                            got = conn.execute(
                                "SELECT pg_try_advisory_lock(%s)", (LEADER_LOCK,)
                            ).fetchone()
                            if got and got[0]:
                                self.backend_pid = conn.info.backend_pid
                                self.confirmed_at = time.monotonic()
                            self._set(bool(got and got[0]))
                        self._closed.wait(self._interval)
            except psycopg.Error as exc:
                log.warning("leader election: %s: %s", redact_url(self.url), exc)
                self._set(False)
                self._closed.wait(self._interval)
        self._set(False)


def read_rows(url: str, names: Sequence[str]) -> dict[str, WorkloadState | None]:
    """These workloads' rows as stored now (None: no row)."""
    with _connect(url) as conn:
        docs = dict(
            conn.execute(
                "SELECT name, doc FROM workloads WHERE name = ANY(%s::text[])", (list(names),)
            ).fetchall()
        )
    return {n: workload_from_doc(json.loads(docs[n])) if n in docs else None for n in names}


# ---------------------------------------------------------------------------------------------
# One CRL set, signed by the leader


@dataclass(frozen=True, slots=True)
class StoredCrl:
    """The CRL set as the leader stored it: ``number`` counts the CRLs stored in this
    database (it only grows), ``covers`` the transaction id below which every revocation
    committed by any replica is in it (the oldest transaction running when it was read),
    ``revoked`` how many serials it lists."""

    number: int
    pem: bytes
    signed_at: datetime
    covers: int
    revoked: int
    origin: str


def read_crl(conn: psycopg.Connection[Any], *, with_pem: bool = True) -> StoredCrl | None:
    """The stored CRL set (None: the leader has not stored one yet); ``with_pem=False``: all
    but the PEM (``pem`` empty), to check whether a new one was stored."""
    if with_pem:
        query = "SELECT number, pem, signed_at, covers, revoked, origin FROM crl"
    else:
        query = "SELECT number, ''::bytea, signed_at, covers, revoked, origin FROM crl"
    row = conn.execute(query).fetchone()
    if row is None:
        return None
    number, pem, signed_at, covers, revoked, origin = row
    return StoredCrl(
        int(number), bytes(pem), _from_iso(signed_at), int(covers), int(revoked), origin
    )


def revocations_at(conn: psycopg.Connection[Any]) -> tuple[list[tuple[int, datetime]], int]:
    """Every stored revocation (serial, revoked at) and the oldest transaction id running at
    the snapshot: a CRL signed from it covers every revocation committed by a transaction
    below that id, by any replica (and maybe some above)."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        got = conn.execute(f"SELECT {XMIN}".encode()).fetchone()  # takes the snapshot
        rows = conn.execute("SELECT serial, revoked_at FROM revocations ORDER BY serial").fetchall()
    return [(int(s), _from_iso(at)) for s, at in rows], int(got[0]) if got else 0


def revoked_since(conn: psycopg.Connection[Any], covers: int) -> bool:
    """A revocation change (revoked or unrevoked) of a transaction from ``covers`` on, that
    a CRL covering ``covers`` may lack (a range scan of the change log's xid index)."""
    got = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM changes WHERE xid >= %s::text::xid8 AND kind = 'r')",
        (covers,),
    ).fetchone()
    return bool(got and got[0])


def store_crl(
    conn: psycopg.Connection[Any],
    pem: bytes,
    *,
    signed_at: datetime,
    covers: int,
    revoked: int,
    origin: str,
    leader_pid: int,
) -> StoredCrl | None:
    """Store the leader's CRL set and tell the other replicas (a change of kind ``l``), in one
    transaction, only if the server process ``leader_pid`` (the leader's election connection)
    holds the leader lock when it commits, and the stored CRL covers no more than this one
    (a deposed leader's late write never replaces its successor's). None: refused."""
    with conn.transaction():
        held = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND pid = %s AND objsubid = 1 AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND ((classid::bigint << 32) | objid::bigint) = %s)",
            (leader_pid, LEADER_LOCK),
        ).fetchone()
        if not held or not held[0]:
            return None
        got = conn.execute(
            "INSERT INTO crl(id, number, pem, signed_at, covers, revoked, origin) "
            "VALUES (1, 1, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
            "number = crl.number + 1, pem = EXCLUDED.pem, signed_at = EXCLUDED.signed_at, "
            "covers = EXCLUDED.covers, revoked = EXCLUDED.revoked, "
            "origin = EXCLUDED.origin WHERE crl.covers <= EXCLUDED.covers "
            "RETURNING number",
            (pem, signed_at.isoformat(), covers, revoked, origin),
        ).fetchone()
        if got is None:
            return None
        conn.execute("INSERT INTO changes(kind, key, origin) VALUES ('l', 'crl', %s)", (origin,))
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"crl {origin}"))
    return StoredCrl(int(got[0]), pem, signed_at, covers, revoked, origin)
