"""`serve --replicas 2` for real: two `Scheduler` replicas of synthetic:tiny on a local Ray
(127.0.0.1, no dashboard), our router, one OpenAI-compatible port. One cluster for the module:
Ray takes ~30 s to start on 2 cores. The killed-replica test runs late; the last three redeploy
the application with two frontends and each scheduler in a process of its own, kill one of those,
then drain it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed; make test installs it")

import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from scheduler.cli.bench.mlxlm import free_port  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.serving.cluster.app import APP_NAME, deploy, drain, start_ray  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.integration

TOML = """
[model]
path = "synthetic:tiny"
cache_dir = "{cache}"
[kvpool]
memory = "64MiB"
block_tokens = 16
[worker]
max_batch = 8
[scheduler]
max_queue = 8
[cluster]
num_cpus = 0.5
stats_period_s = 0.2
frontends = {frontends}
stream_feed = {feed}
scheduler_process = {child}
pin_cpus = true
[server]
# Only the token endpoints are guarded, so the other tests need no key.
api_keys = ["cluster-key"]
open_paths = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]
cors_origins = ["https://app.example"]
"""


def _config(model_cache: Path, frontends: int = 1, feed: bool = True, child: bool = False) -> SchedulerConfig:
    return SchedulerConfig.from_toml(TOML.format(cache=model_cache, frontends=frontends, feed=str(feed).lower(),
                                                 child=str(child).lower()))


URLS: dict[str, str] = {}
"""The deployment's two doors: the frontends' own port ("direct", `ingress = "direct"`, the
default) and Serve's proxy ("proxy"). Both serve at once here, since this module's Serve runs
its proxy; the tests go through the default one unless they name the other."""


@pytest.fixture(scope="module")
def cluster(model_cache: Path) -> Iterator[str]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    config = _config(model_cache)
    from workers.loading.models import resolve_model

    resolve_model(config.model.path, config.model.cache_dir)
    port, own = free_port(), free_port()
    start_ray(config, 2, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy(config, 2, listen=("127.0.0.1", own))
        URLS.update(proxy=f"http://127.0.0.1:{port}", direct=f"http://127.0.0.1:{own}")
        yield URLS[config.cluster.ingress]
    finally:
        serve.shutdown()
        ray.shutdown()


def health(url: str) -> dict[str, Any]:
    reply = httpx.get(f"{url}/health", timeout=30)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def complete(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"max_tokens": 4, "temperature": 0, **body}, timeout=60)


def test_streaming_through_the_official_client(cluster: str) -> None:
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="synthetic:tiny", prompt="Once upon a time", max_tokens=8,
                                       temperature=0, stream=True)
    parts = list(stream)
    assert len(parts) >= 2 and parts[-1].choices[0].finish_reason == "length"
    streamed = "".join(p.choices[0].text for p in parts)
    whole = client.completions.create(model="synthetic:tiny", prompt="Once upon a time", max_tokens=8,
                                      temperature=0)
    assert whole.choices[0].text == streamed and whole.usage is not None
    assert whole.usage.completion_tokens == 8
    # Greedy and past EOS: a random-weight model samples EOS now and then, which ends with "stop".
    chat = client.chat.completions.create(model="synthetic:tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, stream=True, temperature=0,
                                          extra_body={"ignore_eos": True})
    deltas = list(chat)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert deltas[-1].choices[0].finish_reason == "length"
    raw = client.completions.with_raw_response.create(model="m", prompt="x y z", max_tokens=2)
    assert raw.headers["x-replica"] in {r["replica"] for r in health(cluster)["replicas"]}


def test_the_frontends_own_port_serves_as_the_proxy_does(cluster: str) -> None:
    """`ingress = "direct"`: each frontend serves HTTP on the port itself. The same answers as
    through Serve's proxy, token for token, and the same errors."""
    direct = URLS["direct"]
    assert health(direct)["ingress"] == "direct"
    assert {r["replica"] for r in health(direct)["replicas"]} == {r["replica"] for r in health(cluster)["replicas"]}
    client = openai.OpenAI(base_url=f"{direct}/v1", api_key="none", max_retries=0)
    ask = {"model": "synthetic:tiny", "prompt": "Down the road", "max_tokens": 12, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    raw = client.completions.with_raw_response.create(**ask, stream=True)
    parts = list(raw.parse())
    assert raw.headers["x-replica"] in {r["replica"] for r in health(direct)["replicas"]}
    assert parts[-1].choices[0].finish_reason == "length"
    proxied = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0).completions.create(**ask)
    assert "".join(p.choices[0].text for p in parts) == proxied.choices[0].text
    for url in (direct, cluster):
        bad = complete(url, prompt="hello", temperature=-1)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert httpx.get(f"{direct}/v1/nope", timeout=30).status_code == 401  # guarded, as every path not open


