"""anarchon: distributed cron and durable timers on Redis and Valkey.

Many copies of an application run the same jobs; for every scheduled fire
time exactly one copy runs the job. Business code sets per-key timers that
fire once across the fleet and survive restarts. This module is the whole
public API.
"""

from ._backend import (
    ClaimOnly,
    IdmpStrategy,
    Leases,
    LeaseStrategy,
    RedisBackend,
    ScriptStrategy,
    StreamIdStrategy,
    ValkeyBackend,
)
from ._errors import (
    AnarchonError,
    ConnectionFailedError,
    InvalidJobError,
    InvalidOptionError,
    InvalidScheduleError,
    LeaseLostError,
    RunOverlapError,
    SchedulerStateError,
    StoreFormatError,
    UnsupportedClientError,
    UnsupportedServerError,
)
from ._events import (
    ClaimAnswered,
    Event,
    EventStream,
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
from ._inspector import Inspector
from ._logging import JsonLogFormatter
from ._schedule import CronSchedule, IntervalSchedule, Schedule
from ._scheduler import Scheduler
from ._serve import serve
from ._structures import (
    InstanceInfo,
    JobInfo,
    LeaseInfo,
    OverlapPolicy,
    Run,
    RunResult,
    RunStatus,
    TimerInfo,
    TimerKindInfo,
    TimerRun,
    TimerSetting,
    TimerStatus,
    TimerTrigger,
    Trigger,
)
from ._version import __version__ as __version__

__all__ = [
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
    "StoreFormatError",
    "StreamIdStrategy",
    "TimerInfo",
    "TimerKindInfo",
    "TimerRun",
    "TimerSetting",
    "TimerStatus",
    "TimerTrigger",
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
    "TimerCancelled",
    "TimerFired",
    "TimerSet",
    "serve",
]
