"""Few-shot QA over a batch: run_batch shares the few-shot prefix through the radix cache.

python examples/few_shot_qa.py [--address tcp://127.0.0.1:30001]
"""

from __future__ import annotations

import time

from _runtime import use_runtime

import spruce.lang as sl

EXAMPLES = [
    ("What is the capital of Italy?", "Rome"),
    ("What is the largest planet?", "Jupiter"),
    ("How many legs does a spider have?", "Eight"),
    ("What color is the sky on a clear day?", "Blue"),
]
FEW_SHOT = "Answer each question with one or two words.\n\n" + "".join(
    f"Question: {q}\nAnswer: {a}\n\n" for q, a in EXAMPLES
)
QUESTIONS = [
    "What is the capital of France?",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "What animal says moo?",
    "What is frozen water called?",
    "What is the capital of Japan?",
    "What do bees make?",
    "How many wheels does a bicycle have?",
]


@sl.function
def few_shot_qa(s, question):
    s += FEW_SHOT + "Question: " + question + "\nAnswer:"
    s += sl.gen("answer", max_tokens=8, stop="\n")


def main() -> None:
    use_runtime(__doc__.splitlines()[0])
    start = time.perf_counter()
    states = few_shot_qa.run_batch(
        [{"question": q} for q in QUESTIONS], temperature=0, progress_bar=True
    )
    seconds = time.perf_counter() - start
    for question, state in zip(QUESTIONS, states):
        print(f"{question:40s} -> {state['answer'].strip() if state.ok else state.error()}")
    cached = sum(s.get_meta_info("answer")["cached_tokens"] for s in states if s.ok)
    prompt = sum(s.get_meta_info("answer")["prompt_tokens"] for s in states if s.ok)
    print(
        f"{len(states)} programs in {seconds:.2f} s; {cached} of {prompt} prompt tokens came from the cache"
    )


if __name__ == "__main__":
    main()
