"""Bad input is refused when it is written, with an error that says what to do."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from anarchon import (
    ConnectionFailedError,
    InvalidJobError,
    InvalidOptionError,
    InvalidScheduleError,
    RedisBackend,
    Run,
    Scheduler,
    Timers,
    UnsupportedClientError,
    ValkeyBackend,
)


def handler() -> None:
    pass


def scheduler() -> Scheduler:
    return Scheduler(RedisBackend(redis="redis://127.0.0.1:1"))


def test_an_invalid_cron_string_is_refused_at_definition() -> None:
    with pytest.raises(InvalidScheduleError, match="fields"):
        scheduler().add_job(handler, "* * *", name="x")


def test_an_unknown_time_zone_is_refused_at_definition() -> None:
    with pytest.raises(InvalidScheduleError, match="unknown time zone"):
        scheduler().add_job(handler, "* * * * *", name="x", timezone="Europe/Atlantis")


def test_a_second_job_with_the_same_name_is_refused() -> None:
    s = scheduler()
    s.add_job(handler, "* * * * *", name="report")
    with pytest.raises(InvalidJobError, match="already exists"):
        s.add_job(handler, "*/5 * * * *", name="report")
    assert s.jobs == ["report"]


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a{b",
        "a}b",
        "{tag}",
        "has space",
        "tab\there",
        "x" * 201,
        "zero\u200bwidth",
        "bidi\u202eroll",
        "bom\ufeff",
        "soft\u00adhyphen",
        ".",
        "..",
    ],
)
def test_a_name_that_would_break_a_key_is_refused(name: str) -> None:
    with pytest.raises(InvalidJobError) as info:
        scheduler().add_job(handler, "* * * * *", name=name)
    assert info.value.code == "ANARCHON_INVALID_JOB"


def test_the_function_name_is_the_default_job_name() -> None:
    s = scheduler()

    @s.job("* * * * *")
    async def nightly_report() -> None:
        pass

    assert s.jobs == ["nightly_report"]


def two_parameters(a: object, b: object) -> None:
    pass


async def two_parameters_async(a: object, b: object) -> None:
    pass


def a_required_keyword(run: Run, *, key: str) -> None:
    pass


@pytest.mark.parametrize(
    "bad_handler",
    [two_parameters, two_parameters_async, a_required_keyword, lambda a, b: None],
    ids=["def f(a, b)", "async def f(a, b)", "def f(run, *, key)", "lambda a, b"],
)
def test_a_handler_that_can_take_neither_a_run_nor_nothing_is_refused_at_definition(
    bad_handler: Any,
) -> None:
    s = scheduler()
    with pytest.raises(InvalidJobError) as info:
        s.add_job(bad_handler, "* * * * *", name="x")
    message = str(info.value)
    assert "def handler()" in message
    assert "def handler(run: Run)" in message
    assert "sync or async" in message
    assert "defaults" in message
    assert s.jobs == []


def takes_nothing() -> None:
    pass


async def takes_the_run(run: Run) -> None:
    pass


def takes_the_run_and_defaults(run: Run, retries: int = 3, *, key: str = "k") -> None:
    pass


def takes_anything(*args: object, **kwargs: object) -> None:
    pass


@pytest.mark.parametrize(
    "good_handler",
    [
        takes_nothing,
        takes_the_run,
        takes_the_run_and_defaults,
        takes_anything,
        functools.partial(two_parameters, "bound"),
        max,  # a builtin without a readable signature: trusted
    ],
    ids=["def f()", "async def f(run)", "def f(run, x=3, *, k=...)", "def f(*a, **k)",
         "partial(f, a)", "uninspectable"],
)  # fmt: skip
def test_a_handler_that_takes_a_run_or_nothing_is_accepted(good_handler: Any) -> None:
    s = scheduler()
    s.add_job(good_handler, "* * * * *", name="x")
    assert s.jobs == ["x"]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("catch_up_ms", -1),
        ("jitter_ms", -5),
        ("max_late_ms", -1),
        ("max_attempts", 0),
        ("max_attempts", -2),
        ("every_ms", 0),
        ("every_ms", -1000),
        ("catch_up_ms", 1.5),
        ("overlap", "yes"),
    ],
)
def test_negative_or_zero_job_options_are_refused(option: str, value: Any) -> None:
    kwargs: dict[str, Any] = {option: value}
    schedule = None if option == "every_ms" else "* * * * *"
    with pytest.raises((InvalidOptionError, InvalidScheduleError), match=option):
        scheduler().add_job(handler, schedule, name="x", **kwargs)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lease_ms", 0),
        ("lease_ms", -1000),
        ("heartbeat_ms", 0),
        ("history_size", 0),
        ("history_ttl_ms", 0),
        ("stop_grace_ms", -1),
        ("retry_delay_ms", -1),
    ],
)
def test_negative_or_zero_scheduler_options_are_refused(option: str, value: int) -> None:
    with pytest.raises(InvalidOptionError, match=option):
        Scheduler(RedisBackend(), **{option: value})


def test_a_heartbeat_longer_than_half_the_lease_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match="at most half"):
        Scheduler(RedisBackend(), lease_ms=10_000, heartbeat_ms=6_000)


def test_heartbeat_ms_defaults_to_a_third_of_the_lease() -> None:
    assert Scheduler(RedisBackend(), lease_ms=10_000).heartbeat_ms == 3_333
    assert Scheduler(RedisBackend()).heartbeat_ms == 10_000


def test_a_schedule_and_an_interval_together_are_refused() -> None:
    with pytest.raises(InvalidScheduleError, match="not both"):
        scheduler().add_job(handler, "* * * * *", every_ms=1000, name="x")


def test_a_job_without_a_schedule_is_refused() -> None:
    with pytest.raises(InvalidScheduleError, match="needs a schedule"):
        scheduler().add_job(handler, name="x")


@pytest.mark.parametrize(
    "strategy",
    [
        "round-robin",
        {"name": "lease", "window_ms": 1},
        {"window_ms": 1},
        42,
    ],
)
def test_an_unknown_or_misplaced_strategy_setting_is_refused(strategy: Any) -> None:
    with pytest.raises(InvalidOptionError, match="strateg"):
        RedisBackend(strategy=strategy)


@pytest.mark.parametrize("prefix", ["{cron}:", "a b:", 3])
def test_a_prefix_that_would_break_keys_is_refused(prefix: Any) -> None:
    with pytest.raises(InvalidOptionError, match="prefix"):
        ValkeyBackend(prefix=prefix)


def test_an_unknown_connection_option_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match="hostname"):
        RedisBackend(redis={"hostname": "cache"})


def test_a_url_with_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match="redis://"):
        RedisBackend(redis="http://localhost:6379")


def test_an_object_that_is_not_a_client_is_refused_at_start() -> None:
    import anyio

    s = Scheduler(RedisBackend(redis=object()))

    async def main() -> None:
        async with s:
            pass

    with pytest.raises(UnsupportedClientError, match="send"):
        anyio.run(main)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_bad_timer_or_kind_names_its_error_code_once() -> None:
    """A timer's error wraps the check's message with the key: the code is said once."""
    with pytest.raises(InvalidScheduleError) as bad_cron:
        await scheduler().set_timer("remind", "user:42", cron="every tuesday")
    assert str(bad_cron.value).count("ANARCHON_") == 1, str(bad_cron.value)
    assert "timer 'user:42'" in str(bad_cron.value)
    with pytest.raises(InvalidJobError) as bad_kind:
        scheduler().add_timer(handler, "two words")
    assert str(bad_kind.value).count("ANARCHON_") == 1, str(bad_kind.value)
    assert "timer kind name 'two words'" in str(bad_kind.value)


def test_an_unknown_job_option_is_refused_with_the_options_there_are() -> None:
    with pytest.raises((InvalidOptionError, TypeError)) as unknown:
        scheduler().add_job(handler, "* * * * *", max_late=5)  # type: ignore[call-arg]
    assert "max_late" in str(unknown.value)


@pytest.mark.parametrize("name", ["job\n", "job\r", "jo\nb", "job\x00", "job\x85"])
def test_a_job_or_timer_kind_name_with_a_line_end_or_control_character_is_refused(
    name: str,
) -> None:
    with pytest.raises(InvalidJobError):
        scheduler().add_job(handler, "* * * * *", name=name)
    with pytest.raises(InvalidJobError):
        scheduler().add_timer(handler, name)


@pytest.mark.parametrize("prefix", ["cron:\n", "cron:\r\n", "cr\x1bon:", "cron\x00:", "cron:\x85"])
def test_a_prefix_with_a_line_end_or_control_character_is_refused(prefix: str) -> None:
    with pytest.raises(InvalidOptionError, match="prefix"):
        RedisBackend(prefix=prefix)


@pytest.mark.parametrize("instance_id", ["web-1\n", "web\x1b[2J", "a|b", ""])
def test_an_instance_id_with_a_control_character_or_a_bar_is_refused(instance_id: str) -> None:
    with pytest.raises(InvalidOptionError, match="instance_id"):
        Scheduler(RedisBackend(redis="redis://127.0.0.1:1"), instance_id=instance_id)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_timer_payload_over_the_cap_is_refused_before_anything_is_sent() -> None:
    """A timer's payload is capped (1 MiB as stored, by default): every timer script
    reads it, and a huge one stalls the server for the whole fleet."""
    big = "x" * (1 << 20)  # stored with a one-byte tag: just over 1 MiB
    with pytest.raises(InvalidOptionError, match="max_timer_payload_bytes") as refused:
        await scheduler().set_timer("remind", "user:42", delay_ms=1000, payload=big)
    assert "'user:42'" in str(refused.value)
    small = Scheduler(RedisBackend(redis="redis://127.0.0.1:1"), max_timer_payload_bytes=100)
    with pytest.raises(InvalidOptionError, match="max_timer_payload_bytes"):
        await small.set_timer("remind", "user:42", delay_ms=1000, payload=b"y" * 100)
    # Stored as "u" and the text: 100 bytes, at the cap, so it is sent (and this server
    # is unreachable).
    with pytest.raises(ConnectionFailedError):
        await small.set_timer("remind", "user:42", delay_ms=1000, payload=b"y" * 99)
    # Counted in bytes, not characters: 50 two-byte characters are over 100 bytes.
    with pytest.raises(InvalidOptionError, match="max_timer_payload_bytes") as refused:
        await small.set_timer("remind", "user:42", delay_ms=1000, payload="é" * 50)
    assert "its payload is 10" in str(refused.value)
    with pytest.raises(InvalidOptionError, match="max_payload_bytes"):
        Timers(RedisBackend(), max_payload_bytes=0)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lease_ms", 2**63),
        ("lease_ms", 24 * 3600 * 1000 + 1),
        ("history_size", 2**64),
        ("history_size", 1_000_001),
        ("history_ttl_ms", 10**30),
        ("retry_delay_ms", 2**53),
        ("stop_grace_ms", 10**20),
    ],
)
def test_scheduler_options_the_server_cannot_hold_are_refused(option: str, value: int) -> None:
    """``lease_ms=2**63`` stored a lease that never ended (the job never ran again, even
    after a restart with defaults); ``history_size=2**64`` and ``history_ttl_ms=10**30``
    disabled every job at run time with server errors."""
    with pytest.raises(InvalidOptionError, match=f"{option} must be"):
        Scheduler(RedisBackend(), **{option: value})


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_attempts", 10**12),
        ("catch_up_ms", 10**30),
        ("jitter_ms", 2**63),
        ("max_late_ms", 2**60),
        ("timeout_ms", 10**20),
        ("retry_delay_ms", 10**20),
    ],
)
def test_job_options_the_server_cannot_hold_are_refused(option: str, value: int) -> None:
    with pytest.raises(InvalidOptionError, match=f"{option} must be"):
        scheduler().add_job(handler, "* * * * *", name="x", **{option: value})


@pytest.mark.parametrize(
    ("option", "value"), [("max_attempts", 10**12), ("retry_delay_ms", 10**20)]
)
def test_timer_kind_options_the_server_cannot_hold_are_refused(option: str, value: int) -> None:
    with pytest.raises(InvalidOptionError, match=f"{option} must be"):
        scheduler().add_timer(handler, "remind", **{option: value})


def test_the_largest_options_the_server_holds_are_accepted() -> None:
    s = Scheduler(
        RedisBackend(), lease_ms=24 * 3600 * 1000, history_size=1_000_000, history_ttl_ms=10**12
    )
    s.add_job(handler, "* * * * *", name="x", max_attempts=1000, catch_up_ms=10**12)


@pytest.mark.parametrize("url", ["redis://user:se?cret@host:6379/0", "rediss://:se#cret@host/1"])
def test_a_url_whose_password_the_client_would_misread_is_refused_when_the_backend_is_made(
    url: str,
) -> None:
    """Not at the first connection, and with the password never shown."""
    with pytest.raises(InvalidOptionError, match="percent-encode") as info:
        RedisBackend(redis=url)
    assert "cret" not in str(info.value)
