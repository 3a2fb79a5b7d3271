"""The scheduler in a process of its own, for `serve` (`[server] engine_process`, `--engine-process`).

`serve`'s event loop does HTTP, SSE and tokenizing for every token it streams. In one process
that work shares the GIL with the worker thread, which builds each step's graph in Python: the
busier the server, the later each step starts. vLLM v1 splits its API server from its EngineCore
for the same reason. Here the HTTP process keeps the app unchanged and talks to a `Scheduler` in a
child process (`remote.child`) over a local socket, in msgpack frames (`remote.wire`): one frame
per engine step carries every stream's chunks. `remote.client.EngineProcess` is the HTTP side's
stand-in for `Scheduler`."""
