"""``Timers``: sets, cancels and reads timers, on a connection of its own or on a
scheduler's.

A process that only sets timers (a web app) keeps one ``Timers`` open for its life:
after its first call on a kind, setting a timer is one command on the wire (the set
script, by its SHA). ``Scheduler``'s timer methods are a ``Timers`` bound to the
scheduler's instance: on its connection while it runs (a timer of a kind it fires is
then looked at when due, and told as an event), else on a connection opened for the
call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol

from ._errors import AnarchonError, InvalidOptionError, SchedulerStateError, TransportError
from ._model.clock import round_trip_deadline_sec, wall_ms
from ._model.job import check_count
from ._model.options import check_buckets
from ._model.timer import Recurrence, TimerKind, due_from, validate_kind, validate_timer_key
from ._model.values import AppliedTimers, TimerInfo, TimerSetting
from ._observe.events import EventHub, TimerCancelled, TimerSet
from ._store.backend import RedisBackend
from ._store.deadline import Within
from ._store.keys import TimerKeys, glob_literal
from ._store.records import TimerState
from ._store.timers import TimerCursor, TimerStore, encode_payload, timer_info
from .clients import Connection

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "TimerHost", "Timers", "bound_timers"]

#: ``set_many`` sends its timers in round trips of this many.
_SET_PER_ROUND_TRIP = 1000
#: A scan of a kind's timers reads about this many a step (``HSCAN ... COUNT``).
_SCAN_STEP = 1000
#: The most timers ``apply`` takes (and reads) in one call, and ``cancel_prefix`` cancels.
_APPLY_MAX = 100_000
#: A round trip's deadline without a scheduler's lease to take it from: that of the
#: default 30 s lease.
_ROUND_TRIP_SEC = round_trip_deadline_sec(30_000)

#: The largest payload a timer may hold as stored, unless told otherwise: every timer
#: script on the key reads it, and a huge one stalls the server for the whole fleet.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20

#: A timer as the store's set takes it: ``(key, at_ms, delay_ms, schedule, payload)``.
_Encoded = tuple[str, int | None, int | None, str, str]


class TimerHost(Protocol):
    """What a scheduler's instance (``_engine/instance.py``) gives the ``Timers`` bound to
    it: its connection while it runs, the kinds it fires, its events and its clock."""

    @property
    def instance_id(self) -> str: ...

    @property
    def timer_kinds(self) -> Mapping[str, TimerKind]: ...

    @property
    def events(self) -> EventHub: ...

    @property
    def round_trip_sec(self) -> float: ...

    @property
    def server_offset_ms(self) -> float: ...

    def running_connection(self) -> Connection | None:
        """The instance's connection while it runs; None otherwise."""
        ...

    def fires_here(self, kind: str) -> bool:
        """Whether the instance runs and fires ``kind``."""
        ...

    def timer_set_here(self, kind: str, keys: TimerKeys, wake_ms: float) -> None:
        """A timer of a kind that ``fires_here``, set through the instance, falls due at
        ``wake_ms``."""
        ...


