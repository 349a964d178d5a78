"""The audit log: what operators did to a prefix's jobs (paused, resumed, ran now), who
and why, kept in the store for every process to read.

One stream per prefix, ``{<prefix>}:audit``, holding the newest ``AUDIT_MAX`` entries:
its ids are the server's clock, so every entry says when by one clock. An entry is
written after its action took effect (they are keys of other hash tags: a cluster puts
them on other nodes), and read through ``records.decode_audit``: one that does not read
is quarantined and left out.
"""

from __future__ import annotations

import getpass
import logging
import socket

import anyio

from .._errors import InvalidOptionError
from .._model.text import visible
from .._model.values import AuditEntry
from ..clients import Connection, ServerReplyError
from .keys import RegistryKeys
from .quarantine import MalformedEntry, quarantine_of
from .records import AUDIT_BY_MAX, AUDIT_NOTE_MAX, decode_audit

__all__ = [
    "AUDIT_MAX",
    "PAUSED_BY_FAILURES",
    "check_note",
    "read_audit",
    "record_audit",
    "who",
]

log = logging.getLogger("anarchon")

#: How many entries a prefix's audit log keeps (the newest).
AUDIT_MAX = 1000
#: Who paused a job its pause_after_failures paused (lease_state.lua writes the same at
#: the start of the pause's text).
PAUSED_BY_FAILURES = "anarchon (pause_after_failures)"


def who(by: str | None = None) -> str:
    """Who acts: ``by`` as given (checked), or ``user@host`` of this process."""
    if by is not None:
        if not isinstance(by, str) or not by.strip() or len(by) > AUDIT_BY_MAX:
            raise InvalidOptionError(
                f"by must be text of 1 to {AUDIT_BY_MAX} characters (who acts, such as "
                f"'alice@ops'), got {visible(str(by), 80)!r}"
            )
        return by
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (a container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:AUDIT_BY_MAX]


def check_note(note: str | None) -> str | None:
    """A note as given (None: none), or an ``InvalidOptionError`` saying what to give."""
    if note is None:
        return None
    if not isinstance(note, str) or len(note) > AUDIT_NOTE_MAX:
        raise InvalidOptionError(
            f"note must be text of at most {AUDIT_NOTE_MAX} characters (why, for the audit "
            f"log), got {visible(str(note), 80)!r}"
        )
    return note


async def record_audit(
    conn: Connection,
    prefix: str,
    action: str,
    job: str,
    by: str,
    note: str | None,
    *,
    within_sec: float,
) -> bool:
    """Add an entry to the prefix's audit log (its oldest beyond ``AUDIT_MAX`` go),
    after its action took effect: within ``within_sec``, and a failure (the server out
    of reach, refusing the write) logged, not raised, since the action stands. Whether
    the entry was written."""
    key = RegistryKeys.for_prefix(prefix).audit
    fields = ["action", action, "job", job, "by", by]
    if note is not None:
        fields += ["note", note]
    failure: BaseException | str = "no reply in time"
    with anyio.move_on_after(within_sec):
        try:
            await conn.execute(("XADD", key, "MAXLEN", AUDIT_MAX, "*", *fields))
            return True
        except Exception as exc:
            failure = exc
    log.warning(
        "%s: %s was done, but the audit log did not take it: %s",
        visible(job, 200),
        action,
        failure,
    )
    return False


async def read_audit(
    conn: Connection, prefix: str, job: str | None, limit: int
) -> list[AuditEntry]:
    """The newest ``limit`` entries (of ``job`` alone, if given), newest first, read a
    page at a time from the newest until found (or the log's end); one that does not
    read is quarantined and left out."""
    key = RegistryKeys.for_prefix(prefix).audit
    found: list[AuditEntry] = []
    end: str | None = "+"
    page = max(limit, _PAGE)
    for _ in range(AUDIT_MAX // _PAGE + 2):
        if end is None:
            break
        try:
            raw = list(await conn.execute(("XREVRANGE", key, end, "-", "COUNT", page)) or [])
        except ServerReplyError as exc:
            if exc.kind != "WRONGTYPE":
                raise
            problem = "holds another type of value than the audit log's stream"
            quarantine_of(prefix).add(MalformedEntry(key, "", problem), "the audit log")
            return found
        for entry in raw:
            try:
                decoded = decode_audit(key, entry)
            except MalformedEntry as exc:
                quarantine_of(prefix).add(exc, "the audit log")
                continue
            if job is None or decoded.job == job:
                found.append(decoded)
                if len(found) >= limit:
                    return found
        if len(raw) < page:
            break
        end = _before(_entry_id(raw[-1]))  # the next page: older than this one's last
    return found


#: How many entries one read of the log takes at least.
_PAGE = 100


def _before(entry_id: str) -> str | None:
    """The stream id just before ``entry_id`` (an exclusive range, on every server:
    ``(`` needs Redis 6.2), or None before the first possible one."""
    ms, _, seq = entry_id.partition("-")
    if not (ms.isdigit() and seq.isdigit()):
        return None
    if int(seq) > 0:
        return f"{ms}-{int(seq) - 1}"
    return f"{int(ms) - 1}-18446744073709551615" if int(ms) > 0 else None


def _entry_id(entry: object) -> str:
    entry_id = entry[0] if isinstance(entry, list | tuple) and entry else ""
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
