"""An OpenAI-compatible HTTP server over `Scheduler` (the optional `[server]` extra).

`scheduler.serving.http.app.create_app` builds the Starlette app; `mlx-scheduler serve` runs it. Nothing here
is imported by the rest of the package, so the core needs neither Starlette nor uvicorn."""
