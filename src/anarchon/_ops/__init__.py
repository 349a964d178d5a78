"""Operating a fleet: the inspector (the store read and changed without a
scheduler), ``serve`` (a scheduler run as a service), the demo, an embedded
server for it, and the command line."""