def test_bad_input_gets_the_single_process_errors(cluster: str) -> None:
    bad = complete(cluster, prompt="hello", temperature=-1)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    nope = httpx.get(f"{cluster}/v1/nope", timeout=30, headers={"x-api-key": "cluster-key"})
    assert nope.status_code == 404  # (without the key: 401, as for every path not open)
    models = httpx.get(f"{cluster}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "synthetic:tiny"


def test_keys_cors_and_the_token_endpoints_work_through_the_frontend(cluster: str) -> None:
    refused = httpx.post(f"{cluster}/tokenize", json={"prompt": "hello world"}, timeout=30)
    tokens = httpx.post(f"{cluster}/tokenize", json={"prompt": "hello world"}, timeout=30,
                        headers={"authorization": "Bearer cluster-key"})
    text = httpx.post(f"{cluster}/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=30,
                      headers={"x-api-key": "cluster-key"})
    preflight = httpx.options(f"{cluster}/v1/completions", timeout=30, headers={
        "origin": "https://app.example", "access-control-request-method": "POST"})
    marked = httpx.get(f"{cluster}/health", headers={"origin": "https://app.example"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert tokens.status_code == 200 and tokens.json()["count"] == len(tokens.json()["tokens"]) > 0
    assert "hello world" in text.json()["prompt"]
    assert preflight.status_code == 204
    assert marked.headers["access-control-allow-origin"] == "https://app.example"


def test_anthropic_responses_and_forced_tool_calls_through_the_frontend(cluster: str) -> None:
    import anthropic

    ask: Any = [{"role": "user", "content": "hi"}]
    claude = anthropic.Anthropic(base_url=cluster, api_key="cluster-key", max_retries=0, timeout=60)
    whole = claude.messages.create(model="m", max_tokens=6, messages=ask, extra_body={"temperature": 0})
    with claude.messages.stream(model="m", max_tokens=6, messages=ask, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="m", max_tokens=6, messages=ask, extra_body={"temperature": 5})
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="cluster-key", max_retries=0)
    response = client.responses.create(model="m", input="hi", max_output_tokens=6, temperature=0)
    events = list(client.responses.create(model="m", input="hi", max_output_tokens=6, temperature=0, stream=True))
    unit = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"]}
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": unit}}]
    called = client.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice="required",
                                            max_tokens=200, temperature=0)
    text = whole.content[0].text  # type: ignore[union-attr]
    assert text and text == streamed.content[0].text and whole.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert response.output_text and response.usage is not None and response.usage.output_tokens == 6
    assert events[-1].type == "response.completed" and events[-1].response.output_text == response.output_text
    [call] = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")  # type: ignore[union-attr]


def test_a_prompt_too_long_for_the_context_is_refused_by_its_length(cluster: str) -> None:
    """The frontend bounds tokenizing as `serve` does: refused untokenized, by length."""
    long = "word " * 10_000  # 50,000 characters; tiny's bound is 2048 tokens x 13 characters
    r = complete(cluster, prompt=long)
    chat = httpx.post(f"{cluster}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and chat.status_code == 400, (r.text, chat.text)
    assert "50000 characters, more than the model's context of 2048 tokens can hold" in r.json()["error"]["message"]
    assert chat.json()["error"]["param"] == "messages"
    fits = httpx.post(f"{cluster}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 2,
                            "temperature": 0, "ignore_eos": True})  # sampled, EOS could come first
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 2, fits.text


def test_full_queues_answer_429_and_nothing_else_is_lost(cluster: str) -> None:
    """Each replica holds 8 running and 8 queued: 48 long requests at once overflow both, and
    the overflow gets the single-process server's 429; every other request runs to its end."""
    body = {"prompt": "once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    async def main() -> tuple[list[httpx.Response], list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as c:
            posts = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(48)]
            # While they run: replicas with requests queued behind their 8 rows.
            busy: list[dict[str, Any]] = []
            while not busy and not all(p.done() for p in posts):
                replicas = (await c.get("/health")).json()["replicas"]
                if all(r["stats"]["waiting"] > 0 for r in replicas):
                    busy = replicas
                await asyncio.sleep(0.05)
            return list(await asyncio.gather(*posts)), busy

    replies, busy = asyncio.run(main())
    full = [r for r in replies if r.status_code == 429]
    done = [r for r in replies if r.status_code == 200]
    assert len(full) + len(done) == 48, [r.text for r in replies if r.status_code not in (200, 429)]
    assert full and len(done) >= 16, (len(full), len(done))
    error = full[0].json()["error"]
    assert (error["code"], error["type"], full[0].headers["retry-after"]) == ("queue_full", "rate_limit_error", "1")
    assert all(r.json()["usage"]["completion_tokens"] == 1500 for r in done)
    stats = [r["stats"] for r in health(cluster)["replicas"]]
    assert all(s["running"] == 0 and s["waiting"] == 0 for s in stats), stats
    # Queued requests hold a stream open but send nothing: they take no share of the replica's
    # budget of streamed messages, which the rows that are sending share.
    assert len(busy) == 2, busy
    for r in busy:
        assert r["streams"]["sending"] <= r["stats"]["running"] < r["streams"]["open"], r


def test_eight_sessions_stay_on_their_replica(cluster: str) -> None:
    def converse(n: int) -> list[str]:
        history, seen = f"Session {n} starts with a story about the number {n * 7}.", []
        for turn in range(4):
            reply = complete(cluster, prompt=history, session=f"conv-{n}")
            assert reply.status_code == 200, reply.text
            seen.append(reply.headers["x-replica"])
            history += reply.json()["choices"][0]["text"] + f" Then turn {turn} asks more."
        return seen

    with ThreadPoolExecutor(8) as pool:
        turns = list(pool.map(converse, range(8)))
    for seen in turns:
        assert len(set(seen)) == 1, turns  # every turn on the replica that holds the session
    routing = health(cluster)["routing"]
    assert routing.get("session", 0) >= 8 * 3  # turns 2-4 were routed by session


def test_a_shared_prefix_goes_where_its_blocks_are(cluster: str) -> None:
    prefix = "A long shared system prompt that many requests begin with. " * 8
    first = complete(cluster, prompt=prefix + "Question one?")
    where = {complete(cluster, prompt=prefix + f"Question {i}?").headers["x-replica"] for i in range(6)}
    assert where == {first.headers["x-replica"]}
    assert health(cluster)["routing"].get("prefix", 0) >= 6


def test_bursts_one_after_another_spread_over_both_replicas(cluster: str) -> None:
    """Power-of-two choices on the router's own count, choices not yet routed included: a
    replica's report made during one burst sent the next one elsewhere (7 or 8 of 8 to one
    replica), and choices counted only once routed let a burst land 2/6 or 1/7."""
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}

    async def burst(c: httpx.AsyncClient, n: int) -> list[str]:
        async def one(i: int) -> str:
            prompt = f"Burst {n}, request {i}: a prompt of its own, {i * 31 + n} words long."
            async with c.stream("POST", "/v1/completions", json={"prompt": prompt, **body}) as reply:
                lines = [line async for line in reply.aiter_lines() if line]
            assert reply.status_code == 200 and lines[-1] == "data: [DONE]", lines[-2:]
            return reply.headers["x-replica"]

        return list(await asyncio.gather(*(one(i) for i in range(8))))

    async def main() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=cluster, timeout=60) as c:
            return [await burst(c, n) for n in range(6)]

    for where in asyncio.run(main()):
        counts = sorted(Counter(where).values())
        assert len(counts) == 2 and counts[0] >= 3, where


