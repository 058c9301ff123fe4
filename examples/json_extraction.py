"""JSON extraction: a gen constrained by a pydantic model's JSON schema.

python examples/json_extraction.py [--address tcp://127.0.0.1:30001]
"""

from __future__ import annotations

import pydantic
from _runtime import use_runtime

import spruce.lang as sl


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: float


@sl.function
def extract(s, passage):
    s += sl.system(
        "Extract the city in the text as JSON with the keys name, country and population_millions."
    )
    s += sl.user(passage)
    s += sl.assistant(sl.gen("city", json_schema=City, max_tokens=64))


def main() -> None:
    use_runtime(__doc__.splitlines()[0])
    passage = "Paris, the capital of France, is home to about 2.1 million people."
    state = extract.run(passage=passage, temperature=0)
    if not state.ok:
        raise SystemExit(f"error: {state.error()}")
    print("raw: ", state["city"])
    try:
        print("city:", City.model_validate_json(state["city"]))
    except pydantic.ValidationError as e:  # only when the runtime does not enforce schemas
        print("not valid against the schema:", e.errors()[0]["msg"])


if __name__ == "__main__":
    main()
