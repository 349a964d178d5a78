"""Strategies: how one winner of each slot is chosen, one class each.

The backend parses the user's ``strategy=`` (a name or a mapping, the public
``LeaseStrategy`` ... ``ScriptStrategy`` types) into one ``Strategy`` once, at its
construction. The strategy owns what differs between them: the options its schedulers,
jobs and timer kinds take (``rules``), the check of a job against what it remembers of a
slot (``check_job``), the servers it runs on (``check_server``) and the store it opens
(``open``). The engine holds the store it opened and asks nothing about which strategy
chose it.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Required, TypedDict

from .._errors import InvalidOptionError, UnsupportedServerError
from .._model.job import Job
from .._model.options import COMMON_JOB_OPTIONS, LEASE_JOB_OPTIONS, LEASE_SETTINGS, OptionRules
from ..clients import Connection
from .claim_only import IdmpStore, ScriptStore, StreamIdStore
from .contract import Store
from .lease import LeaseStore
from .server import ServerInfo

__all__ = [
    "IdmpStrategy",
    "LeaseStrategy",
    "ScriptStrategy",
    "Strategy",
    "StoreOptions",
    "StreamIdStrategy",
    "parse_strategy",
]


class LeaseStrategy(TypedDict):
    """``{"name": "lease"}``: leases, backups, retries, overlap protection, catch-up
    (the same as ``strategy="lease"``, the default).

    Attributes:
        name: ``"lease"``.
    """

    name: Literal["lease"]


class StreamIdStrategy(TypedDict):
    """``{"name": "stream-id"}``: the slot is the stream entry id; remembers forever
    (the same as ``strategy="stream-id"``). A claim-only strategy.

    Attributes:
        name: ``"stream-id"``.
    """

    name: Literal["stream-id"]


class IdmpStrategy(TypedDict, total=False):
    """``{"name": "idmp", "duration_sec": 300, "max_size": 1000}``: idempotent XADD
    (Redis 8.6+; not with ``ValkeyBackend``). A claim-only strategy. A setting out of
    its bounds is an ``InvalidOptionError`` when the backend is made.

    Attributes:
        name: ``"idmp"`` (required).
        duration_sec: How long Redis remembers a run's id, in seconds: 1 to 86400
            (default 300). It must be greater than every job's
            ``jitter_ms + max_late_ms``.
        max_size: How many run ids Redis keeps per job: 1 to 10000 (default 1000).
    """

    name: Required[Literal["idmp"]]
    duration_sec: int
    max_size: int


class ScriptStrategy(TypedDict, total=False):
    """``{"name": "script", "window_ms": 300000}``: a Lua script remembers each claimed
    run for a window. A claim-only strategy. A setting out of its bounds is an
    ``InvalidOptionError`` when the backend is made.

    Attributes:
        name: ``"script"`` (required).
        window_ms: How long a claimed run is remembered, in milliseconds: 1 to 2^53
            (default 300 000). It must be greater than every job's
            ``jitter_ms + max_late_ms``.
    """

    name: Required[Literal["script"]]
    window_ms: int


class StoreOptions(TypedDict):
    """What the scheduler tells the backend when it opens the store."""

    runner: str
    history_size: int
    history_ttl_ms: int | None


class Strategy(ABC):
    """One way to choose the winner of a slot, with its settings checked."""

    #: Its name, as users give it and the store records it.
    name: ClassVar[str]
    #: Its settings beyond the name, each with its bounds (whole numbers).
    settings: ClassVar[Mapping[str, tuple[int, int]]] = {}
    #: The options its schedulers, jobs and timer kinds take.
    rules: ClassVar[OptionRules]
    #: The class of its store, which takes its settings as keywords.
    store: ClassVar[Callable[..., Store]]

    def check_job(self, job: Job) -> None:  # noqa: B027 - most strategies take every job
        """Refuse a job that this strategy cannot run as promised (none by default)."""

    def check_server(self, server: ServerInfo) -> None:  # noqa: B027 - most run on any
        """Refuse a server this strategy cannot run on (none by default)."""

    def open(
        self, conn: Connection, server: ServerInfo, prefix: str, options: StoreOptions
    ) -> Store:
        """Its store on a checked connection, with its settings."""
        return self.store(
            conn,
            prefix=prefix,
            runner=options["runner"],
            history_size=options["history_size"],
            history_ttl_ms=options["history_ttl_ms"],
            trim_runs_by_id=server.trims_streams_by_id,
            **{name: getattr(self, name) for name in self.settings},
        )


class Leasing(Strategy):
    """The lease strategy: leases, heartbeats, backups, retries, overlap, catch-up, timers."""

    name = "lease"
    store = LeaseStore
    rules = OptionRules(
        strategy="lease",
        job_options=COMMON_JOB_OPTIONS | LEASE_JOB_OPTIONS,
        scheduler_settings=LEASE_SETTINGS,
        max_attempts_default=3,
        timers_refused=None,
    )


def _claim_only_rules(name: str) -> OptionRules:
    return OptionRules(
        strategy=name,
        job_options=COMMON_JOB_OPTIONS,
        scheduler_settings=frozenset(),
        max_attempts_default=1,
        timers_refused=(
            f"timers fire with the lease strategy's rules; this scheduler's backend uses "
            f"{name!r}: use a backend with the 'lease' strategy (the default) for the "
            "scheduler that fires timers"
        ),
    )


class StreamIds(Strategy):
    """The stream-id strategy: the slot is the runs stream's entry id."""

    name = "stream-id"
    store = StreamIdStore
    rules = _claim_only_rules("stream-id")


