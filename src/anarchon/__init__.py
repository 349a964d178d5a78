"""anarchon: distributed cron and durable timers on Redis and Valkey.

Many copies of an application run the same jobs; for every scheduled fire
time one copy runs the job, and another takes it over if that copy dies.
Each attempt of a slot is started by exactly one instance, each slot that
starts runs at least once (a new attempt follows a failure, a stop or a lost
lease, while attempts are left), and a slot that does not start (skipped by
the overlap policy, a pause or lateness) is recorded or logged, never silently
lost.
Business code sets per-key timers that fire on one copy of the fleet and
survive restarts.
This module is the whole public API.
"""

from types import FunctionType as _FunctionType

from ._errors import (
    AnarchonError,
    ConnectionFailedError,
    InvalidJobError,
    InvalidOptionError,
    InvalidScheduleError,
    LeaseLostError,
    RunOverlapError,
    SchedulerStateError,
    ServerReplyError,
    StoreFormatError,
    TransportError,
    UnsupportedClientError,
    UnsupportedServerError,
)
from ._model.exclusions import Excludes
from ._model.schedule import (
    CalendarInterval,
    CombinedSchedule,
    CronSchedule,
    IntervalSchedule,
    Schedule,
)
from ._model.values import (
    AppliedTimers,
    AuditEntry,
    BackfillInfo,
    BackfillStatus,
    InstanceInfo,
    JobInfo,
    LeaseInfo,
    OverlapPolicy,
    Run,
    RunResult,
    RunStatus,
    TimerInfo,
    TimerKindInfo,
    TimerPage,
    TimerRun,
    TimerSetting,
    TimerStatus,
    TimerTrigger,
    Trigger,
)
from ._observe.events import (
    ClaimAnswered,
    DefinitionOutdated,
    Event,
    EventStream,
    JobPaused,
    LeaseLost,
    RunFinished,
    RunRetried,
    RunStarted,
    ServerBack,
    ServerUnreachable,
    SlotSkipped,
    TimerCancelled,
    TimerFired,
    TimerSet,
)
from ._observe.logs import JsonLogFormatter
from ._ops.inspector import Inspector
from ._ops.serve import serve
from ._scheduler import Scheduler
from ._store.backend import ClaimOnly, Leases, RedisBackend, ValkeyBackend
from ._store.strategy import IdmpStrategy, LeaseStrategy, ScriptStrategy, StreamIdStrategy
from ._timers import Timers
from ._version import __version__ as __version__

__all__ = [
    "AppliedTimers",
    "AuditEntry",
    "BackfillInfo",
    "BackfillStatus",
    "CalendarInterval",
    "CombinedSchedule",
    "Excludes",
    "AnarchonError",
    "ClaimOnly",
    "ConnectionFailedError",
    "CronSchedule",
    "IntervalSchedule",
    "InvalidJobError",
    "InvalidOptionError",
    "IdmpStrategy",
    "InvalidScheduleError",
    "Inspector",
    "InstanceInfo",
    "JobInfo",
    "LeaseInfo",
    "JsonLogFormatter",
    "LeaseLostError",
    "LeaseStrategy",
    "Leases",
    "RedisBackend",
    "Run",
    "OverlapPolicy",
    "RunOverlapError",
    "RunResult",
    "RunStatus",
    "Schedule",
    "Scheduler",
    "ScriptStrategy",
    "SchedulerStateError",
    "ServerReplyError",
    "StoreFormatError",
    "StreamIdStrategy",
    "TimerInfo",
    "TimerKindInfo",
    "TimerPage",
    "TimerRun",
    "TimerSetting",
    "TimerStatus",
    "TimerTrigger",
    "Timers",
    "TransportError",
    "Trigger",
    "UnsupportedClientError",
    "UnsupportedServerError",
    "ValkeyBackend",
    "ClaimAnswered",
    "Event",
    "EventStream",
    "LeaseLost",
    "RunFinished",
    "RunRetried",
    "RunStarted",
    "ServerBack",
    "ServerUnreachable",
    "SlotSkipped",
    "DefinitionOutdated",
    "JobPaused",
    "TimerCancelled",
    "TimerFired",
    "TimerSet",
    "serve",
]


def _report_public_names() -> None:
    """Public classes and functions say ``anarchon.Scheduler``, not the private module
    that defines them: in reprs, tracebacks and generated references."""
    for name in __all__:
        obj = globals()[name]
        if isinstance(obj, type | _FunctionType):
            obj.__module__ = __name__


_report_public_names()
