"""The ``anarchon`` command line, the topmost layer: ``main`` (the parser, ``run``,
``health``, ``demo``), ``store`` (inspect, history, pause, ...), ``web`` (the dashboard).
"""