async def _stream_all(url: str, bodies: list[dict[str, Any]]) -> list[list[str]]:
    async def one(c: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
        async with c.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            return [line async for line in reply.aiter_lines() if line]

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return list(await asyncio.gather(*(one(c, b) for b in bodies)))


def _fed(url: str) -> tuple[int, int]:
    streams = [r["streams"] for r in health(url)["replicas"]]
    return sum(s["feed_items"] for s in streams), sum(s["feed_requests"] for s in streams)


def test_a_replica_feeds_its_frontend_every_requests_chunks_in_one_item_a_step(cluster: str) -> None:
    """Each replica streams its frontend one item per step carrying the new chunks of all its
    requests, where a stream per request sent each request's own: 16 requests at once, 48 tokens
    each, take far fewer items than chunks, and every stream is whole."""
    items0, carried0 = _fed(cluster)
    bodies = [{"prompt": f"request {i} of sixteen", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}} for i in range(16)]
    streams = asyncio.run(_stream_all(cluster, bodies))
    items, carried = _fed(cluster)
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        usage = msgspec.json.decode(lines[-2][5:])["usage"]
        assert usage["completion_tokens"] == 48, lines[-3:]
    body = health(cluster)
    assert body["feeds"]["open"] == 0 and body["feeds"]["sending"] == 0
    assert sorted(body["feeds"]["feeds"]) == sorted(r["replica"] for r in body["replicas"])
    assert all(r["streams"]["feeds"] == 1 for r in body["replicas"])  # one frontend, one feed each
    # 16 requests' 48 tokens came in items that each carried several requests' chunks.
    assert carried - carried0 >= 16
    assert (carried - carried0) / (items - items0) > 2, (items - items0, carried - carried0)


