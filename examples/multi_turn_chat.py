"""A multi-turn chat: role blocks are rendered by the model's own chat template.

python examples/multi_turn_chat.py [--address tcp://127.0.0.1:30001]
"""

from __future__ import annotations

from _runtime import use_runtime

import spruce.lang as sl


@sl.function
def multi_turn(s, questions):
    s += sl.system("You are a friendly assistant. Answer in one short sentence.")
    for i, question in enumerate(questions):
        s += sl.user(question)
        s += sl.assistant(sl.gen(f"answer_{i}", max_tokens=32))


def main() -> None:
    use_runtime(__doc__.splitlines()[0])
    questions = ["Hi! What is your name?", "What is a good name for a cat?", "Why?"]
    state = multi_turn.run(questions=questions, temperature=0)
    if not state.ok:
        raise SystemExit(f"error: {state.error()}")
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")


if __name__ == "__main__":
    main()
