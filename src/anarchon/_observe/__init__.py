"""What an instance tells the outside: typed events, tracing spans, JSON logs."""
