"""All that knows Redis and Valkey: the keys, the records and their formats, the
Lua scripts (``lua/``, package data), one store per strategy, the timers' store,
the registry of instances, and the backend that opens them."""
