"""Streaming: print a gen's text as it is generated, with an iterator and with async.

python examples/streaming.py [--address tcp://127.0.0.1:30001]
"""

from __future__ import annotations

import asyncio

from _runtime import use_runtime

import spruce.lang as sl


@sl.function
def poem(s, topic):
    s += sl.user(f"Write a two-line poem about {topic}.")
    s += sl.assistant(sl.gen("poem", max_tokens=40))


async def stream_async(topic: str) -> None:
    state = poem.run(topic=topic, stream=True, temperature=0)
    async for chunk in state.text_async_iter("poem"):
        print(chunk, end="", flush=True)
    print()


def main() -> None:
    use_runtime(__doc__.splitlines()[0])
    state = poem.run(topic="the sea", stream=True, temperature=0)  # returns at once
    for chunk in state.text_iter("poem"):
        print(chunk, end="", flush=True)
    print("\n---")
    asyncio.run(stream_async("the mountains"))


if __name__ == "__main__":
    main()
