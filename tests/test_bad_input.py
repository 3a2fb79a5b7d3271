"""Bad input of every kind gets an error that names the problem, and service goes on."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.cli.main import main
from scheduler.errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    from pathlib import Path

GOOD = SamplingParams(max_tokens=3, temperature=0.0)

# (prompt, keyword arguments of generate(), what the message must say). Params are built lazily:
# a bad SamplingParams raises when constructed, which is its own case below.
BAD_REQUESTS: list[tuple[Any, dict[str, Any], str]] = [
    ("", {}, "prompt is empty"),
    ([], {}, "prompt is empty"),
    (None, {}, "prompt must be a str or a list"),
    (b"bytes", {}, "prompt must be a str or a list"),
    (("tuple",), {}, "prompt must be a str or a list"),
    (12, {}, "prompt must be a str or a list"),
    ([1, 2.5], {}, r"prompt\[1\] = 2.5 is not a token id"),
    ([1, True], {}, r"prompt\[1\] = True is not a token id"),
    ([-1], {}, r"prompt\[0\] = -1 is not a token id"),
    ([1, 10**9], {}, r"prompt\[1\] = 1000000000 is not a token id"),
    (["a", "b"], {}, r"prompt\[0\] = 'a' is not a token id"),
    ("\ud800 lone surrogate", {}, "prompt is not valid Unicode"),
    ("x" * 1_000_000, {}, "longer than the model's context"),
    ([5] * 3000, {}, "longer than the model's context of 2048"),
    ([5] * 2000, {"params": SamplingParams(max_tokens=100)}, "exceeds the model's context"),
    ([5], {"params": {"max_tokens": 4}}, "params must be SamplingParams"),
    ([5], {"params": "greedy"}, "params must be SamplingParams"),
    ([5], {"priority": "high"}, "priority must be an integer"),
    ([5], {"priority": 1.5}, "priority must be an integer"),
    ([5], {"priority": True}, "priority must be an integer"),
    ([5], {"priority": None}, "priority must be an integer"),
    ([5], {"tenant": ""}, "tenant must be a non-empty string"),
    ([5], {"tenant": 7}, "tenant must be a non-empty string"),
    ([5], {"tenant": None}, "tenant must be a non-empty string"),
    ([5], {"tenant": "t" * 1000}, "tenant must be a non-empty string of at most 256"),
    ([5], {"timeout": 0}, "timeout must be a positive number"),
    ([5], {"timeout": -3}, "timeout must be a positive number"),
    ([5], {"timeout": "10"}, "timeout must be a positive number"),
    ([5], {"timeout": float("inf")}, "timeout must be a positive number"),
    ([5], {"timeout": float("nan")}, "timeout must be a positive number"),
    ([5], {"session": ""}, "session must be None or a non-empty string"),
    ([5], {"session": 7}, "session must be None or a non-empty string"),
    ([5], {"session": "s" * 1000}, "session must be None or a non-empty string of at most 256"),
]

BAD_PARAMS: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": "8"}, "max_tokens must be an integer"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"top_p": 0}, "top_p must be in"),
    ({"top_p": 1.01}, "top_p must be in"),
    ({"top_k": 2.0}, "top_k must be an integer"),
    ({"seed": 2**70}, "seed must be an integer in"),
    ({"stop": ["s"] * 17}, "stop has 17 strings; at most 16"),
    ({"stop": ["x" * 300]}, "each stop string must have 1 to 256"),
    ({"stop": [3]}, "stop must be a sequence of strings"),
    ({"stop": ["\udfff"]}, "stop strings must be valid Unicode"),
    ({"stop_token_ids": list(range(17))}, "stop_token_ids has 17 ids"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids must be a sequence of non-negative integers"),
]


def tiny(cache: Path) -> SchedulerConfig:
    return SchedulerConfig.from_toml(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"')


@pytest.mark.anyio
@pytest.mark.integration
async def test_every_bad_request_is_rejected_by_name_and_service_goes_on(model_cache: Path) -> None:
    assert len(BAD_REQUESTS) + len(BAD_PARAMS) >= 30
    with anyio.fail_after(120):
        async with Scheduler(tiny(model_cache)) as s:
            for prompt, kwargs, message in BAD_REQUESTS:
                with pytest.raises(InvalidRequest, match=message):
                    await s.complete(prompt, **kwargs)
                assert (await s.complete([7, 8], GOOD)).finish_reason == "length"
            for fields, message in BAD_PARAMS:
                with pytest.raises(InvalidRequest, match=message):
                    SamplingParams(**fields)
            st_ = s.stats()
            assert st_.finished == len(BAD_REQUESTS) and st_.rejected == 0  # invalid never queued


BAD_CONFIGS: list[tuple[str, str]] = [
    ("[worker]\nmax_batch = 0", "worker.max_batch"),
    ("[worker]\nmax_batch = -4", "worker.max_batch"),
    ('[worker]\nmax_batch = "64"', "worker.max_batch: Expected `int`"),
    ("[worker]\nprefill_step = 1.5", "worker.prefill_step"),
    ("[worker]\nprefill_every = 0", "worker.prefill_every"),
    ('[worker]\non_failure = "retry"', "worker.on_failure"),
    ("[worker]\nthreads = 2", "worker.threads: unknown key"),
    ("[model]\npath = 5", "model.path: Expected `str`"),
    ('model = "synthetic:tiny"', "model: Expected `object`"),
    ("[scheduler]\nmax_queue = 0", "scheduler.max_queue"),
    ('[scheduler]\npolicy = "random"', "unknown policy 'random'"),
    ('[scheduler]\nshutdown = "later"', "scheduler.shutdown"),
    ("[scheduler]\ndrain_timeout_s = -1", "scheduler.drain_timeout_s"),
    ("[kvpool]\nblock_tokens = 0", "kvpool.block_tokens"),
    ('[kvpool]\nmemory = "0GiB"', "kvpool.memory: must be more than 0"),
    ('[kvpool]\nmemory = "2 parsecs"', "kvpool.memory: cannot read"),
    ("[kvpool]\nmemory = -0.5", "kvpool.memory"),
    ('[kvpool]\nmode = "lazy"', "kvpool.mode"),
    ("[kvpool]\nwatermark = 1.0", "kvpool.watermark"),
    ("[kvpool]\nwatermark = -0.1", "kvpool.watermark"),
    ('[kvpool]\nprefix_cache = "yes"', "kvpool.prefix_cache"),
    ('[logging]\nlevel = "loud"', "logging.level"),
    ('[logging]\nformat = "yaml"', "logging.format"),
    ("[cache]\nsize = 1", "cache: unknown key"),
    ("[worker]\nmax_batch = 1\nmax_batch = 2", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_bad_config_is_a_config_error_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig.from_toml(text)


BAD_CLI: list[tuple[list[str], str]] = [
    ([], "required: COMMAND"),
    (["serve-forever"], "invalid choice: 'serve-forever'"),
    (["run"], "the following arguments are required: prompt"),
    (["run", "hi", "--max-tokens", "0"], "expected a positive integer, got 0"),
    (["run", "hi", "--max-tokens", "many"], "expected a positive integer, got 'many'"),
    (["run", "hi", "--temperature", "-1"], "expected a number >= 0"),
    (["demo", "--requests", "-5"], "expected a positive integer"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_CLI)
def test_bad_cli_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_reports_config_and_model_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "hi", "--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker]\nmax_batch = 0\n")
    assert main(["run", "hi", "--config", str(bad)]) == 2
    assert "worker.max_batch" in capsys.readouterr().err
    assert main(["run", "hi", "--model", "synthetic:enormous"]) == 1
    assert "synthetic:enormous" in capsys.readouterr().err


def test_cli_run_streams_a_completion(model_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = model_cache / "cli.toml"
    cfg.write_text(f'[model]\ncache_dir = "{model_cache}"\n[logging]\nlevel = "warning"\n')
    assert main(["run", "Once upon a time", "--config", str(cfg), "--model", "synthetic:tiny",
                 "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "tokens]" in out and ("[length, 5 tokens]" in out or "[stop," in out)


_values = st.one_of(
    st.integers(-10, 10**6), st.floats(allow_nan=True), st.text(max_size=12), st.booleans(),
    st.lists(st.integers(), max_size=3),
)
_sections = st.sampled_from(["model", "scheduler", "worker", "kvpool", "logging", "extra"])
_keys = st.sampled_from([
    "path", "cache_dir", "policy", "max_queue", "shutdown", "drain_timeout_s", "max_batch",
    "prefill_batch", "prefill_step", "on_failure", "block_tokens", "memory", "format", "level", "x",
])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == -float("inf") else repr(v))
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are TOML basic-string escapes
    return str(v)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_sections, st.dictionaries(_keys, _values, max_size=4), max_size=4))
def test_config_decoding_fuzz_gives_a_config_or_a_config_error(doc: dict[str, dict[str, Any]]) -> None:
    text = "\n".join(
        f"[{section}]\n" + "\n".join(f"{k} = {_toml_value(v)}" for k, v in values.items())
        for section, values in doc.items()
    )
    try:
        cfg = SchedulerConfig.from_toml(text)
    except ConfigError as exc:
        assert str(exc)
        return
    assert cfg.worker.max_batch >= 1 and cfg.kvpool.block_tokens >= 1
