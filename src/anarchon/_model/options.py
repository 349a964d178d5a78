"""The options of a scheduler, of a job and of a timer kind: each written once, here,
with its default and its check. ``Scheduler`` takes them as given and hands them on."""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, TypedDict

from .._errors import InvalidJobError, InvalidOptionError
from .exclusions import Excludes, make_exclusion
from .job import (
    Handler,
    Job,
    ScheduleSpec,
    check_count,
    check_duration_ms,
    exception_types,
    is_async_callable,
    make_schedule,
    overlap_policy,
    takes_run_argument,
    validate_job_name,
)
from .schedule import BoundedSchedule, SlotClock
from .timer import TimerKind, validate_kind
from .values import OverlapPolicy

#: The most attempts a run or a firing may take.
MAX_ATTEMPTS = 1000
#: The longest lease: how long a dead runner's slot waits for a backup. The heartbeats
#: keep a long run's lease alive, so a lease need not be as long as the run.
MAX_LEASE_MS = 24 * 3600 * 1000
#: The most results a job's history keeps (the scripts trim by rank with it).
MAX_HISTORY_SIZE = 1_000_000
#: The most runs ``max_runs`` may allow.
MAX_RUNS = 1_000_000_000

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_HISTORY_SIZE",
    "MAX_LEASE_MS",
    "JobOptions",
    "LeaseJobOptions",
    "SchedulerSettings",
    "TimerKindOptions",
    "check_buckets",
    "check_instance_id",
    "default_instance_id",
    "make_job",
    "make_timer_kind",
    "refuse_lease_options",
]


class JobOptions(TypedDict, total=False):
    """A job's options with every strategy (``Scheduler.job`` says what each does)."""

    #: Fire at fixed intervals aligned to the Unix epoch, instead of a schedule.
    every_ms: int | None
    #: The job's name (default: the handler's ``__name__``).
    name: str | None
    #: The IANA time zone of a cron schedule (default ``"UTC"``).
    timezone: str
    #: Wait a random part of this before claiming (default 0).
    jitter_ms: int
    #: How late a slot may still be claimed for the first time (default 60 s).
    max_late_ms: int
    #: How long an attempt may run (default: as long as it likes).
    timeout_ms: int | None
    #: The most of its runs at once on one instance (default: the instance's bound).
    max_concurrent: int | None
    #: Its first slot is at or after this instant (default: none).
    start_at: datetime | None
    #: Its last slot is before this instant; then it is finished (default: none).
    end_at: datetime | None


class LeaseJobOptions(JobOptions, total=False):
    """A job's options with the lease strategy: the common ones and these."""

    #: What a slot does while an older run is unsettled (default ``"skip"``).
    overlap: OverlapPolicy | bool | None
    #: Every attempt counts, crashed or failed (default 3).
    max_attempts: int | None
    #: Run the slots missed in this window on start and after a gap (default 0).
    catch_up_ms: int | None
    #: The delay before the second attempt, doubling for each later one (default: the
    #: scheduler's).
    retry_delay_ms: int | None
    #: Retry only these exceptions (default: every one).
    retry_on: type[Exception] | tuple[type[Exception], ...] | None
    #: The most of its runs at once in the whole fleet (default: no limit).
    max_concurrent_fleet: int | None
    #: The slots of its schedule that do not run (default: none).
    exclude: str | Iterable[date | str] | Excludes | None
    #: How many runs may end (ok or finally failed) in the fleet; then it is finished
    #: (default: no bound).
    max_runs: int | None
    #: Paused once this many of its slots in a row finally failed (default: never).
    pause_after_failures: int | None


#: The options every strategy's jobs take, and those only the lease strategy's take.
COMMON_JOB_OPTIONS = frozenset(JobOptions.__annotations__)
LEASE_JOB_OPTIONS = frozenset(LeaseJobOptions.__annotations__) - COMMON_JOB_OPTIONS
#: The scheduler's settings that only the lease strategy has.
LEASE_SETTINGS = frozenset(("lease_ms", "heartbeat_ms", "retry_delay_ms", "timer_poll_ms"))


