"""Where benchmark requests go: our `Scheduler` in this process, or any OpenAI-compatible server
(`POST /v1/completions` with `stream: true`), such as `mlx_lm.server` or `mlx-scheduler serve`.

Each target fills a `Record` as chunks arrive; times are `perf_counter` seconds, measured from
just before the request is handed over (for HTTP: before the first connect attempt, so connect
retries count in TTFT)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec

from scheduler.errors import SchedulerError
from scheduler.params import SamplingParams

if TYPE_CHECKING:
    import httpx

    from scheduler.api import Scheduler
    from scheduler.cli.bench.datasets import RequestSpec

OK_REASONS = frozenset({"stop", "length"})


class BadEvent(Exception):
    """A streamed event that is not the JSON of a completion chunk."""


class Sampling(msgspec.Struct, frozen=True):
    temperature: float = 0.0
    ignore_eos: bool = False


class Record(msgspec.Struct):
    """One request's measurements. `itl` holds the gaps between successive output chunks."""

    prompt_tokens: int
    max_tokens: int
    sent_at: float = -1.0
    """Seconds from the start of the run; -1 while not sent."""
    done: bool = False
    ok: bool = False
    error: str = ""
    finish_reason: str = ""
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = msgspec.field(default_factory=list)
    e2e: float = 0.0
    retries: int = 0

    def arrived(self, tokens: int, t0: float, last: float) -> float:
        """`tokens` output tokens arrived now: the first sets `ttft` (from `t0`), later ones add
        the gap since `last` to `itl`. Returns now, the caller's new `last`."""
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - t0
        else:
            self.itl.append(now - last)
        self.output_tokens += tokens
        return now


class Target(Protocol):
    """Sends one request and records what came back; never raises for a failed request."""

    @property
    def label(self) -> str: ...

    async def send(self, spec: RequestSpec, sampling: Sampling, rec: Record) -> None: ...


class SchedulerTarget:
    """Our scheduler, in this process and on this event loop."""

    def __init__(self, sched: Scheduler, timeout: float | None = None) -> None:
        self._sched = sched
        self._timeout = timeout

    @property
    def label(self) -> str:
        return f"in-process {self._sched.config.model.path}"

    async def send(self, spec: RequestSpec, sampling: Sampling, rec: Record) -> None:
        params = SamplingParams(
            max_tokens=spec.max_tokens, temperature=sampling.temperature, ignore_eos=sampling.ignore_eos
        )
        t0 = last = time.perf_counter()
        try:
            async for chunk in self._sched.generate(spec.prompt, params, timeout=self._timeout):
                if chunk.token_ids:
                    last = rec.arrived(len(chunk.token_ids), t0, last)
                if chunk.finish_reason is not None:
                    rec.finish_reason = chunk.finish_reason
                    rec.prompt_tokens = chunk.prompt_tokens
                    rec.output_tokens = chunk.completion_tokens
                    rec.ok = chunk.finish_reason in OK_REASONS
                    rec.error = chunk.error or ("" if rec.ok else chunk.finish_reason)
        except SchedulerError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            rec.e2e = time.perf_counter() - t0
            rec.done = True


def http_client(max_duration_s: float) -> httpx.AsyncClient:
    """The client a bench run sends over: no cap on connections (thousands of streams at once
    need as many descriptors: the soft limit is raised to the hard one)."""
    import httpx

    _raise_open_files_limit()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(max_duration_s, connect=10.0)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def _raise_open_files_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass  # not on this platform, or not allowed: the run reports what fails


class OpenAITarget:
    """A streaming `/v1/completions` endpoint. Connections refused or dropped before any byte of
    the response are retried for up to `connect_retry_s` (mlx_lm.server's listener keeps only 5
    pending connections)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        *,
        model: str | None = None,
        connect_retry_s: float = 30.0,
    ) -> None:
        self._client = client
        base = url.rstrip("/")
        self.url = base if base.endswith("/completions") else base + "/v1/completions"
        self._model = model
        self._retry_s = connect_retry_s

    @property
    def label(self) -> str:
        return self.url

    def body(self, spec: RequestSpec, sampling: Sampling) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": sampling.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension; servers without it run to EOS
        if self._model is not None:
            body["model"] = self._model
        return body

    async def send(self, spec: RequestSpec, sampling: Sampling, rec: Record) -> None:
        import httpx

        body = self.body(spec, sampling)
        t0 = time.perf_counter()
        delay = 0.02
        try:
            while True:
                try:
                    await self._stream(body, rec, t0)
                    return
                except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                        httpx.ReadError) as exc:
                    # Retry only a request that never got an answer: nothing was generated for it.
                    if rec.ttft is not None or time.perf_counter() - t0 > self._retry_s:
                        rec.error = f"{type(exc).__name__}: {exc}"
                        return
                    rec.retries += 1
                    await anyio.sleep(delay)
                    delay = min(0.5, delay * 2)
        except httpx.HTTPError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        except BadEvent as exc:  # the server's fault: this request failed, the run goes on
            rec.error = str(exc)
        finally:
            rec.e2e = time.perf_counter() - t0
            rec.done = True

    async def _stream(self, body: dict[str, Any], rec: Record, t0: float) -> None:
        last = t0
        usage: dict[str, Any] | None = None
        async with self._client.stream("POST", self.url, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread())[:200].decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {detail}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and ": keepalive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                    usage = event.get("usage") or usage
                    choices = event.get("choices") or ()
                    for choice in choices:
                        if choice.get("text"):
                            last = rec.arrived(1, t0, last)  # a token count estimate until the usage
                        if choice.get("finish_reason"):
                            rec.finish_reason = str(choice["finish_reason"])
                except (ValueError, AttributeError, TypeError) as exc:
                    raise BadEvent(f"a malformed event {data[:80]!r}: {type(exc).__name__}: {exc}") from None
        if usage is not None:
            try:
                rec.output_tokens = int(usage.get("completion_tokens", rec.output_tokens))
                rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
            except (ValueError, AttributeError, TypeError) as exc:
                shown = str(usage)[:80]
                raise BadEvent(f"a malformed usage {shown!r}: {type(exc).__name__}: {exc}") from None
        rec.ok = rec.finish_reason in OK_REASONS
        if not rec.ok:
            rec.error = f"finish_reason {rec.finish_reason or 'missing'}"
