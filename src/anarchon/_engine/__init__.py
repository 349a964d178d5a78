"""The scheduler's engine, in named parts (nothing here is public API).

``Scheduler`` (in ``anarchon._scheduler``) is a facade over them:

- ``agenda.Agenda``: what is due when, and the wake-up;
- ``claimer.Claimer``: claim batches, replies, retries of claims, manual claims;
- ``runner.Runner``: attempts and their handlers, cancellation;
- ``lease_keeper.LeaseKeeper``: heartbeats, local expiry of leases;
- ``settle.Settler``: finishing attempts, and the retries the store asks for;
- ``_context``: what they share (settings, job table, store, task group, state, the
  attempts running here) and the clock.

Each part gets the parts it calls in its constructor, and no two call each other: the
agenda and the lease keeper call no other part, settle calls the agenda, the runner
calls the agenda, the lease keeper and settle, and the claimer the agenda and the runner.
"""
