"""The JSON-schema converter: a schema to a regex for the automaton (json_schema.py is the
entry; schema_*.py the keywords: references, merging allOf, negation, objects, scalars, the
size cap), and its validator for finished outputs (schema_validator.py)."""
