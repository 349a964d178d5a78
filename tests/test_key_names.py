"""No two different (prefix, job) or (prefix, timer kind) pairs that anarchon accepts share a
key or a hint channel: a prefix nested in another (``billing:`` and ``billing:eu:``) can
never take another prefix's job for its own. No server: the keys are computed by the
functions every store uses (``_store/keys.py``), from names the public API accepts."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anarchon import InvalidJobError, InvalidOptionError, RedisBackend, Scheduler
from anarchon._model.job import validate_job_name
from anarchon._model.timer import validate_kind
from anarchon._store.keys import (
    ClaimOnlyKeys,
    JobKeys,
    RegistryKeys,
    TimerKeys,
    format_key,
    hint_channel,
    kind_keys,
)

#: Bucket counts that make each kind of bucket tag: one bucket, placed tags, plain tags.
_BUCKETS = (1, 2, 3, 70)


def _prefix_keys(prefix: str) -> set[str]:
    registry = RegistryKeys.for_prefix(prefix)
    return {
        format_key(prefix),
        registry.instances,
        registry.jobs,
        registry.first_seen,
        registry.timer_kinds,
        registry.backfills,
        registry.instance("i1"),
        "channel " + hint_channel(prefix),
    }


def _job_keys(prefix: str, job: str) -> set[str]:
    lease = JobKeys.for_job(prefix, job)
    claim_only = ClaimOnlyKeys.for_job(prefix, job)
    return {
        lease.state,
        lease.active,
        lease.slots,
        lease.runs,
        lease.results,
        lease.permits,
        lease.backfill,
        claim_only.runs,
        claim_only.manual,
        claim_only.results,
    }


def _kind_keys(prefix: str, kind: str) -> set[str]:
    keys = {TimerKeys.buckets_key(prefix, kind)}
    for buckets in _BUCKETS:
        for bucket in kind_keys(prefix, kind, buckets):
            keys |= {bucket.timers, bucket.due, bucket.meta, bucket.claimed("i1-0")}
            keys |= {bucket.permits, bucket.starts, bucket.groups, bucket.progress}
            keys |= {bucket.group_permits("tenant-1"), bucket.group_waiting("tenant-1")}
    return keys


def _accepted(check: Callable[[str], object], value: str) -> bool:
    try:
        check(value)
    except (InvalidJobError, InvalidOptionError):
        return False
    return True


def _owners(prefixes: list[str], names: list[str]) -> dict[str, set[tuple[str, str, str]]]:
    """Every key of every accepted pair, with the pairs that name it."""
    owners: dict[str, set[tuple[str, str, str]]] = {}
    for prefix in prefixes:
        if not _accepted(lambda p: RedisBackend(prefix=p), prefix):
            continue
        for key in _prefix_keys(prefix):
            owners.setdefault(key, set()).add((prefix, "store", ""))
        for name in names:
            if _accepted(validate_job_name, name):
                for key in _job_keys(prefix, name):
                    owners.setdefault(key, set()).add((prefix, "job", name))
            if _accepted(validate_kind, name):
                for key in _kind_keys(prefix, name):
                    owners.setdefault(key, set()).add((prefix, "timer kind", name))
    return owners


def _shared(owners: dict[str, set[tuple[str, str, str]]]) -> dict[str, set[tuple[str, str, str]]]:
    """Keys that two different pairs would both use (a job and a timer kind of one name and
    prefix are two owners too: they must not share a key either)."""
    return {key: pairs for key, pairs in owners.items() if len(pairs) > 1}


_PREFIXES = ["", "billing", "billing:", "billing:eu:", "billing:eu", "bil", "{billing}:", "b#0:"]
_NAMES = ["x", "eu:x", "eu", "ling:x", "lingx", ":x", "x:", "x#0", "x#0.1", "format", "instances"]
_NAMES += ["x:runs", "x:state", "timer-hints", "eu:x:runs", "#0", "a.b", "x}", "{x"]


def test_no_two_accepted_pairs_of_a_hand_made_list_share_a_key() -> None:
    shared = _shared(_owners(_PREFIXES, _NAMES))
    assert not shared, sorted(shared.items())[:5]


_TEXT = st.text(alphabet="ab:#.0-", max_size=6)


@settings(max_examples=300, deadline=None)
@given(prefixes=st.lists(_TEXT, min_size=2, max_size=4), names=st.lists(_TEXT, max_size=5))
def test_no_two_accepted_pairs_share_a_key(prefixes: list[str], names: list[str]) -> None:
    shared = _shared(_owners(prefixes, names))
    assert not shared, sorted(shared.items())[:5]


def test_a_nested_prefix_and_a_job_name_that_would_meet_it_cannot_both_be_used() -> None:
    """The pair of the review: prefix ``billing:`` with job ``eu:x`` named the keys of
    prefix ``billing:eu:`` with job ``x``, and one of the two runs was lost."""
    accepted = []
    for prefix, job in (("billing:", "eu:x"), ("billing:eu:", "x")):
        try:
            Scheduler(RedisBackend(prefix=prefix)).add_job(lambda: None, "* * * * *", name=job)
        except (InvalidJobError, InvalidOptionError) as exc:
            assert "':'" in exc.message, exc.message  # says which character, and what to do
        else:
            accepted.append((prefix, job))
    assert len(accepted) < 2
    assert not _shared(_owners(["billing:", "billing:eu:"], ["eu:x", "x"]))


@pytest.mark.parametrize("prefix", ["billing:", "billing:eu:", "a.b-c:", "cron:"])
def test_a_prefix_of_segments_each_ending_in_a_colon_is_accepted(prefix: str) -> None:
    assert RedisBackend(prefix=prefix).prefix == prefix


@pytest.mark.parametrize("prefix", ["", "cron", "billing:eu", "a::b"])
def test_a_prefix_that_does_not_end_in_one_colon_is_refused_with_what_to_do(prefix: str) -> None:
    with pytest.raises(InvalidOptionError, match="ends with ':'"):
        RedisBackend(prefix=prefix)


@pytest.mark.parametrize("name", ["eu:x", ":x", "x:"])
def test_a_job_or_timer_kind_name_with_a_colon_is_refused_with_what_to_do(name: str) -> None:
    scheduler = Scheduler(RedisBackend(prefix="billing:"))
    with pytest.raises(InvalidJobError, match=r"':'.*prefix"):
        scheduler.add_job(lambda: None, "* * * * *", name=name)
    with pytest.raises(InvalidJobError, match=r"timer kind.*':'"):
        scheduler.add_timer(lambda timer: None, name)


def test_every_pair_is_tried() -> None:
    """The hand-made list reaches every kind of key: jobs, kinds and stores of every prefix
    that is accepted (a list that accepted nothing would pass the test above)."""
    owners = _owners(_PREFIXES, _NAMES)
    kinds = {kind for pairs in owners.values() for _, kind, _ in pairs}
    prefixes = {prefix for pairs in owners.values() for prefix, _, _ in pairs}
    assert kinds == {"store", "job", "timer kind"}
    assert {"billing:", "billing:eu:"} <= prefixes
    assert len(list(itertools.chain.from_iterable(owners.values()))) > 200