@pytest.mark.parametrize("door", ["proxy", "direct"])
def test_a_client_that_leaves_mid_stream_frees_its_row_at_once(cluster: str, door: str) -> None:
    before = sum(r["stats"]["generated_tokens"] for r in health(cluster)["replicas"])
    body = {"prompt": "a long answer nobody reads", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{URLS[door]}/v1/completions", json=body, timeout=60) as reply:
        victim = reply.headers["x-replica"]
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        body = health(cluster)
        left = [r for r in body["replicas"] if r["stats"]["running"] or r["streams"]["open"]]
        if not left and body["feeds"]["open"] == 0:
            break
        time.sleep(0.1)
    assert not left and body["feeds"]["open"] == 0, (victim, left, body["feeds"])
    generated = sum(r["stats"]["generated_tokens"] for r in body["replicas"]) - before
    assert 0 < generated < 1500  # cancelled, not run to its end


def test_health_and_metrics_cover_every_replica(cluster: str) -> None:
    # The router's own count of requests in flight comes back to 0 (bar this health call's
    # fan-out); Serve reports completions to the router asynchronously, so on a loaded machine
    # the last test's requests may take a moment to leave it.
    deadline = time.monotonic() + 20
    while True:
        body = health(cluster)
        replicas = body["replicas"]
        if sum(body["in_flight"].values()) <= len(replicas) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(body["in_flight"].values()) <= len(replicas) and set(body["in_flight"]) <= {r["replica"] for r in replicas}
    assert len(replicas) == 2 and all(r["stats"]["blocks_total"] > 0 for r in replicas)
    assert all(r["scheduler_pid"] == r["pid"] for r in replicas)  # by default, in the actor's process
    # `pin_cpus` asked, but a replica on the CPU has no GPU to place its cores by: it says so.
    assert all(r["cpus"] is None and "holds no GPU" in r["cpus_note"] for r in replicas), replicas
    assert body["unreachable"] == []
    assert sum(r["stats"]["finished"] for r in replicas) > 0
    text = httpx.get(f"{cluster}/metrics", timeout=30).text
    for r in replicas:
        assert f'replica="{r["replica"]}"' in text
    helps = [line for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps)) > 0  # one HELP per family, samples of both replicas under it


def test_our_deployments_log_no_line_per_serve_call(cluster: str) -> None:
    """Serve's access log would write a line for every request, feed and router probe a replica
    takes (`CALL generate OK`), tens a second per frontend; our deployments turn it off."""
    from pathlib import Path

    assert complete(cluster, prompt="log me not", max_tokens=4).status_code == 200
    serve_logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    files = sorted(serve_logs.glob(f"replica_{APP_NAME}_*.log"))
    assert {"SchedulerReplica", "Frontend"} <= {f.name.split("_")[2] for f in files}, files
    calls = [line for f in files for line in f.read_text().splitlines() if " -- CALL " in line]
    assert calls == [], calls[:3]


def test_a_call_for_a_replica_that_is_gone_neither_spins_nor_blocks_the_router(cluster: str) -> None:
    # What a health fan-out meets when a replica dies between listing and asking: no rank
    # takes it. The router that runs in this process (the handle's side) must back off and
    # keep routing everything else, and drop the call once its caller gives up.
    from scheduler.serving.cluster import REPLICAS
    from scheduler.serving.cluster.routing import newest_router

    handle = serve.get_deployment_handle(REPLICAS, APP_NAME)
    live = [r["replica"] for r in health(cluster)["replicas"]]
    assert handle.replica_stats.remote(target=live[0]).result(timeout_s=30)["replica"] == live[0]
    router = newest_router(REPLICAS)
    gone = handle.replica_stats.remote(target="no-such-replica")
    with pytest.raises(TimeoutError):
        gone.result(timeout_s=1.5)
    assert router.reasons["target"] < 100, router.reasons  # backed off, not asked again and again
    started = time.monotonic()
    for rid in live:
        assert handle.replica_stats.remote(target=rid).result(timeout_s=10)["replica"] == rid
    assert time.monotonic() - started < 5
    gone.cancel()
    asked = router.reasons["target"]
    time.sleep(2)
    assert router.reasons["target"] - asked <= 2  # dropped: at most the pass that saw it cancelled


