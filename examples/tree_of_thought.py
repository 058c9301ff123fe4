"""Tree of thought: fork the conversation into several approaches that run in parallel,
then let the model pick the best one.

    python examples/tree_of_thought.py [--address tcp://127.0.0.1:30001]
"""

from __future__ import annotations

from _runtime import use_runtime

import spruce.lang as sl

NUM_BRANCHES = 3


@sl.function
def tree_of_thought(s, question):
    s += sl.system("You are a careful thinker. Give one idea per answer, in one sentence.")
    s += sl.user(question)
    branches = s.fork(NUM_BRANCHES)  # the shared prompt is cached once; the branches reuse it
    for i, branch in enumerate(branches):
        branch += sl.assistant(
            f"Idea {i + 1}:" + sl.gen("idea", max_tokens=32, stop="\n", temperature=0.8, seed=i)
        )
    branches.join()  # s["idea"] is now the list of the branches' ideas
    ideas = "\n".join(f"{i + 1}. {idea.strip()}" for i, idea in enumerate(s["idea"]))
    s += sl.user(f"Here are some ideas:\n{ideas}\nWhich idea is the best? Answer with its number.")
    s += sl.assistant(sl.select("best", choices=[str(i + 1) for i in range(NUM_BRANCHES)]))


def main() -> None:
    use_runtime(__doc__.splitlines()[0])
    state = tree_of_thought.run(question="How can I keep a cup of tea warm for longer?")
    if not state.ok:
        raise SystemExit(f"error: {state.error()}")
    for i, idea in enumerate(state["idea"]):
        print(f"idea {i + 1}:{idea}")
    print("best:", state["best"])


if __name__ == "__main__":
    main()
