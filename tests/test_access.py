"""API keys, CORS, `/tokenize` and `/detokenize`, on the real app over a real scheduler, with the
official `openai` client where a client would meet them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import httpx
import openai
import pytest

from scheduler import SchedulerConfig
from scheduler.errors import ConfigError
from scheduler.serving.http.access import KEY_ENV, Access
from scheduler.serving.http.app import create_app
from tests.serve_process import serve
from tests.test_server import HELLO, served

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

GUARDED = '[server]\napi_keys = ["k-one", "k-two"]\ncors_origins = ["https://app.example"]\n'
BODY = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}


async def test_a_request_without_the_right_key_is_401_in_openais_shape(model_cache: Path) -> None:
    with anyio.fail_after(60):
        async with served(model_cache, GUARDED) as (_, c):
            missing = await c.post("/v1/completions", json=BODY)
            wrong = await c.post("/v1/completions", json=BODY, headers={"authorization": "Bearer k-three"})
            bearer = await c.post("/v1/completions", json=BODY, headers={"authorization": "Bearer k-two"})
            x_api_key = await c.post("/v1/completions", json=BODY, headers={"x-api-key": "k-one"})
            health = await c.get("/health")
            models = await c.get("/v1/models")
    for r in (missing, wrong, models):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "invalid_api_key"
    assert "Missing API key" in missing.json()["error"]["message"]
    assert wrong.json()["error"]["message"] == "Incorrect API key provided."
    assert bearer.status_code == x_api_key.status_code == 200
    assert bearer.json()["usage"]["completion_tokens"] == 3
    assert health.status_code == 200  # open_paths: probes need no key


async def test_the_openai_client_with_its_api_key_gets_in_and_a_wrong_one_does_not(model_cache: Path) -> None:
    with anyio.fail_after(60):
        async with served(model_cache, GUARDED) as (s, _):
            transport = httpx.ASGITransport(app=create_app(scheduler=s))

            def client(key: str) -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, max_retries=0,
                                          http_client=httpx.AsyncClient(transport=transport))
            reply = await client("k-one").chat.completions.create(
                model="m", messages=[HELLO], max_tokens=4, extra_body={"ignore_eos": True})
            with pytest.raises(openai.AuthenticationError) as refused:
                await client("nope").chat.completions.create(model="m", messages=[HELLO], max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


async def test_cors_answers_preflights_and_marks_responses_for_allowed_origins_only(model_cache: Path) -> None:
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    with anyio.fail_after(60):
        async with served(model_cache, GUARDED) as (_, c):
            allowed = await c.options("/v1/chat/completions", headers=preflight)
            other = await c.options("/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"})
            answered = await c.post("/v1/completions", json=BODY,
                                    headers={"origin": "https://app.example", "x-api-key": "k-one"})
            refused = await c.post("/v1/completions", json=BODY, headers={"origin": "https://app.example"})
            foreign = await c.post("/v1/completions", json=BODY,
                                   headers={"origin": "https://evil.example", "x-api-key": "k-one"})
    assert allowed.status_code == 204
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert allowed.headers["access-control-allow-headers"] == "authorization, content-type"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "https://app.example"
    # A browser must be able to read the 401 too, or it reports a CORS failure instead.
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers


async def test_tokenize_and_detokenize_agree_with_the_models_own_tokenizer(model_cache: Path) -> None:
    text = "The quick brown fox"
    with anyio.fail_after(60):
        async with served(model_cache) as (s, c):
            prompt = await c.post("/tokenize", json={"prompt": text})
            bare = await c.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
            chat = await c.post("/tokenize", json={"messages": [HELLO]})
            back = await c.post("/detokenize", json={"tokens": prompt.json()["tokens"]})
            bad = await c.post("/detokenize", json={"tokens": [1, 10**9]})
            both = await c.post("/tokenize", json={"prompt": text, "messages": [HELLO]})
            codec, context = s.model.codec, s.model.info.context_length
            expected_chat = s.chat_prompt([HELLO])
    assert prompt.json() == {"count": len(codec.encode(text)), "max_model_len": context,
                             "tokens": codec.encode(text)}
    assert bare.json()["tokens"] == list(codec.tokenizer.encode(text, add_special_tokens=False))
    assert chat.json()["tokens"] == expected_chat and chat.json()["count"] == len(expected_chat)
    assert text in back.json()["prompt"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert "tokens[1] = 1000000000 is not a token id" in bad.json()["error"]["message"]
    assert both.status_code == 400 and "exactly one of prompt or messages" in both.json()["error"]["message"]


def test_keys_come_from_the_config_the_environment_and_compare_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "from-env")
    access = Access.of(SchedulerConfig.from_toml('[server]\napi_keys = ["from-config"]\nopen_paths = []').server)
    for key, ok in [("from-env", True), ("from-config", True), ("from-confi", False), ("from-config2", False), ("", False)]:
        assert (access.refusal("GET", "/health", {"authorization": f"Bearer {key}"}) is None) is ok, key
    monkeypatch.delenv(KEY_ENV)
    assert not Access.of(SchedulerConfig().server).keys  # nothing configured: no check at all


@pytest.mark.parametrize(("toml", "message"), [
    ('[server]\napi_keys = [" "]', "api_keys: a key is empty"),
    ('[server]\nopen_paths = ["health"]', "open_paths: 'health' is not a path"),
    ('[server]\ncors_origins = ["app.example"]', "cors_origins: 'app.example' is not an origin"),
])
def test_bad_access_settings_are_config_errors_naming_the_key(toml: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig.from_toml(toml)


def test_serve_takes_its_key_from_the_command_line(model_cache: Path, tmp_path: Path) -> None:
    with serve(model_cache, tmp_path, "", "--api-key", "cli-key") as srv:
        right = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="cli-key", max_retries=0, timeout=30)
        wrong = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="other", max_retries=0, timeout=30)
        with right, wrong:
            models = right.models.list()
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        log = srv.log(wait=0.5)
    assert [m.id for m in models.data] == ["synthetic:tiny"]
    assert "api_keys_required" in log and "cli-key" not in log  # the key itself is never logged