@dataclass(frozen=True, slots=True, kw_only=True)
class OptionRules:
    """What a strategy's schedulers, jobs and timer kinds take (``_store/strategy.py``
    gives each strategy its rules)."""

    #: The strategy's name, for messages.
    strategy: str
    #: The options its jobs take.
    job_options: frozenset[str]
    #: The scheduler settings it takes beyond the common ones.
    scheduler_settings: frozenset[str]
    #: A job's max_attempts when none is given.
    max_attempts_default: int
    #: Why it fires no timers (None: it fires them).
    timers_refused: str | None


def refuse_lease_options(
    rules: OptionRules, options: Mapping[str, object], allowed: frozenset[str]
) -> None:
    """A claim-only strategy holds no leases: a lease option given to it is an error."""
    given = sorted(
        name for name, value in options.items() if value is not None and name not in allowed
    )
    if given:
        raise InvalidOptionError(
            f"{', '.join(given)}: lease option(s) that the {rules.strategy!r} strategy does "
            "not have (it holds no leases: no backups, retries, overlap protection or "
            "catch-up); drop them, or use the 'lease' strategy"
        )


def make_job(
    handler: Handler,
    schedule: ScheduleSpec | None,
    options: Mapping[str, Any],
    *,
    rules: OptionRules,
    taken: Mapping[str, object],
) -> Job:
    """A job from its handler, schedule and options, every option checked; ``taken``
    holds the names of the jobs already registered."""
    unknown = sorted(set(options) - COMMON_JOB_OPTIONS - LEASE_JOB_OPTIONS)
    if unknown:
        raise InvalidOptionError(
            f"unknown job option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(sorted(rules.job_options))}"
        )
    if not callable(handler):
        raise InvalidJobError(f"a job's handler must be callable, got {handler!r}")
    given_name = options.get("name")
    name = validate_job_name(
        given_name if given_name is not None else getattr(handler, "__name__", None)
    )
    if name in taken:
        raise InvalidJobError(
            f"a job named {name!r} already exists on this scheduler; give one of them "
            "another name with name=..."
        )
    refuse_lease_options(
        rules, {key: options.get(key) for key in LEASE_JOB_OPTIONS}, rules.job_options
    )
    max_attempts = options.get("max_attempts")
    attempts = check_count(
        "max_attempts",
        rules.max_attempts_default if max_attempts is None else max_attempts,
        most=MAX_ATTEMPTS,
    )
    job_schedule = make_schedule(schedule, options.get("every_ms"), options.get("timezone", "UTC"))
    start_at, end_at = _bounds(options.get("start_at"), options.get("end_at"))
    if start_at is not None or end_at is not None:
        job_schedule = BoundedSchedule(job_schedule, start_at, end_at)
    max_runs = options.get("max_runs")
    catch_up_ms = options.get("catch_up_ms")
    timeout_ms = options.get("timeout_ms")
    retry_delay_ms = options.get("retry_delay_ms")
    return Job(
        name=name,
        handler=handler,
        schedule=job_schedule,
        clock=SlotClock(job_schedule),
        overlap_policy=overlap_policy(options.get("overlap")),
        max_attempts=attempts,
        catch_up_ms=check_duration_ms(
            "catch_up_ms", 0 if catch_up_ms is None else catch_up_ms, allow_zero=True
        ),
        jitter_ms=check_duration_ms("jitter_ms", options.get("jitter_ms", 0), allow_zero=True),
        max_late_ms=check_duration_ms(
            "max_late_ms", options.get("max_late_ms", 60_000), allow_zero=True
        ),
        takes_run=takes_run_argument(handler, name),
        is_async=is_async_callable(handler),
        timeout_ms=None if timeout_ms is None else check_duration_ms("timeout_ms", timeout_ms),
        retry_delay_ms=None
        if retry_delay_ms is None
        else check_duration_ms("retry_delay_ms", retry_delay_ms, allow_zero=True),
        retry_on=exception_types("retry_on", options.get("retry_on")),
        max_concurrent=own_bound(options.get("max_concurrent")),
        max_concurrent_fleet=fleet_bound(options.get("max_concurrent_fleet")),
        exclude=make_exclusion(options.get("exclude"), options.get("timezone", "UTC")),
        start_at=start_at,
        end_at=end_at,
        max_runs=None if max_runs is None else check_count("max_runs", max_runs, most=MAX_RUNS),
        pause_after_failures=None
        if (after := options.get("pause_after_failures")) is None
        else check_count("pause_after_failures", after, most=MAX_ATTEMPTS),
    )


