"""The chaos suite's timer checker (chaos/timer_checker.py) tells a firing repeated for
a reason from one repeated for none: it must be able to fail."""

from __future__ import annotations

from chaos.checker import Window
from chaos.timer_checker import TimerStart, check_timers


def start(instance: str, attempt: int, fence: int, wall_ms: int, key: str = "t1") -> TimerStart:
    line = f"tstart|{key}|5|{instance}|{attempt}|{fence}|{wall_ms}|due|1000"
    return TimerStart(key, 5, instance, attempt, fence, wall_ms, "due", 1000, line)


def test_a_timer_fired_once_is_clean_and_one_never_fired_is_a_miss() -> None:
    report = check_timers([start("a", 1, 10, 1001)], {}, {"t1": 5, "t2": 5}, [])
    assert (report.fired, report.duplicates, report.unexplained) == (1, 0, [])
    assert report.misses == ["timer t2 generation 5 never fired"]


def test_a_second_start_after_the_first_runner_was_killed_is_explained() -> None:
    starts = [start("a", 1, 10, 1001), start("b", 2, 11, 4000)]
    report = check_timers(starts, {}, {"t1": 5}, [Window("sigkill", 1500, instance="a")])
    assert report.unexplained == [] and report.explained == {"sigkill": 1}


def test_a_second_start_without_a_fault_of_the_first_runner_is_unexplained() -> None:
    starts = [start("a", 1, 10, 1001), start("b", 2, 11, 4000)]
    report = check_timers(starts, {}, {"t1": 5}, [Window("sigkill", 1500, instance="b")])
    assert len(report.unexplained) == 1 and "no fault of its runner" in report.unexplained[0]


def test_a_second_start_with_a_fence_not_higher_is_unexplained_even_after_a_fault() -> None:
    starts = [start("a", 1, 10, 1001), start("b", 2, 10, 4000)]
    report = check_timers(starts, {}, {"t1": 5}, [Window("sigkill", 1500, instance="a")])
    assert len(report.unexplained) == 1 and "not higher" in report.unexplained[0]


def test_a_firing_given_back_on_stop_may_start_again_with_the_same_attempt() -> None:
    starts = [start("a", 1, 10, 1001), start("b", 1, 11, 1500)]
    ends = {("t1", 5, "a", 10): "cancelled"}
    report = check_timers(starts, ends, {"t1": 5}, [])
    assert report.unexplained == [] and report.explained == {"ended cancelled": 1}


def test_a_generation_that_was_never_set_is_unexplained() -> None:
    starts = [start("a", 1, 10, 1001), start("a", 1, 12, 1001, key="t9")]
    report = check_timers(starts, {}, {"t1": 5}, [])
    assert len(report.unexplained) == 1 and "never set" in report.unexplained[0]
