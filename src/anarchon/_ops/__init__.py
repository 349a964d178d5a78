"""Operating a fleet: the inspector (the store read and changed without a scheduler),
``serve`` (a scheduler run as a service), the demo and the embedded server it runs on.
The command line that drives them is ``anarchon._cli``, the topmost layer."""