class Timers:
    """Sets, cancels and reads timers, keeping one connection from ``async with`` to its
    end (a process that fires no timers: a web app, a script)::

        async with Timers(RedisBackend(redis="redis://localhost:6379")) as timers:
            await timers.set("remind", "user:42", delay_ms=30 * 60_000,
                             payload={"text": "your cart"})

    The instances that fire a kind (``Scheduler.timer``) write its number of buckets in
    the store; ``Timers`` reads it there once per kind (or takes ``buckets=``). Its
    methods need it open (``async with``): a ``SchedulerStateError`` otherwise.

    Args:
        backend: The store's backend, as the scheduler that fires the timers uses it
            (the same prefix). None: ``RedisBackend()``, on ``redis://localhost:6379``.
        max_payload_bytes: The largest payload a timer may hold as stored, in bytes (1
            or more; default 1 MiB): a larger one is refused before anything is sent.

    Raises:
        InvalidOptionError: ``backend`` is not a ``RedisBackend``, or
            ``max_payload_bytes`` is not a whole number, 1 or more.

    Attributes:
        backend: The backend it uses.
        max_payload_bytes: The largest payload a timer may hold as stored, in bytes.
    """

    def __init__(
        self,
        backend: RedisBackend[Any] | None = None,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if backend is None:
            backend = RedisBackend()
        if not isinstance(backend, RedisBackend):
            raise InvalidOptionError(
                f"backend must be a RedisBackend or ValkeyBackend, got {type(backend).__name__}"
            )
        self.backend = backend
        self.max_payload_bytes = _check_payload_cap("max_payload_bytes", max_payload_bytes)
        self._conn: Connection | None = None
        #: The scheduler's instance this is bound to (``bound_timers``), if any.
        self._instance: TimerHost | None = None
        #: The number of buckets of kinds not registered here, as the store said.
        self._stored_buckets: dict[str, int] = {}

    async def __aenter__(self) -> Timers:
        if self._instance is not None or self._conn is not None:
            raise SchedulerStateError("this Timers is open already (or a scheduler's own)")
        self._conn = await self.backend.open_connection()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close_if_owned()

    async def set(
        self,
        kind: str,
        key: str,
        *,
        at: datetime | None = None,
        delay_ms: int | None = None,
        cron: str | None = None,
        every_ms: int | None = None,
        timezone: str = "UTC",
        payload: object = None,
        buckets: int | None = None,
    ) -> int:
        """Set ``key``'s timer of ``kind``, as ``Scheduler.set_timer`` does.

        Args:
            kind: The timer's kind.
            key: The key whose timer it is: any text of 1 to 1024 characters.
            at: When it is due (an aware datetime). Give ``at`` or ``delay_ms``, not
                both; with neither, a recurring timer is first due at its first fire
                time.
            delay_ms: How long from now it is due, in milliseconds on the server's clock
                (0 or more).
            cron: A cron expression (5 fields, or 6 with seconds first) that makes it
                recur.
            every_ms: An interval in milliseconds (more than 0) that makes it recur.
                Give ``cron`` or ``every_ms``, not both.
            timezone: The IANA time zone ``cron`` is read in (default ``"UTC"``).
            payload: What the handler gets back as ``TimerRun.payload``: bytes, or a
                JSON-able value (None: none); at most ``max_payload_bytes`` as stored.
            buckets: The kind's number of buckets. None: the one the kind's instances
                wrote in the store (read once per kind), else 1.

        Returns:
            The timer's generation: every set of a kind makes a higher one.
        """
        setting = TimerSetting(key, at, delay_ms, cron, every_ms, timezone, payload)
        (generation,) = await self.set_many(kind, (setting,), buckets=buckets)
        return generation

    async def set_many(
        self, kind: str, timers: Iterable[TimerSetting], *, buckets: int | None = None
    ) -> list[int]:
        """Set many timers of ``kind``, as ``Scheduler.set_timers`` does: each checked
        before any is sent, in round trips of up to 1000.

        Args:
            kind: The timers' kind.
            timers: The timers to set, one ``TimerSetting`` each.
            buckets: The kind's number of buckets, as ``set`` takes it.

        Returns:
            The timers' generations, in the order of ``timers``.
        """
        name = validate_kind(kind)
        encoded = [self._encode(setting) for setting in timers]
        if not encoded:
            return []
        async with self._store() as store:
            bucket_count = await self._buckets_of(store, name, buckets)
            return await self._write(store, name, encoded, bucket_count)

    async def _write(
        self, store: TimerStore, name: str, encoded: list[_Encoded], bucket_count: int
    ) -> list[int]:
        """Set the encoded timers in round trips of up to 1000: their generations."""
        generations: list[int] = []
        instance = self._instance
        fired_here = instance is not None and instance.fires_here(name)
        for start in range(0, len(encoded), _SET_PER_ROUND_TRIP):
            part = encoded[start : start + _SET_PER_ROUND_TRIP]
            with self._in_time():
                replies = await store.set_many(name, part, bucket_count)
            for (timer_key, _, delay, _, _), reply in zip(part, replies, strict=True):
                if isinstance(reply, BaseException):
                    raise reply
                generation, due_ms, replaced = reply
                generations.append(generation)
                if instance is None:
                    continue
                events = instance.events
                if events.on:
                    events.emit(
                        TimerSet(
                            instance=instance.instance_id,
                            kind=name,
                            key=timer_key,
                            generation=generation,
                            due_ms=due_ms,
                            replaced=replaced,
                        )
                    )
                if fired_here:
                    # Due sooner than the instance would look: it looks then.
                    wake_ms = wall_ms() + delay if delay is not None else float(due_ms)
                    keys = store.keys(name, timer_key, bucket_count)
                    instance.timer_set_here(name, keys, wake_ms)
        return generations

    async def _cancel_all(
        self, store: TimerStore, name: str, keys: list[str], bucket_count: int
    ) -> list[str]:
        """Cancel the keys' timers in round trips of up to 1000: the keys that had one."""
        found: list[str] = []
        instance = self._instance
        for start in range(0, len(keys), _SET_PER_ROUND_TRIP):
            part = keys[start : start + _SET_PER_ROUND_TRIP]
            with self._in_time():
                replies = await store.cancel_many(name, part, bucket_count)
            for timer_key, reply in zip(part, replies, strict=True):
                if isinstance(reply, BaseException):
                    raise reply
                if reply:
                    found.append(timer_key)
                if instance is not None and instance.events.on:
                    instance.events.emit(
                        TimerCancelled(
                            instance=instance.instance_id, kind=name, key=timer_key, found=reply
                        )
                    )
        return found

    async def _scan_all(
        self, store: TimerStore, name: str, bucket_count: int, match: str | None, most: int
    ) -> dict[str, TimerState]:
        """The kind's timers (those whose keys ``match``), each step of the scan within
        its deadline; ``InvalidOptionError`` past ``most`` of them."""
        found: dict[str, TimerState] = {}
        at: TimerCursor | None = (0, 0)
        while at is not None:
            with self._in_time():
                states, at = await store.scan(name, bucket_count, at, _SCAN_STEP, match)
            for state in states:
                found[state.key] = state
            if len(found) > most:
                raise InvalidOptionError(
                    f"timer kind {name!r} holds more than {most:,} timers"
                    + (" that match" if match else "")
                    + ": too many to read in one call"
                )
        return found

    async def apply(
        self,
        kind: str,
        timers: Iterable[TimerSetting],
        *,
        remove_others: bool = True,
        buckets: int | None = None,
    ) -> AppliedTimers:
        """Make ``kind``'s recurring timers exactly ``timers``: a table of tenants, each
        with its own schedule, kept in sync by calling this every minute. A key with no
        timer is set (created); one whose recurrence or payload differs, or that has a
        one-shot timer, is set again (changed: a new generation); one as given is left
        alone (nothing is written: applying the same set twice changes nothing); with
        ``remove_others``, a recurring timer of a key not in ``timers`` is cancelled
        (removed). One-shot timers of other keys are left alone. It reads the kind's
        timers once (a scan), then writes in round trips of up to 1000. A set or cancel
        made by another process meanwhile may be overwritten (the newest write wins).

        Args:
            kind: The timers' kind.
            timers: The recurring timers the kind is to hold, one ``TimerSetting`` each
                (``cron=`` or ``every_ms=``; ``at=`` or ``delay_ms=`` only says when a
                created one is first due), each key once; at most 100 000.
            remove_others: Cancel the kind's recurring timers whose keys are not in
                ``timers`` (default True).
            buckets: The kind's number of buckets, as ``set`` takes it.

        Returns:
            What changed (``AppliedTimers``).

        Raises:
            InvalidOptionError: A setting that does not recur, a key given twice, more
                than 100 000 settings, or a kind holding more than 100 000 timers (too
                many to read in one call), each before anything is written.
        """
        name = validate_kind(kind)
        settings = list(timers)
        if len(settings) > _APPLY_MAX:
            raise InvalidOptionError(
                f"apply takes at most {_APPLY_MAX:,} timers at once, got {len(settings):,}"
            )
        encoded = [self._encode(setting) for setting in settings]
        wanted: dict[str, _Encoded] = {}
        for timer in encoded:
            timer_key, schedule = timer[0], timer[3]
            if not schedule:
                raise InvalidOptionError(
                    f"timer {timer_key!r}: apply keeps recurring timers; give it cron= or "
                    "every_ms= (set one-shot timers with set or set_many)"
                )
            if timer_key in wanted:
                raise InvalidOptionError(f"timer {timer_key!r} is given twice: give each key once")
            wanted[timer_key] = timer
        async with self._store() as store:
            bucket_count = await self._buckets_of(store, name, buckets)
            held = await self._scan_all(store, name, bucket_count, None, _APPLY_MAX)
            created: list[str] = []
            changed: list[str] = []
            to_set: list[_Encoded] = []
            for timer_key, timer in wanted.items():
                old = held.get(timer_key)
                if old is None or old.due_ms is None:
                    created.append(timer_key)
                elif old.schedule == timer[3] and old.payload == timer[4]:
                    continue
                else:
                    changed.append(timer_key)
                to_set.append(timer)
            others = []
            if remove_others:
                others = [
                    timer_key
                    for timer_key, old in held.items()
                    if timer_key not in wanted and old.schedule and old.due_ms is not None
                ]
            await self._write(store, name, to_set, bucket_count)
            removed = await self._cancel_all(store, name, sorted(others), bucket_count)
        return AppliedTimers(
            created=tuple(created),
            changed=tuple(changed),
            removed=tuple(removed),
            unchanged=len(wanted) - len(to_set),
        )

    async def cancel_prefix(
        self, kind: str, prefix: str, *, limit: int = 1000, buckets: int | None = None
    ) -> int:
        """Cancel ``kind``'s timers whose keys start with ``prefix`` (a user's, a
        tenant's: ``"user:42:"``), at most ``limit`` of them per call: call again while
        it returns ``limit``. It scans the kind's keys (``HSCAN`` with a pattern) and
        cancels what it found, each as ``cancel`` does.

        Args:
            kind: The timers' kind.
            prefix: The start of the keys: 1 to 1024 characters, taken literally (``*``
                and ``?`` are no wildcards here).
            limit: The most timers cancelled in this call, 1 to 100 000 (default 1000).
            buckets: The kind's number of buckets, as ``set`` takes it.

        Returns:
            How many timers were cancelled.
        """
        name = validate_kind(kind)
        start = validate_timer_key(prefix)
        most = check_count("limit", limit, most=_APPLY_MAX)
        async with self._store() as store:
            bucket_count = await self._buckets_of(store, name, buckets)
            match = glob_literal(start) + "*"
            found: list[str] = []
            at: TimerCursor | None = (0, 0)
            while at is not None and len(found) < most:
                with self._in_time():
                    states, at = await store.scan(name, bucket_count, at, _SCAN_STEP, match)
                for state in states:
                    if state.key.startswith(start) and state.key not in found:
                        found.append(state.key)
            cancelled = await self._cancel_all(store, name, found[:most], bucket_count)
        return len(cancelled)

    async def cancel(self, kind: str, key: str, *, buckets: int | None = None) -> bool:
        """Cancel ``key``'s timer of ``kind``, as ``Scheduler.cancel_timer`` does.

        Args:
            kind: The timer's kind.
            key: Its key.
            buckets: The kind's number of buckets, as ``set`` takes it.

        Returns:
            True if the key had a timer, False if it had none.
        """
        name = validate_kind(kind)
        timer_key = validate_timer_key(key)
        async with self._store() as store:
            bucket_count = await self._buckets_of(store, name, buckets)
            with self._in_time():
                found = await store.cancel(name, timer_key, bucket_count)
        instance = self._instance
        if instance is not None and instance.events.on:
            instance.events.emit(
                TimerCancelled(instance=instance.instance_id, kind=name, key=timer_key, found=found)
            )
        return found

    async def get(self, kind: str, key: str, *, buckets: int | None = None) -> TimerInfo | None:
        """``key``'s timer of ``kind`` as the store holds it.

        Args:
            kind: The timer's kind.
            key: Its key.
            buckets: The kind's number of buckets, as ``set`` takes it.

        Returns:
            The timer, or None: the key has none, or its record does not read (it is
            quarantined; a set replaces it).
        """
        name = validate_kind(kind)
        timer_key = validate_timer_key(key)
        async with self._store() as store:
            bucket_count = await self._buckets_of(store, name, buckets)
            with self._in_time():
                state = await store.get(name, timer_key, bucket_count)
        if state is None:
            return None
        return timer_info(store, name, state, store.keys(name, timer_key, bucket_count).timers)

    # ---------------------------------------------------------------- the parts

    @property
    def _round_trip_sec(self) -> float:
        instance = self._instance
        return _ROUND_TRIP_SEC if instance is None else instance.round_trip_sec

    def _in_time(self) -> Within:
        """One call's round trips, within three round trips' deadline: a server that does
        not answer (frozen, overloaded) is a ``TransportError``, as a lost connection is."""
        return Within(self._round_trip_sec * 3, _not_answered)

    @asynccontextmanager
    async def _store(self) -> AsyncIterator[TimerStore]:
        """The timers' store: on this object's connection; bound to a scheduler, on its
        connection while it runs, else on a connection opened for the call."""
        prefix = self.backend.prefix
        if self._conn is not None:
            yield TimerStore(self._conn, prefix=prefix)
            return
        instance = self._instance
        if instance is None:
            raise SchedulerStateError(
                "open Timers with `async with Timers(backend) as timers:` before using it"
            )
        running = instance.running_connection()
        if running is not None:
            yield TimerStore(running, prefix=prefix)
            return
        conn = await self.backend.open_connection()
        try:
            yield TimerStore(conn, prefix=prefix)
        finally:
            await conn.close_if_owned()

    async def _buckets_of(self, timers: TimerStore, kind: str, buckets: int | None) -> int:
        """A kind's number of buckets: the registered handler's, else the one given, else
        the one the kind's instances wrote in the store (read once), else 1."""
        registered = None if self._instance is None else self._instance.timer_kinds.get(kind)
        if registered is not None:
            if buckets is not None and check_buckets(buckets) != registered.buckets:
                raise InvalidOptionError(
                    f"timer kind {kind!r} has {registered.buckets} bucket(s) here, not "
                    f"{buckets}: every process must use the same number"
                )
            return registered.buckets
        if buckets is not None:
            return check_buckets(buckets)
        if kind not in self._stored_buckets:
            where = TimerKeys.buckets_key(self.backend.prefix, kind)
            with self._in_time():
                stored = await timers.conn.execute(("GET", where))
            try:
                count = 1 if stored is None else check_buckets(int(stored))
            except (TypeError, ValueError, InvalidOptionError):
                raise InvalidOptionError(
                    f"the store holds {stored!r} as the number of buckets of timer kind "
                    f"{kind!r} ({where}), not a whole number from 1 to 1024: something else "
                    "wrote that key; pass buckets= as the kind's instances register it"
                ) from None
            self._stored_buckets[kind] = count
        return self._stored_buckets[kind]

    def _encode(self, setting: TimerSetting) -> _Encoded:
        """A setting as the store's set takes it; raises on a bad one, naming its key."""
        timer_key = validate_timer_key(setting.key)
        try:
            at_ms, delay = due_from(setting.at, setting.delay_ms)
            recurrence = Recurrence.make(setting.cron, setting.every_ms, setting.timezone)
        except AnarchonError as exc:
            raise type(exc)(f"timer {timer_key!r}: {exc.message}") from exc
        if at_ms is None and delay is None:
            if recurrence is None:
                raise InvalidOptionError(
                    f"timer {timer_key!r} needs a due time: at= (an aware datetime), "
                    "delay_ms=, cron= or every_ms="
                )
            offset_ms = 0.0 if self._instance is None else self._instance.server_offset_ms
            at_ms = recurrence.first_ms(int(wall_ms() + offset_ms))
        schedule = recurrence.encode() if recurrence else ""
        payload = encode_payload(setting.payload)
        # At most 4 bytes a character: most payloads need no second encoding to know.
        size = len(payload)
        if size * 4 > self.max_payload_bytes:
            size = len(payload.encode("utf-8"))
        if size > self.max_payload_bytes:
            # A scheduler's option has a name of its own.
            cap = "max_payload_bytes" if self._instance is None else "max_timer_payload_bytes"
            raise InvalidOptionError(
                f"timer {timer_key!r}: its payload is {size:,} bytes as stored, over "
                f"{cap} ({self.max_payload_bytes:,}); keep large data elsewhere (a database "
                f"row, an object store) and put its id in the payload, or raise {cap}"
            )
        return timer_key, at_ms, delay, schedule, payload


def bound_timers(backend: RedisBackend[Any], host: TimerHost, max_payload_bytes: int) -> Timers:
    """The timers of a scheduler: on its instance's connection while it runs."""
    timers = Timers(backend, max_payload_bytes=max_payload_bytes)
    timers._instance = host
    return timers


def _check_payload_cap(option: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(
            f"{option} must be a whole number of bytes, 1 or more, got {value!r}"
        )
    return value


def _not_answered(seconds: float) -> TransportError:
    return TransportError(
        f"the server did not answer within {seconds:g} s; check that it is not frozen or overloaded"
    )
