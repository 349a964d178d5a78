"""The ``anarchon`` command line: ``main`` (the parser, ``run``, ``health``,
``demo``), ``store`` (inspect, history, pause, ...), ``web`` (the dashboard)."""
