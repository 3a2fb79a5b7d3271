"""Deprecated alias: the HTTP server moved to `scheduler.serving.http`. `scheduler.http.app`
still imports (with a DeprecationWarning) for code written against the old path."""