def _bounds(start_at: object, end_at: object) -> tuple[datetime | None, datetime | None]:
    """``start_at`` and ``end_at``, checked: aware datetimes, the end after the start."""
    for option, value in (("start_at", start_at), ("end_at", end_at)):
        if value is not None and not (isinstance(value, datetime) and value.tzinfo is not None):
            raise InvalidOptionError(
                f"{option} must be an aware datetime (such as datetime(2027, 1, 1, "
                f"tzinfo=UTC)), got {value!r}"
            )
    if isinstance(start_at, datetime) and isinstance(end_at, datetime) and end_at <= start_at:
        raise InvalidOptionError(
            f"end_at ({end_at.isoformat()}) must be after start_at ({start_at.isoformat()})"
        )
    return (
        start_at.astimezone(UTC) if isinstance(start_at, datetime) else None,
        end_at.astimezone(UTC) if isinstance(end_at, datetime) else None,
    )


def check_buckets(buckets: object) -> int:
    if isinstance(buckets, bool) or not isinstance(buckets, int) or not 1 <= buckets <= 1024:
        raise InvalidOptionError(f"buckets must be a whole number from 1 to 1024, got {buckets!r}")
    return buckets


class TimerKindOptions(TypedDict, total=False):
    """A timer kind's options (``Scheduler.timer`` says what each does)."""

    #: Failed and crashed attempts a firing may take (default 3).
    max_attempts: int
    #: The delay before the second attempt, doubling for each later one (default: the
    #: scheduler's).
    retry_delay_ms: int | None
    #: The hash tags the kind is spread over (default 1).
    buckets: int
    #: The most of its firings at once on one instance (default: the instance's bound).
    max_concurrent: int | None
    #: The most of its firings at once in the whole fleet (default: no limit).
    max_concurrent_fleet: int | None
    #: At most ``count`` of its firings start in any ``period_ms`` across the fleet
    #: (default: no limit).
    rate_limit: tuple[int, int] | None
    #: A key's group is its text before this separator (default: no key groups).
    group_by: str | None
    #: The most firings of one key group at once in the whole fleet (default: no limit).
    max_concurrent_per_group: int | None


def make_timer_kind(
    handler: Any,
    kind: str,
    options: Mapping[str, Any],
    *,
    rules: OptionRules,
    taken: Mapping[str, object],
) -> TimerKind:
    """A kind of timer from its handler and options, every option checked; ``taken``
    holds the kinds already registered."""
    unknown = sorted(set(options) - set(TimerKindOptions.__annotations__))
    if unknown:
        raise InvalidOptionError(
            f"unknown timer option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(sorted(TimerKindOptions.__annotations__))}"
        )
    if not callable(handler):
        raise InvalidJobError(f"a timer's handler must be callable, got {handler!r}")
    if rules.timers_refused is not None:
        raise InvalidOptionError(rules.timers_refused)
    name = validate_kind(kind)
    if name in taken:
        raise InvalidJobError(f"a timer kind named {name!r} already has a handler here")
    max_attempts = check_count("max_attempts", options.get("max_attempts", 3), most=MAX_ATTEMPTS)
    retry_delay_ms = options.get("retry_delay_ms")
    buckets = check_buckets(options.get("buckets", 1))
    fleet = fleet_bound(options.get("max_concurrent_fleet"))
    if fleet is not None:
        shared_by_buckets("max_concurrent_fleet", fleet, buckets)
    rate = rate_limit(options.get("rate_limit"))
    if rate is not None:
        shared_by_buckets("rate_limit's count", rate[0], buckets)
    group_by, per_group = key_groups(
        options.get("group_by"), options.get("max_concurrent_per_group"), buckets
    )
    return TimerKind(
        name=name,
        handler=handler,
        max_attempts=max_attempts,
        retry_delay_ms=None
        if retry_delay_ms is None
        else check_duration_ms("retry_delay_ms", retry_delay_ms, allow_zero=True),
        buckets=buckets,
        takes_run=takes_run_argument(handler, name),
        is_async=is_async_callable(handler),
        max_concurrent=own_bound(options.get("max_concurrent")),
        max_concurrent_fleet=fleet,
        rate_limit=rate,
        group_by=group_by,
        max_concurrent_per_group=per_group,
    )


