"""Quickstart: gen and select in a chat.

python examples/quickstart.py [--address tcp://127.0.0.1:30001]
"""

from __future__ import annotations

from _runtime import use_runtime

import spruce.lang as sl


@sl.function
def capital(s, country):
    s += sl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sl.user(f"What is the capital of {country}?")
    s += sl.assistant(sl.gen("answer", max_tokens=24, stop="\n"))
    s += sl.user("Is that city in Europe? Answer yes or no.")
    s += sl.assistant(sl.select("in_europe", choices=["yes", "no"]))


def main() -> None:
    use_runtime(__doc__.splitlines()[0])
    state = capital.run(country="France", temperature=0)
    print("answer:   ", state["answer"])
    print("in Europe:", state["in_europe"])
    scores = state.get_meta_info("in_europe")["scores"]
    print("scores:   ", {c: round(x, 3) for c, x in zip(["yes", "no"], scores)})


if __name__ == "__main__":
    main()
