"""Structured output: JSON schemas and grammars held token by token (llguidance), on the real
SmolLM2 through the Python API and through the official `openai` client; every output parses and
validates against its schema with `jsonschema`."""

from __future__ import annotations

import json
from typing import Any

import anyio
import jsonschema
import mlx.core as mx
import openai
import pydantic
import pytest

from scheduler import SamplingParams, Scheduler
from scheduler.errors import InvalidRequest
from scheduler.serving.http.app import create_app
from tests.test_real_model import real_config
from tests.test_server import uvicorn_serving
from workers.batching.grammar import (
    GrammarRow,
    GrammarRows,
    GrammarTokenizer,
    grammar_tokenizer,
)
from workers.batching.grammar_text import json_schema_grammar
from workers.loading.named import DEFAULT_MODEL

pytestmark = pytest.mark.anyio

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                   "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)


def ask(s: Scheduler, text: str) -> list[int]:
    return s.chat_prompt([{"role": "user", "content": text}])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_every_output_in_a_mixed_batch_validates_against_its_schema() -> None:
    """Greedy and sampled rows with the schema share a batch with free rows; each schema row's
    text is JSON valid under the schema and ends on its own, the free rows are untouched."""
    results: dict[int, Any] = {}
    with anyio.fail_after(180):
        async with Scheduler(real_config()) as s:
            free = await s.complete(ask(s, "Describe a person."), SamplingParams(max_tokens=24, temperature=0))

            async def one(i: int) -> None:
                if i < 6:
                    params = SamplingParams(max_tokens=96, temperature=0.0 if i % 2 else 0.9, seed=i,
                                            json_schema=PERSON)
                    text = f"Describe person {i} as JSON: name, age, colors."
                else:
                    params, text = SamplingParams(max_tokens=24, temperature=0), "Describe a person."
                results[i] = await s.complete(ask(s, text), params)

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
            assert s.stats().structured_output
    for i in range(6):
        c = results[i]
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), PERSON)
    for i in (6, 7):  # greedy free rows: as the one run alone
        assert results[i].text == free.text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_seeded_schema_request_repeats_and_a_grammar_holds_its_words() -> None:
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=11, json_schema=PERSON)
    with anyio.fail_after(120):
        async with Scheduler(real_config()) as s:
            prompt = ask(s, "Describe a person as JSON.")
            first = await s.complete(prompt, params)
            async with anyio.create_task_group() as tg:  # again, now beside other rows
                for i in range(3):
                    tg.start_soon(s.complete, prompt, SamplingParams(max_tokens=16, seed=i))
                second = await s.complete(prompt, params)
            answer = await s.complete(ask(s, "Is the sky blue? Answer yes or no."),
                                      SamplingParams(max_tokens=8, temperature=0.9, seed=3,
                                                     grammar='start: ("yes" | "no") "."'))
    assert first.text == second.text
    jsonschema.validate(json.loads(first.text), PERSON)
    assert answer.text in ("yes.", "no.") and answer.finish_reason == "stop"