#: The longest ``group_by`` separator.
_GROUP_BY_MAX = 16


def key_groups(group_by: object, per_group: object, buckets: int) -> tuple[str | None, int | None]:
    """A kind's ``group_by`` and ``max_concurrent_per_group``, checked: both or neither,
    and one bucket (a group's timers and its permits must share a hash tag)."""
    if group_by is None and per_group is None:
        return None, None
    if group_by is None or per_group is None:
        raise InvalidOptionError(
            "give group_by and max_concurrent_per_group together: group_by says what a "
            "key's group is (its text before that separator, e.g. ':' for 'tenant-7:...'), "
            "max_concurrent_per_group how many of a group's firings go on at once"
        )
    if (
        not isinstance(group_by, str)
        or not 1 <= len(group_by) <= _GROUP_BY_MAX
        or not group_by.isprintable()
    ):
        raise InvalidOptionError(
            f"group_by must be a separator of 1 to {_GROUP_BY_MAX} printable characters "
            f"(e.g. ':'), got {group_by!r}"
        )
    if buckets != 1:
        raise InvalidOptionError(
            f"group_by needs buckets=1, got buckets={buckets}: a key group's timers and "
            "its permits must share one hash tag"
        )
    return group_by, check_count("max_concurrent_per_group", per_group, most=MAX_FLEET_PERMITS)


def rate_limit(value: object) -> tuple[int, int] | None:
    """A timer kind's ``rate_limit``, checked: ``(count, period_ms)``."""
    if value is None:
        return None
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise InvalidOptionError(
            "rate_limit must be (count, period_ms): at most count firings start in any "
            f"period_ms across the fleet, e.g. (100, 60_000); got {value!r}"
        )
    count = check_count("rate_limit's count", value[0], most=MAX_FLEET_PERMITS)
    period_ms = check_duration_ms("rate_limit's period_ms", value[1], most=MAX_LEASE_MS)
    return (count, period_ms)


def shared_by_buckets(option: str, count: int, buckets: int) -> None:
    """A kind's fleet limit is held by its buckets in equal shares (each bucket's keys
    may live on another cluster node): the count must be a multiple of ``buckets``."""
    if count % buckets:
        lower, higher = count // buckets * buckets, (count // buckets + 1) * buckets
        raise InvalidOptionError(
            f"{option} ({count}) must be a multiple of buckets ({buckets}): each bucket "
            f"holds an equal share of it; use {lower or higher} or {higher}"
        )


#: An instance id goes into stored records (``|`` separates their fields) and logs.
_INSTANCE_ID = re.compile(r"[^|\x00-\x1f\x7f-\x9f]{1,200}")


def check_instance_id(instance_id: object) -> str:
    if not isinstance(instance_id, str) or not _INSTANCE_ID.fullmatch(instance_id):
        raise InvalidOptionError(
            "instance_id must be a non-empty string of up to 200 characters without '|' "
            f"or control characters, got {instance_id!r}"
        )
    return instance_id


