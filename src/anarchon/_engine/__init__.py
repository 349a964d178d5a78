"""The scheduler's engine, in named parts (nothing here is public API).

``Scheduler`` (in ``anarchon._scheduler``) is a facade over an ``instance.Instance``,
which owns the parts and their lifecycle:

- ``instance.Instance``: the start, the stop, the registry's renewals, the readers of
  the store beside the engine, the hints; the members documented in its module are all
  that code outside the engine uses (``tests/test_architecture.py`` holds it so);
- ``agenda.Agenda``: what is due when (a job slot's claim, ``DueSlot``, or a timer kind's,
  ``DueTimers``), the wake-up, and when a failed claim is sent again;
- ``claimer.Claimer``: claim batches of slots, their replies, backups and take-overs;
- ``timer_claims.TimerClaimer``: claims of due timers, the firings won;
- ``manual.ManualRuns``: ``run_now``'s manual run, claimed, run and read back;
- ``runner.Runner``: the work won here and its handlers, cancellation;
- ``lease_keeper.LeaseKeeper``: heartbeats, local expiry of leases;
- ``settle.Settler``: finishing attempts and firings, and the retries the store asks for;
- ``hints.Hints``: the listener of the prefix's hint channel;
- ``work``: the work running here under a lease (a job's ``Attempt`` or a timer's
  ``Firing``, each with its own behaviour);
- ``context``: what every part shares (``EngineContext``: settings, job and timer
  tables, state, the work running here, events) and what exists only once started
  (``Running``: the store, the timers' store, the task group).

The parts that talk to the server are made at the start, each given the store and the
other parts it calls, and no two call each other: the agenda and the lease keeper call
no other part, settle calls the agenda, the runner calls the agenda, the lease keeper
and settle, the timers' claimer the agenda, the runner and settle, the claimer those and
the timers' claimer, and the manual runs the claimer, the runner and settle. The engine
asks nothing about which strategy it runs: the store the backend opened
(``_store/strategy.py``) answers for it.
"""
