"""`Request`, the one request value: checked as it is built, the same through `generate`,
`submit` and `complete`, across msgpack (the cluster's wire), and `EngineClient`, the protocol the
server talks to."""

from __future__ import annotations

import importlib
import re
import sys
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest

from scheduler import EngineClient, Request, SamplingParams, Scheduler
from scheduler.errors import InvalidRequest
from scheduler.request import make_request
from scheduler.serving.cluster.replica import Job
from scheduler.serving.http import requests as rq
from scheduler.serving.http.app import create_app
from scheduler.streaming.chunks import chunk_channel
from tests.test_integration import tiny

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": 7}, "prompt must be a str or a list of token ids, got int"),
        ({"prompt": "a\ud800b"}, "prompt is not valid Unicode text"),
        ({"prompt": "x", "params": {"max_tokens": 3}}, "params must be SamplingParams, got dict"),
        ({"prompt": "x", "priority": True}, "priority must be an integer, got bool"),
        ({"prompt": "x", "tenant": ""}, "tenant must be a non-empty string"),
        ({"prompt": "x", "tenant": "t" * 257}, "at most 256 characters"),
        ({"prompt": "x", "timeout": 0}, "timeout must be a positive number of seconds"),
        ({"prompt": "x", "timeout": float("nan")}, "timeout must be a positive number of seconds"),
        ({"prompt": "x", "session": ""}, "session must be None or a non-empty string"),
    ],
)
def test_a_bad_request_is_refused_as_it_is_built_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")):
        Request(**fields)


def test_generate_arguments_make_the_same_request_with_default_params() -> None:
    made = make_request([1, 2], None, 3, "alice", 5.0, "s1")
    assert made == Request(prompt=[1, 2], params=SamplingParams(), priority=3, tenant="alice", timeout=5.0,
                           session="s1")
    assert made.params.max_tokens == SamplingParams().max_tokens


def test_a_request_crosses_msgpack_unchanged_and_a_bad_one_is_refused_on_decode() -> None:
    job = Job(Request(prompt=[5, 6, 7], params=SamplingParams(max_tokens=4, seed=9, stop=("x",)),
                      priority=-2, tenant="bob", session="chat-1"), keys=(11, 12))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(job), type=Job)
    assert back == job and back.request.params.stop == ("x",)
    bad = msgspec.msgpack.encode({"request": {"prompt": [1], "tenant": ""}, "keys": []})
    with pytest.raises(msgspec.ValidationError, match="tenant must be a non-empty string"):
        msgspec.msgpack.decode(bad, type=Job)


def test_an_http_body_becomes_one_request_with_openais_user_as_the_tenant() -> None:
    body = msgspec.json.decode(
        b'{"prompt": "hi", "max_tokens": 7, "temperature": 0, "user": "carol", "priority": 4,'
        b' "session": "s", "stop": "END", "seed": 1}', type=rq.CompletionRequest)
    made = rq.request(body, [3, 4], body.max_tokens, 16, vocab_size=100)
    assert made == Request(prompt=[3, 4], params=SamplingParams(max_tokens=7, temperature=0.0, stop=("END",), seed=1),
                           priority=4, tenant="carol", session="s")




@pytest.mark.anyio
@pytest.mark.integration
async def test_generate_submit_and_complete_of_one_request_give_the_same_greedy_tokens(model_cache: Path) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 42, 9, 100, 7]
    with anyio.fail_after(120):
        async with Scheduler(tiny(model_cache)) as s:
            engine: EngineClient = s  # mypy checks the protocol; isinstance checks it at run time
            assert isinstance(engine, EngineClient)
            via_generate = [t async for c in s.generate(prompt, greedy, tenant="a") for t in c.token_ids]
            request = Request(prompt=prompt, params=greedy, tenant="a")
            stream = engine.submit(request)
            assert stream.request is request  # carried as it is, not spelled out again
            via_submit = [t async for c in stream for t in c.token_ids]
            whole = await s.complete(request)
            send, recv = chunk_channel()
            with pytest.warns(DeprecationWarning, match="use Scheduler.submit"):
                await s.submit_tokens(prompt, greedy, send, tenant="a")
            via_old = []
            while not via_old or via_old[-1].finish_reason is None:
                via_old.append(await recv.receive())
            with pytest.raises(InvalidRequest, match=r"prompt\[0\] = 999999 is not a token id"):
                s.submit(Request(prompt=[999999], params=greedy))
    assert len(via_generate) == 12
    assert via_submit == via_generate == whole.token_ids == [t for c in via_old for t in c.token_ids]
    assert whole.prompt_tokens == len(prompt) and whole.finish_reason == "length"


def test_the_old_path_of_create_app_still_imports_with_a_deprecation_warning() -> None:
    sys.modules.pop("scheduler.http.app", None)
    with pytest.warns(DeprecationWarning, match="moved to scheduler.serving.http.app"):
        old = importlib.import_module("scheduler.http.app")
    assert old.create_app is create_app


def test_token_ids_are_checked_whole_and_the_first_bad_one_is_named() -> None:
    """A prompt of token ids: every one an int (not a bool) in the vocabulary; the error names
    the first that is not, whatever else follows it."""
    from scheduler.request import check_token_ids

    check_token_ids(list(range(4096)), 4096)
    check_token_ids([0], 1)
    for prompt, bad in [([1, True, 3], "prompt[1] = True"), ([5, -1, 2.0], "prompt[1] = -1"),
                        ([1, 2, 4096], "prompt[2] = 4096"), ([1, 2.0], "prompt[1] = 2.0"),
                        ([7, "a", -3], "prompt[1] = 'a'"), ([None], "prompt[0] = None")]:
        with pytest.raises(InvalidRequest, match="^" + re.escape(f"{bad} is not a token id in [0, 4096)")):
            check_token_ids(prompt, 4096)
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        check_token_ids([], 4096)