def test_a_stuck_replica_is_named_by_health_not_waited_for(cluster: str) -> None:
    from scheduler.serving.cluster.reports import FAN_OUT_TIMEOUT_S

    before = {r["replica"]: r["pid"] for r in health(cluster)["replicas"]}
    stuck, other = sorted(before)
    os.kill(before[stuck], signal.SIGSTOP)
    try:
        # Before, /health waited 10 s for each replica that did not answer.
        reply = httpx.get(f"{cluster}/health", timeout=4 * FAN_OUT_TIMEOUT_S)
    finally:
        os.kill(before[stuck], signal.SIGCONT)
    assert reply.status_code == 200
    body = reply.json()
    assert [r["replica"] for r in body["replicas"]] == [other] and body["unreachable"] == [stuck]
    deadline = time.monotonic() + 60  # it answers again once resumed
    while health(cluster)["unreachable"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {r["replica"] for r in health(cluster)["replicas"]} == set(before)


def test_a_killed_replica_ends_its_requests_and_is_replaced(cluster: str) -> None:
    before = {r["replica"]: r["pid"] for r in health(cluster)["replicas"]}
    body = {"prompt": "tell me everything", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as reply:
        victim = reply.headers["x-replica"]
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        os.kill(before[victim], signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data:")]
    assert time.monotonic() - started < 60  # no hang
    error = msgspec.json.decode(rest[-2][5:])["error"]  # an error event naming the replica, then [DONE]
    assert error["code"] == "replica_failed" and victim in error["message"], error
    assert rest[-1] == "data: [DONE]"
    # New requests go to the survivor at once.
    served = [complete(cluster, prompt=f"after the crash {i}") for i in range(6)]
    assert all(r.status_code == 200 for r in served), [r.text for r in served if r.status_code != 200]
    assert victim not in {r.headers["x-replica"] for r in served}
    # Serve starts a replacement, and it rejoins the routing.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = {r["replica"] for r in health(cluster)["replicas"]}
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    assert len(now) == 2 and victim not in now, now
    newcomer = (now - set(before)).pop()
    # Listed (reached by name) may come a moment before new requests are offered to it: once,
    # all 16 requests sent in a row right after it appeared went to the survivor.
    by_replica: dict[str, int] = defaultdict(int)
    deadline = time.monotonic() + 30
    i = 0
    while by_replica[newcomer] == 0 and time.monotonic() < deadline:
        by_replica[complete(cluster, prompt=f"fresh prompt number {i * 13}").headers["x-replica"]] += 1
        i += 1
    assert by_replica[newcomer] > 0, by_replica


def test_a_killed_frontend_cancels_what_it_was_streaming_and_is_replaced(cluster: str) -> None:
    """Its requests' calls and feeds die with it: the replicas cancel those requests (their rows
    and blocks come back), the clients' connections end, and Serve's new frontend serves."""
    first = health(cluster)
    body = {"prompt": "streamed by a frontend about to die", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}

    def stream_until_cut() -> int:
        got = 0
        try:
            with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    got += line.startswith("data:")
        except httpx.HTTPError:
            pass  # the proxy may drop the connection rather than end it
        return got

    before = sum(r["stats"]["generated_tokens"] for r in first["replicas"])
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_until_cut) for _ in range(4)]
        deadline = time.monotonic() + 30
        while sum(r["stats"]["running"] for r in health(cluster)["replicas"]) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(first["frontend_pid"], signal.SIGKILL)
        started = time.monotonic()
        # Every client's stream ended (no hang), cut short: a stream may not have shown its first
        # event yet when the frontend died (once, one of four had none).
        assert all(s.result(timeout=60) < 1500 for s in streams)
    assert time.monotonic() - started < 60
    deadline, now = time.monotonic() + 90, first
    while time.monotonic() < deadline:
        try:
            now = health(cluster)
        except (AssertionError, httpx.HTTPError):  # the proxy has no frontend yet
            time.sleep(0.5)
            continue
        if now["frontend_pid"] != first["frontend_pid"] and not any(
                r["stats"]["running"] or r["streams"]["open"] for r in now["replicas"]):
            break
        time.sleep(0.5)
    assert now["frontend_pid"] != first["frontend_pid"]
    assert all(r["stats"]["running"] == 0 and r["streams"]["open"] == 0 for r in now["replicas"]), now["replicas"]
    assert all(r["stats"]["blocks_used"] == 0 for r in now["replicas"])
    assert sum(r["stats"]["generated_tokens"] for r in now["replicas"]) - before < 4 * 1500  # cancelled
    served = complete(cluster, prompt="served by the new frontend")
    assert served.status_code == 200, served.text


def test_two_frontends_share_the_work_and_what_each_routed(cluster: str, model_cache: Path) -> None:
    """`frontends = 2`: Serve's proxy spreads requests over both, and a session's turns stay on
    one replica whichever frontend takes them (each router learns the sessions the other routed
    from the replicas' reports). The turns share no prefix, so only the session keeps them.
    This deployment takes the other paths: each request streamed on its own (`stream_feed =
    false`), and each replica's scheduler in a child process of its own (`scheduler_process`)."""
    own = free_port()  # the port of the deployment it replaces may be held a moment longer
    deploy(_config(model_cache, frontends=2, feed=False, child=True), 2, listen=("127.0.0.1", own))
    URLS["direct"] = cluster = f"http://127.0.0.1:{own}"
    assert all(r["scheduler_pid"] != r["pid"] for r in health(cluster)["replicas"])
    # Both frontends listen on the one port, each new connection going to either; Serve's proxy
    # spreads its requests over both too.
    for url in URLS.values():
        assert len({health(url)["frontend"] for _ in range(24)}) == 2, url
    assert health(cluster)["feeds"] is None
    bodies = [{"prompt": f"unfed {i}", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for i in range(6)]
    for lines in asyncio.run(_stream_all(cluster, bodies)):
        assert lines[-1] == "data: [DONE]"
        assert msgspec.json.decode(lines[-2][5:])["usage"]["completion_tokens"] == 12
    assert all(r["streams"]["feeds"] == 0 for r in health(cluster)["replicas"])

    def converse(n: int) -> list[str]:
        seen = []
        for turn in range(4):
            reply = complete(cluster, prompt=f"{turn * 17 + n} is where turn {turn} of chat {n} begins",
                             session=f"two-fronts-{n}")
            assert reply.status_code == 200, reply.text
            seen.append(reply.headers["x-replica"])
            time.sleep(0.6)  # a few of the replicas' reports (every 0.2 s here), as between a user's turns
        return seen

    with ThreadPoolExecutor(6) as pool:
        turns = list(pool.map(converse, range(6)))
    assert all(len(set(seen)) == 1 for seen in turns), turns
    assert len({seen[0] for seen in turns}) == 2, turns  # and the sessions spread over both


def test_a_replica_whose_scheduler_process_dies_ends_its_requests_and_is_replaced(cluster: str) -> None:
    cluster = URLS["direct"]  # the two-frontend deployment's port
    before = {r["replica"]: r for r in health(cluster)["replicas"]}
    assert all(r["scheduler_pid"] != r["pid"] for r in before.values())  # a process of its own
    body = {"prompt": "tell me everything again", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as reply:
        victim = reply.headers["x-replica"]
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        os.kill(before[victim]["scheduler_pid"], signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data:")]
    error = msgspec.json.decode(rest[-2][5:])["error"]
    assert error["code"] == "replica_failed" and victim in error["message"], error
    assert rest[-1] == "data: [DONE]"
    # Its health check fails, and Serve replaces it; the other replica serves meanwhile.
    survivor = complete(cluster, prompt="while one replica is replaced")
    assert survivor.status_code == 200, survivor.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = {r["replica"]: r for r in health(cluster)["replicas"]}
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    assert len(now) == 2 and victim not in now, now
    assert all(r["scheduler_pid"] != r["pid"] for r in now.values())


def test_draining_reaches_every_frontend(cluster: str) -> None:
    handle = serve.get_app_handle(APP_NAME)
    assert drain(handle, 2, 5.0) == 0
    replies = [complete(url, prompt=f"too late {i}") for i in range(6) for url in URLS.values()]
    assert all(r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" for r in replies), \
        [r.status_code for r in replies]