@pytest.mark.parametrize(("kw", "message"), [
    ({"json_schema": {"type": "objectx"}}, "json_schema cannot be compiled: Invalid type: objectx"),
    ({"json_schema": {"type": "string", "pattern": "(a"}}, "json_schema cannot be compiled: regex parse error"),
    ({"json_schema": {"$ref": "#/nowhere"}}, "json_schema cannot be compiled"),
    ({"json_schema": [1, 2]}, "json_schema must be a JSON Schema object"),
    ({"grammar": "start: nothing_defined"}, "grammar cannot be compiled"),
    ({"json_schema": {"type": "object"}, "grammar": 'start: "a"'}, "give json_schema or grammar, not both"),
    ({"json_schema": {"type": "object"}, "ignore_eos": True}, "ignore_eos cannot be combined"),
])
def test_a_schema_or_grammar_the_engine_cannot_use_is_refused_with_its_reason(
        kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match="^" + message.replace("(", r"\(").replace("$", r"\$")):
        SamplingParams(**kw)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_openai_client_gets_json_that_validates_streamed_or_not_and_parses_models() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages: Any = [{"role": "user", "content": "Describe a person as JSON."}]
    with anyio.fail_after(180):
        async with Scheduler(real_config()) as s, uvicorn_serving(create_app(scheduler=s)) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            async with client:
                whole = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=messages, max_tokens=96, temperature=0,
                    response_format=fmt)  # type: ignore[arg-type]
                stream = await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=messages, max_tokens=96, temperature=0,
                    response_format=fmt, stream=True)  # type: ignore[arg-type]
                pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
                parsed = await client.chat.completions.parse(
                    model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}],
                    max_tokens=96, temperature=0, response_format=City)
                anything = await client.completions.create(
                    model=DEFAULT_MODEL, prompt="A JSON object describing a dog:", max_tokens=64,
                    temperature=0, extra_body={"response_format": {"type": "json_object"}})
                with pytest.raises(openai.BadRequestError) as bad:
                    await client.chat.completions.create(
                        model=DEFAULT_MODEL, messages=messages, max_tokens=8,
                        response_format={"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "string", "pattern": "(a"}}})
                with pytest.raises(openai.BadRequestError) as unknown:
                    await client.chat.completions.create(
                        model=DEFAULT_MODEL, messages=messages, max_tokens=8,
                        response_format={"type": "yaml"})  # type: ignore[arg-type,typeddict-item]
    text = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    assert "".join(pieces) == text
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    if anything.choices[0].finish_reason == "stop":  # an open object may run to max_tokens
        assert isinstance(json.loads(anything.choices[0].text), dict)
    else:
        assert anything.choices[0].text.startswith("{")
    assert bad.value.status_code == 400 and "regex parse error" in bad.value.message
    assert bad.value.body["param"] == "response_format"  # type: ignore[index]
    assert unknown.value.status_code == 400 and "response_format.type" in unknown.value.message


@pytest.fixture(scope="module")
def grammar_tok() -> GrammarTokenizer:
    from transformers import PreTrainedTokenizerFast

    from workers.loading.models import resolve_model

    hf = PreTrainedTokenizerFast.from_pretrained(str(resolve_model(DEFAULT_MODEL)))
    tok, why = grammar_tokenizer(hf, 49152 + 64)  # wider than the tokenizer: padded logits
    assert tok is not None, why
    return tok


class Steps:
    """Decode steps as `GrammarRows` sees them: the decoding rows and each step's input tokens."""

    def __init__(self, uids: list[int], first: list[int]) -> None:
        self.uids, self.inputs = uids, mx.array(first)

    def __call__(self) -> tuple[list[int], mx.array]:
        return self.uids, self.inputs

    def feed(self, tokens: list[int]) -> None:
        self.inputs = mx.array(tokens)  # a new step: a new input array


def allowed(row: GrammarRow, width: int) -> list[int]:
    out = row(mx.array([0]), mx.zeros((1, width)))
    return [i for i, ok in enumerate((out[0] > -1e9).tolist()) if ok]


def test_grammar_rows_step_together_and_a_preempted_row_resumes_where_it_left(
        grammar_tok: GrammarTokenizer) -> None:
    """Two rows in one batch each follow their own tokens; a row re-admitted after preemption
    replays what it generated and gets the mask it had when it stopped. Padding ids past the
    vocabulary are never allowed; a new row's first step, taken before it joins the decoding
    rows, gets its first mask."""
    hf = grammar_tok._hf
    grammar = json_schema_grammar(PERSON)
    generated = hf.encode('{"name": "Ada", "age": 3', add_special_tokens=False)
    other = hf.encode('{"name": "Bob"', add_special_tokens=False)
    steps = Steps([10, 11], [1, 1])  # the first step feeds each row its last prompt token
    rows = GrammarRows(grammar_tok, steps)
    a, b = rows.row(grammar), rows.row(grammar)
    rows.bind(10, a)
    rows.bind(11, b)
    width = grammar_tok.vocab_size
    first = allowed(a, width)
    assert first == allowed(b, width) and hf.decode(first) == '{"'
    for k, t in enumerate(generated):
        ok_a, ok_b = allowed(a, width), allowed(b, width)
        u = other[k] if k < len(other) else ok_b[0]
        assert t in ok_a and u in ok_b
        steps.feed([t, u])
    after = allowed(a, width)
    assert {hf.decode([t]) for t in after} >= {"0", "5", ","} and all(t < 49152 for t in after)
    resumed_steps = Steps([12], [generated[-1]])
    resumed_rows = GrammarRows(grammar_tok, resumed_steps)
    resumed = resumed_rows.row(grammar, replay=generated)
    resumed_rows.bind(12, resumed)
    assert allowed(resumed, width) == after
    fresh = rows.row(grammar)  # mlx-lm steps new rows once before they join the decoding rows
    rows.bind(99, fresh)
    assert allowed(fresh, width) == first
    assert allowed(rows.row(grammar), width) == [grammar_tok.eos]  # never bound to a row


def test_a_tokenizer_the_engine_cannot_read_is_reported_not_used() -> None:
    tok, why = grammar_tokenizer(object(), 100)
    assert tok is None and "fast (Rust) tokenizers" in why
