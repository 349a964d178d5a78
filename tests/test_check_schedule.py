"""``anarchon check-schedule``: what a cron expression means, its next fire times, and
the warnings users need (daylight-saving changes and what anarchon does there, 6-field
lookalikes), and the refusal of an expression that never fires. No server needed."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from anarchon import InvalidScheduleError, RedisBackend, Scheduler
from anarchon._cli.main import main


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["check-schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def checked_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, err = check(capsys, *argv, "--json")
    assert code == 0, err
    listed: dict[str, object] = json.loads(out)
    return listed


def test_a_fixed_time_the_spring_change_skips_is_warned_of_and_fires_when_the_clocks_jump(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("30 2 * * *", "--timezone", "America/New_York", "--from", "2027-03-13T00:00-05:00")
    listed = checked_json(capsys, *argv, "-n", "3")
    assert listed["fires"] == [
        "2027-03-13T07:30:00Z",
        "2027-03-14T07:00:00Z",
        "2027-03-15T06:30:00Z",
    ]
    assert listed["meaning"] == "At 02:30 every day"
    (warning,) = listed["warnings"]  # type: ignore[misc]
    assert warning.startswith("2027-03-14: the clocks jump from 02:00 to 03:00"), warning
    assert "02:30 never happens that day" in warning and "once, at 03:00 EDT" in warning
    code, out, _ = check(capsys, *argv)
    assert code == 0 and "Warnings:" in out and "02:30 never happens" in out, out
    assert "2027-03-14 03:00:00 America/New_York" in out, out


def test_a_job_by_elapsed_time_is_warned_that_it_fires_twice_in_the_repeated_hour(
    capsys: pytest.CaptureFixture[str],
) -> None:
    listed = checked_json(
        capsys, "*/30 1 * * *", "--timezone", "America/New_York",
        "--from", "2027-11-07T00:00-04:00", "-n", "5",
    )  # fmt: skip
    # 01:00 and 01:30 EDT, then again in EST, then the next night's 01:00 EST.
    assert listed["fires"] == [
        "2027-11-07T05:00:00Z", "2027-11-07T05:30:00Z",
        "2027-11-07T06:00:00Z", "2027-11-07T06:30:00Z", "2027-11-08T06:00:00Z",
    ]  # fmt: skip
    # One warning: the spring change skips 02:00-02:59, which this job never names.
    (autumn,) = listed["warnings"]  # type: ignore[misc]
    assert autumn.startswith("2027-11-07: the clocks go back from 02:00 to 01:00"), autumn
    assert "01:00-02:00 happens twice" in autumn and "01:00, 01:30 fire twice" in autumn


def test_a_fixed_time_in_the_repeated_hour_is_warned_that_it_fires_the_first_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    listed = checked_json(
        capsys, "0 30 1 * * *", "--timezone", "America/New_York",
        "--from", "2027-11-07T00:00-04:00", "-n", "2",
    )  # fmt: skip
    assert listed["fires"] == ["2027-11-07T05:30:00Z", "2027-11-08T06:30:00Z"]
    (warning,) = listed["warnings"]  # type: ignore[misc]
    assert "01:30 fires once, the first time (EDT)" in warning, warning


def test_a_six_field_expression_that_reads_as_a_five_field_one_is_warned_of(
    capsys: pytest.CaptureFixture[str],
) -> None:
    listed = checked_json(capsys, "0 9 * * * *", "--from", "2027-01-01T00:00Z", "-n", "2")
    assert listed["fires"] == ["2027-01-01T00:09:00Z", "2027-01-01T01:09:00Z"]
    (warning,) = listed["warnings"]  # type: ignore[misc]
    assert "reads the first as seconds" in warning and "at minute 9 of every hour" in warning
    assert "write '0 9 * * *' (5 fields)" in warning, warning
    # Six fields that read as no 5-field expression, and a plain one in UTC: no warning.
    for expression in ("0 30 9 * * *", "0 9 * * 1-5"):
        assert checked_json(capsys, expression)["warnings"] == [], expression


def test_an_expression_that_never_fires_is_refused_here_and_at_definition(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = check(capsys, "0 0 30 2 *")
    assert code == 1 and out == "", out
    assert "it never fires" in err and "February has 28 or 29 days" in err, err
    scheduler: Scheduler[object] = Scheduler(RedisBackend(redis="redis://localhost:1"))
    with pytest.raises(InvalidScheduleError, match="it never fires"):
        scheduler.job("0 0 31 4,6 *", name="never")(lambda: None)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["0 9 * * *", "--from", "tomorrow"], "--from must be ISO 8601"),
        (["0 9 * * *", "--from", "2027-01-01T00:00"], "--from needs an offset"),
        (["0 9 * * *", "-n", "0"], "-n must be from 1 to 1000"),
    ],
)
def test_a_check_asked_wrongly_is_a_usage_error_that_says_what_to_give(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    code, _, err = check(capsys, *argv)
    assert code == 2 and said in err, err


def test_the_fire_times_listed_are_the_schedules_own(capsys: pytest.CaptureFixture[str]) -> None:
    """What the check lists is what a job with this schedule would claim."""
    from anarchon import CronSchedule

    moment = datetime.fromisoformat("2027-10-31T00:00+02:00")
    schedule = CronSchedule("*/20 2 * * *", "Europe/Berlin")
    expected, at = [], moment
    for _ in range(7):
        fire = schedule.next_after(at)
        assert fire is not None
        expected.append(fire.isoformat().replace("+00:00", "Z"))
        at = fire
    listed = checked_json(
        capsys, "*/20 2 * * *", "--timezone", "Europe/Berlin", "--from", moment.isoformat(),
        "-n", "7",
    )  # fmt: skip
    assert listed["fires"] == expected
