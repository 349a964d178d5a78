"""The scheduler's engine, in named parts (nothing here is public API).

``Scheduler`` (in ``anarchon._scheduler``) is a facade over an ``instance.Instance``,
which owns the parts and their lifecycle:

- ``instance.Instance``: the start, the stop, the registry's renewals, the readers of
  the store beside the engine, the hints; the internal API that ``anarchon.prometheus``,
  ``anarchon.otel``, ``serve`` and the command line use (``Instance.of(scheduler)``);
- ``agenda.Agenda``: what is due when (a job slot's claim, ``_Due``, or a timer kind's,
  ``_TimerDue``), and the wake-up;
- ``claimer.Claimer``: claim batches, replies, retries of claims, manual claims;
- ``runner.Runner``: the work won here and its handlers, cancellation;
- ``lease_keeper.LeaseKeeper``: heartbeats, local expiry of leases;
- ``settle.Settler``: finishing attempts and firings, and the retries the store asks for;
- ``manual``: ``run_now``;
- ``hints``: the listener of the prefix's hint channel;
- ``_context``: what they share (settings, job table, store, task group, state, the work
  running here: a job's ``_Attempt`` or a timer's ``_Firing``, each with its own
  behaviour) and the clock.

Each part gets the parts it calls in its constructor, and no two call each other: the
agenda and the lease keeper call no other part, settle calls the agenda, the runner
calls the agenda, the lease keeper and settle, and the claimer the agenda and the runner.
"""
