"""Regex building blocks: dtype regexes, JSON-safe string formats, literal escaping.

Every regex here is accepted by all the parsers that see it: Python's `re` (the byte NFA
the grammars are built from, and the regex-level checks) and interegular (the schema
converter's automaton algebra, automata.py).
"""

from __future__ import annotations

# One JSON string character: anything but '"', '\\' and control characters, or an escape.
# (The same as outlines-core's STRING_INNER.)
JSON_STRING_CHAR = r'([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
JSON_STRING = f'"{JSON_STRING_CHAR}*"'

# Numbers have at most 16 significant integer digits and 16 fraction digits (beyond what a
# float64 holds anyway): unbounded digit runs let a greedy model write "1000000..." until
# max_new_tokens, which the bundled model did on the shared schemas.
MAX_DIGITS = 16
JSON_INTEGER = rf"-?(0|[1-9][0-9]{{0,{MAX_DIGITS - 1}}})"
JSON_NUMBER = rf"{JSON_INTEGER}(\.[0-9]{{1,{MAX_DIGITS}}})?([eE][+-]?[0-9]{{1,3}})?"
JSON_FRACTION = rf"{JSON_INTEGER}\.[0-9]{{0,{MAX_DIGITS - 1}}}[1-9]"  # not integral, no exponent
_JSON_SCALAR = f"(?:{JSON_STRING}|{JSON_NUMBER}|true|false|null)"
ANY_JSON_DEPTH = 2  # containers inside containers; each level makes the regex 4x larger (1,308
# expanded positions at depth 2, 5,308 at 3, 21,308 at 4: most of the size cap)


def json_value_regex(depth: int = ANY_JSON_DEPTH) -> str:
    """Any (compact) JSON value with containers nested at most `depth` deep."""
    if depth == 0:
        return _JSON_SCALAR
    inner = json_value_regex(depth - 1)
    return f"(?:{_JSON_SCALAR}|{json_object_regex(inner)}|{json_array_regex(inner)})"


def json_object_regex(value: str) -> str:
    return rf"\{{(?:{JSON_STRING}:{value}(?:,{JSON_STRING}:{value})*)?\}}"


def json_array_regex(value: str) -> str:
    return rf"\[(?:{value}(?:,{value})*)?\]"


DTYPE_REGEXES = {
    "int": JSON_INTEGER,
    "float": JSON_NUMBER,
    "bool": r"(True|False)",  # Python literals, like SGLang's gen(dtype=bool)
    "str": JSON_STRING,
}

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_LEAP_DAY = f"{_LEAP_YEAR}-02-29"
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_DAY})"
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"  # to nanoseconds
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,30}[A-Za-z0-9])?"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_URI_CHAR = r"[A-Za-z0-9._~%!$&'()*+,;=:@/?#\[\]-]"
_IPV4_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = rf"{_IPV4_OCTET}(?:\.{_IPV4_OCTET}){{3}}"
_HEX4 = r"[0-9A-Fa-f]{1,4}"


def _ipv6_regex() -> str:
    """Eight groups, or "::" standing for at least one zero group between k and m groups."""

    def groups(n: int) -> str:
        return "" if n == 0 else _HEX4 + (f"(?::{_HEX4}){{{n - 1}}}" if n > 1 else "")

    forms = [groups(8)] + [f"{groups(k)}::{groups(m)}" for k in range(8) for m in range(8 - k)]
    return "(?:" + "|".join(forms) + ")"


_IPV6 = _ipv6_regex()
_POINTER = r'(?:/(?:[^~/"\\\x00-\x1F]|~[01])*)*'

# JSON-safe regexes (no '"', '\\' or control characters) for the string formats, valid
# under jsonschema's FormatChecker. Replaces outlines-core's: its email and uri regexes can
# emit raw '"' / control characters (invalid JSON), its date allows Feb 31, its time emits
# a literal backslash. Formats not listed here are annotations (JSON Schema 2019-09 on).
FORMAT_REGEXES = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "email": (  # dot-atom form, bounded: a random walk must end, the regex stay small
        f"{_ATEXT}{{1,32}}(?:\\.{_ATEXT}{{1,32}})?@(?:{_HOST_LABEL}\\.){{1,3}}[A-Za-z]{{2,24}}"
    ),
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": rf"[A-Za-z][A-Za-z0-9+.-]{{0,31}}:{_URI_CHAR}+",
    "hostname": rf"{_HOST_LABEL}(?:\.{_HOST_LABEL}){{0,6}}",
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "json-pointer": _POINTER,
    "relative-json-pointer": rf"(?:0|[1-9][0-9]{{0,8}})(?:#|{_POINTER})",
}

_META = set("\\.^$|?*+()[]{}")


def escape_literal(text: str) -> str:
    """Escapes only regex metacharacters: Rust `regex` rejects escapes such as `\\<`."""
    return "".join("\\" + c if c in _META else c for c in text)


def choices_regex(choices: list[str]) -> str:
    return "(" + "|".join(escape_literal(c) for c in choices) + ")"


def strip_anchors(regex: str) -> str:
    """Drops a leading '^' and a trailing unescaped '$': constraints always match the whole
    output, and outlines-core refuses anchors."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex) - 1 - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            regex = regex[:-1]
    return regex
