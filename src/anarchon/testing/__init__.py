"""Testing scheduled code on virtual time: ``TestFleet`` runs your own scheduler with
the real engine and the real scripts on a real server, while days pass in seconds; and
``make_run`` / ``make_timer_run`` hand a handler the ``Run`` it would get, for a unit test
of the handler alone. See the docs' "Testing your scheduled code" page."""

from ._fleet import TestFleet
from ._runs import make_run, make_timer_run

__all__ = ["TestFleet", "make_run", "make_timer_run"]
