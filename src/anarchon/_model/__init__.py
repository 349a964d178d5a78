"""The model: schedules, jobs, timer kinds, the values handlers and readers
see. No I/O: nothing here talks to a server."""
