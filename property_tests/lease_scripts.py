"""The shipped lease and timer scripts with the server's clock swapped for an argument.

The server's TIME cannot be set, so the state machine loads the scripts with
the one clock read replaced: ``server_now_ms()`` returns the last argument
instead of reading TIME. Everything else is byte-identical (a test checks it).
"""

from __future__ import annotations

from anarchon._store.scripts import Script, lease_script, timer_script

CLOCK_READ = """local function server_now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end"""

CLOCK_ARGUMENT = """local function server_now_ms()
  return tonumber(ARGV[#ARGV])
end"""


def _timed(script: Script) -> str:
    assert script.body.count(CLOCK_READ) == 1, "the clock read moved: update property_tests"
    return script.body.replace(CLOCK_READ, CLOCK_ARGUMENT)


def timed_script(name: str) -> str:
    """The shipped lease script ``name`` whose clock is its last argument."""
    return _timed(lease_script(name))


def timed_timer_script(name: str) -> str:
    """The shipped timer script ``name`` whose clock is its last argument."""
    return _timed(timer_script(name))