@dataclass(frozen=True, slots=True)
class Idmp(Strategy):
    """The idmp strategy: Redis 8.6's idempotent XADD remembers each slot's entry."""

    duration_sec: int = 300
    max_size: int = 1000

    name = "idmp"
    store = IdmpStore
    settings: ClassVar[Mapping[str, tuple[int, int]]] = {
        "duration_sec": (1, 86_400),
        "max_size": (1, 10_000),
    }
    rules = _claim_only_rules("idmp")

    def check_job(self, job: Job) -> None:
        if job.late_window_ms >= self.duration_sec * 1000:
            raise InvalidOptionError(
                f"job {job.name!r}: jitter_ms + max_late_ms ({job.late_window_ms} ms) must "
                f"be less than the idmp strategy's duration_sec ({self.duration_sec} s), or a "
                "late claim could come after Redis forgot the slot's id and run it again; "
                "lower max_late_ms or jitter_ms, or raise duration_sec"
            )

    def check_server(self, server: ServerInfo) -> None:
        if not server.has_idempotent_xadd:
            raise UnsupportedServerError(
                f"the 'idmp' strategy needs Redis 8.6 or newer (idempotent XADD); this "
                f"server is {server.family.capitalize()} {server.version[0]}."
                f"{server.version[1]}: use 'lease' (the default), 'script' or 'stream-id'"
            )


@dataclass(frozen=True, slots=True)
class Scripted(Strategy):
    """The script strategy: a script remembers each claimed slot for ``window_ms``."""

    window_ms: int = 300_000

    name = "script"
    store = ScriptStore
    settings: ClassVar[Mapping[str, tuple[int, int]]] = {"window_ms": (1, 2**53)}
    rules = _claim_only_rules("script")

    def check_job(self, job: Job) -> None:
        if job.late_window_ms >= self.window_ms:
            raise InvalidOptionError(
                f"job {job.name!r}: jitter_ms + max_late_ms ({job.late_window_ms}) must "
                f"be less than the script strategy's window_ms ({self.window_ms}), or a "
                "late claim could find the slot forgotten and run it again; lower max_late_ms "
                "or raise window_ms"
            )


_STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Leasing, StreamIds, Idmp, Scripted)
}


def parse_strategy(strategy: object, *, allow_idmp: bool) -> Strategy:
    """The strategy a name or mapping names, its settings checked; unknown or misplaced
    settings are errors."""
    if isinstance(strategy, str):
        name: object = strategy
        given: dict[str, Any] = {}
    elif isinstance(strategy, Mapping):
        if "name" not in strategy:
            raise InvalidOptionError("a strategy mapping needs a 'name', such as {'name': 'lease'}")
        name = strategy["name"]
        given = {k: v for k, v in strategy.items() if k != "name"}
    else:
        raise InvalidOptionError(
            f"strategy must be a name such as 'lease' or a mapping {{'name': ...}}, "
            f"got {type(strategy).__name__}"
        )
    cls = _STRATEGIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidOptionError(
            f"unknown strategy {name!r}; choose one of {', '.join(_STRATEGIES)}"
        )
    if cls is Idmp and not allow_idmp:
        raise InvalidOptionError(
            "ValkeyBackend does not offer the 'idmp' strategy (Valkey has no idempotent XADD): "
            "use 'lease', 'script' or 'stream-id'"
        )
    allowed = cls.settings
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        elsewhere = sorted(
            other.name for other in _STRATEGIES.values() if set(unknown) <= set(other.settings)
        )
        hint = f" ({', '.join(unknown)} belongs to {' or '.join(elsewhere)})" if elsewhere else ""
        raise InvalidOptionError(
            f"strategy {cls.name!r} has no setting(s) {unknown}{hint}; its settings are "
            f"{sorted(allowed) or 'none'}"
        )
    for key, (low, high) in allowed.items():
        if key in given:
            value = given[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidOptionError(
                    f"strategy {cls.name!r} setting {key} must be a whole number from {low} to "
                    f"{high}, got {value!r}"
                )
    return cls(**given)
