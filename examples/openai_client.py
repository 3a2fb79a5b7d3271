"""The official `openai` client, unmodified, against `mlx-scheduler serve`.

    mlx-scheduler serve --model synthetic:tiny --port 8000 &
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused")  # the server checks no key
    model = client.models.list().data[0].id

    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16)
    print(f"completion: {done.choices[0].text!r} ({done.choices[0].finish_reason}, {done.usage})")

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about batching"}],
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
        user="alice",  # the scheduler's tenant
        extra_body={"priority": 0},  # extension: lower is served first under policy = "priority"
    )
    print("chat: ", end="")
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage is not None:  # the last chunk, when include_usage is set
            usage = chunk.usage
            print(f"\n[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    main(parser.parse_args().base_url)
