"""A small agent on the default model (SmolLM2-135M): it calls a tool (the call forced and held to
the tool's schema), gets the result, and answers; then it extracts a record as JSON that validates
against a schema. All through the Python API, no server.

    python examples/agent.py [--model smollm2-135m] [--city Paris]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import anyio

from scheduler import SamplingParams, Scheduler, SchedulerConfig

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
RECORD = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "country": {"type": "string", "maxLength": 40},
                   "famous_for": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 30}}},
    "required": ["city", "country", "famous_for"],
    "additionalProperties": False,
}


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    """The tool itself: a stand-in for a real weather service."""
    return {"city": city, "temperature": 18 if unit == "celsius" else 64, "unit": unit, "sky": "clear"}


async def main(model: str, city: str) -> None:
    config = SchedulerConfig.from_toml(f'[model]\npath = "{model}"\n[logging]\nlevel = "warning"\n')
    async with Scheduler(config) as sched:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is the weather like in {city}?"}]
        calling = sched.tool_calling([WEATHER_TOOL], "required")
        done = await sched.complete(sched.chat_prompt(messages, tools=calling),
                                    SamplingParams(max_tokens=96, temperature=0, grammar=calling.grammar()))
        [call] = calling.reply(done.text).tool_calls
        print(f"tool call: {call.name}({call.arguments})")
        result = get_weather(**json.loads(call.arguments))
        function = {"name": call.name, "arguments": call.arguments}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
                                                                "function": function}]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
        ]
        # The answer from the result: no more calls ("none" still writes the call and result above
        # into the conversation as the model expects them).
        final = sched.tool_calling([WEATHER_TOOL], "none")
        answer = await sched.complete(sched.chat_prompt(messages, tools=final),
                                      SamplingParams(max_tokens=48, temperature=0))
        print(f"answer: {answer.text.strip()}")

        ask = [{"role": "user", "content": f"Describe {city} as JSON: city, country, what it is famous for."}]
        record = await sched.complete(sched.chat_prompt(ask),
                                      SamplingParams(max_tokens=128, temperature=0, json_schema=RECORD))
        print(f"record: {json.dumps(json.loads(record.text))}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--city", default="Paris")
    args = ap.parse_args()
    anyio.run(main, args.model, args.city)