def own_bound(max_concurrent: object) -> int | None:
    """A job's or a timer kind's own bound on its runs at once on an instance, checked."""
    if max_concurrent is None:
        return None
    return check_count("max_concurrent", max_concurrent, most=MAX_CONCURRENT)


def fleet_bound(max_concurrent_fleet: object) -> int | None:
    """A job's or a timer kind's bound on its runs at once in the whole fleet, checked:
    each run holds one of its permits in the store while it runs."""
    if max_concurrent_fleet is None:
        return None
    return check_count("max_concurrent_fleet", max_concurrent_fleet, most=MAX_FLEET_PERMITS)


#: An instance's bound on handlers running at once, unless told otherwise: room for a
#: small service's work, not for a flood of timers due together to start all at once.
DEFAULT_MAX_CONCURRENT = 100
#: The largest bound an instance may be given (None lifts it).
MAX_CONCURRENT = 1_000_000
#: The largest fleet-wide bound of a job or a timer kind: its permits are members of one
#: sorted set in the store.
MAX_FLEET_PERMITS = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerSettings:
    """A scheduler's options, checked, with their defaults filled in."""

    lease_ms: int
    heartbeat_ms: int
    history_size: int
    history_ttl_ms: int | None
    instance_id: str
    #: The process the default ``instance_id`` was made in; None when the application
    #: gave one. A child forked from it makes its own at start.
    default_id_pid: int | None
    stop_grace_ms: int
    retry_delay_ms: int
    timer_poll_ms: int
    #: The most handlers that run at once on the instance (None: no bound).
    max_concurrent: int | None = None

    @classmethod
    def make(
        cls,
        *,
        rules: OptionRules,
        lease_ms: int | None,
        heartbeat_ms: int | None,
        history_size: int,
        history_ttl_ms: int | None,
        instance_id: str | None,
        stop_grace_ms: int,
        retry_delay_ms: int | None,
        timer_poll_ms: int | None,
        max_concurrent: int | None = DEFAULT_MAX_CONCURRENT,
    ) -> SchedulerSettings:
        refuse_lease_options(
            rules,
            {
                "lease_ms": lease_ms,
                "heartbeat_ms": heartbeat_ms,
                "retry_delay_ms": retry_delay_ms,
                "timer_poll_ms": timer_poll_ms,
            },
            rules.scheduler_settings,
        )
        lease = check_duration_ms(
            "lease_ms", 30_000 if lease_ms is None else lease_ms, most=MAX_LEASE_MS
        )
        # By default a third of the lease (10 s for the default 30 s lease).
        heartbeat = check_duration_ms(
            "heartbeat_ms", max(lease // 3, 1) if heartbeat_ms is None else heartbeat_ms
        )
        if heartbeat * 2 > lease:
            raise InvalidOptionError(
                f"heartbeat_ms ({heartbeat}) must be at most half of lease_ms ({lease}), so "
                "that a late heartbeat still arrives before the lease expires; leave "
                "heartbeat_ms out to get a third of the lease"
            )
        check_count("history_size", history_size, most=MAX_HISTORY_SIZE)
        return cls(
            lease_ms=lease,
            heartbeat_ms=heartbeat,
            history_size=history_size,
            history_ttl_ms=None
            if history_ttl_ms is None
            else check_duration_ms("history_ttl_ms", history_ttl_ms),
            instance_id=check_instance_id(
                default_instance_id() if instance_id is None else instance_id
            ),
            default_id_pid=os.getpid() if instance_id is None else None,
            stop_grace_ms=check_duration_ms("stop_grace_ms", stop_grace_ms, allow_zero=True),
            retry_delay_ms=check_duration_ms(
                "retry_delay_ms",
                1_000 if retry_delay_ms is None else retry_delay_ms,
                allow_zero=True,
            ),
            timer_poll_ms=check_duration_ms(
                "timer_poll_ms", 1_000 if timer_poll_ms is None else timer_poll_ms
            ),
            max_concurrent=own_bound(max_concurrent),
        )


def default_instance_id() -> str:
    """``host:pid:random``: this process's, so a child forked from it makes its own."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
