"""Regex algebra on finite automata (interegular): intersection and difference of regexes,
then back to a regex by state elimination; and the "any string but these words" regex.

Every regex built here uses only what interegular and Python `re` (the byte NFA's parser)
both accept: non-capturing groups, character classes with escaped punctuation.
"""

from __future__ import annotations

from functools import reduce

import interegular
from interegular.fsm import FSM, anything_else

from spruce.constrained.core.errors import ConstraintError, TooLarge

MAX_AUTOMATON_STATES = 2000  # state elimination is cubic in the states it removes
_CLASS_SPECIAL = set("\\]^-[&~|")


def regex_fsm(regex: str) -> FSM:
    try:
        return interegular.parse_pattern(regex).to_fsm()
    except Exception as e:  # noqa: BLE001 - interegular raises its own Unsupported / InvalidSyntax types
        raise ConstraintError(f"unsupported regex {regex[:80]!r}: {e}") from None


def intersect_regexes(regexes: list[str]) -> str | None:
    """A regex for the strings every regex matches in full; None when there is none."""
    if len(regexes) == 1:
        return regexes[0]
    return fsm_to_regex(reduce(lambda a, b: a & b, [regex_fsm(r) for r in regexes]))


def subtract_regexes(regex: str, removed: list[str]) -> str | None:
    """A regex for the strings `regex` matches and none of `removed` does."""
    if not removed:
        return regex
    result = regex_fsm(regex)
    for other in removed:
        result = result - regex_fsm(other)
    return fsm_to_regex(result)


def can_emit(regex: str, chars: frozenset[str]) -> bool:
    """Whether some string `regex` matches contains one of `chars`."""
    fsm = regex_fsm(regex)
    live = _live_states(fsm)
    outside = any(c not in dict(fsm.alphabet.items()) for c in chars)  # read as anything_else
    for state in live:
        for symbol, target in fsm.map.get(state, {}).items():
            members = fsm.alphabet.by_transition[symbol]
            if target in live and (
                any(c in chars for c in members) or (outside and anything_else in members)
            ):
                return True
    return False


def regexes_disjoint(a: str, b: str) -> bool:
    return regex_fsm(a).isdisjoint(regex_fsm(b))


def fsm_to_regex(fsm: FSM, max_states: int = MAX_AUTOMATON_STATES) -> str | None:
    """State elimination; None for the empty language; TooLarge past `max_states`."""
    fsm = fsm.reduce()
    live = _live_states(fsm)
    if fsm.initial not in live:
        return None
    if len(live) > max_states:
        raise TooLarge(
            f"regex intersection too large ({len(live)} automaton states, cap "
            f"{max_states}); simplify the pattern or its length bounds"
        )
    edges = _edges(fsm, live)
    start, end = "start", "end"
    edges[(start, fsm.initial)] = ""
    for state in fsm.finals & live:
        edges[(state, end)] = ""
    for state in _elimination_order(live, edges):
        _eliminate(state, edges)
    return edges.get((start, end))


def _live_states(fsm: FSM) -> set:
    """States from which a final state is reachable."""
    live = set(fsm.finals)
    changed = True
    while changed:
        changed = False
        for state, moves in fsm.map.items():
            if state not in live and any(target in live for target in moves.values()):
                live.add(state)
                changed = True
    return live


def _edges(fsm: FSM, live: set) -> dict:
    by_target: dict[tuple, list[int]] = {}
    for state in live:
        for symbol, target in fsm.map.get(state, {}).items():
            if target in live:
                by_target.setdefault((state, target), []).append(symbol)
    return {key: _symbol_class(fsm.alphabet, symbols) for key, symbols in by_target.items()}


def _symbol_class(alphabet, symbols: list[int]) -> str:
    chosen = set(symbols)
    chars = [c for s in chosen for c in alphabet.by_transition[s] if c is not anything_else]
    if any(anything_else in alphabet.by_transition[s] for s in chosen):
        others = [
            c for s, cs in alphabet.by_transition.items() if s not in chosen for c in cs
            if c is not anything_else
        ]  # fmt: skip
        return "[^" + _class_body(others) + "]" if others else "[\\s\\S]"
    if len(chars) == 1:
        return literal_char(chars[0])
    return "[" + _class_body(chars) + "]"


def _class_body(chars: list[str]) -> str:
    """Characters as a class body, runs of three or more as ranges."""
    codes, out, i = sorted(ord(c) for c in chars), [], 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{_class_char(chr(codes[i]))}-{_class_char(chr(codes[j]))}")
        else:
            out.extend(_class_char(chr(c)) for c in codes[i : j + 1])
        i = j + 1
    return "".join(out)


def _class_char(char: str) -> str:
    if char in _CLASS_SPECIAL:
        return "\\" + char
    return _control_escape(char) or char


def literal_char(char: str) -> str:
    if char in "\\.^$|?*+()[]{}":
        return "\\" + char
    return _control_escape(char) or char


def _control_escape(char: str) -> str | None:
    code = ord(char)
    if code < 0x20 or 0x7F <= code <= 0x9F or char in " #":
        return f"\\x{code:02X}" if code < 0x100 else None
    return None


def _elimination_order(states: set, edges: dict) -> list:
    degree = {s: 0 for s in states}
    for a, b in edges:
        for s in (a, b):
            if s in degree:
                degree[s] += 1
    return sorted(states, key=lambda s: degree[s])


def _eliminate(state, edges: dict) -> None:
    loop = edges.pop((state, state), None)
    middle = f"(?:{loop})*" if loop is not None else ""
    incoming = [(a, r) for (a, b), r in edges.items() if b == state]
    outgoing = [(b, r) for (a, b), r in edges.items() if a == state]
    for a, _ in incoming:
        del edges[(a, state)]
    for b, _ in outgoing:
        del edges[(state, b)]
    for a, left in incoming:
        for b, right in outgoing:
            path = _group(left) + middle + _group(right)
            old = edges.get((a, b))
            edges[(a, b)] = path if old is None or old == path else f"(?:{old}|{path})"


def _group(regex: str) -> str:
    depth, i = 0, 0
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            i = _skip_class(regex, i)
            continue
        depth += char == "("
        depth -= char == ")"
        if char == "|" and depth == 0:
            return f"(?:{regex})"
        i += 1
    return regex


def _skip_class(regex: str, start: int) -> int:
    i = start + 1
    i += regex.startswith("^", i)
    i += regex.startswith("]", i)
    while i < len(regex) and regex[i] != "]":
        i += 2 if regex[i] == "\\" else 1
    return i + 1


def words_except_regex(units: str, escapes: str, words: list[list[str]]) -> str:
    """Regex for sequences of units (one plain character of class `units`, e.g. `[^"\\\\]`,
    or an escape from `escapes`, e.g. `\\\\["\\\\bfnrt]`) that are none of `words`, each
    given as its list of units. Built on the words' trie: linear in their total length."""
    trie: dict = {}
    for word in words:
        node = trie
        for unit in word:
            node = node.setdefault(unit, {})
        node[None] = {}
    return _trie_complement(trie, units, escapes)


def _trie_complement(node: dict, units: str, escapes: str) -> str:
    any_unit = f"(?:{units}|{escapes})"
    children = {unit: child for unit, child in node.items() if unit is not None}
    plain = [u for u in children if not u.startswith("\\")]
    escaped = [u[1] for u in children if u.startswith("\\")]
    options = [] if None in node else [""]
    other_plain = _class_minus(units, plain)
    other_escape = _class_minus(escapes[2:], escaped)  # escapes = `\\` + a class
    others = [r for r in (other_plain, other_escape and "\\\\" + other_escape) if r]
    if others:
        options.append(f"(?:{'|'.join(others)}){any_unit}*")
    for unit, child in children.items():
        options.append(literal_text(unit) + _trie_complement(child, units, escapes))  # a group
    return "(?:" + "|".join(options) + ")"


def _class_minus(char_class: str, chars: list[str]) -> str:
    """`char_class` (a bracket class) without `chars`; '' when nothing would remain."""
    if not chars:
        return char_class
    removed = "".join(_class_char(c) for c in chars)
    if char_class.startswith("[^"):
        return char_class[:-1] + removed + "]"
    kept = [c for c in _class_members(char_class) if c not in chars]
    return "[" + "".join(_class_char(c) for c in kept) + "]" if kept else ""


def _class_members(char_class: str) -> list[str]:
    body, out, i = char_class[1:-1], [], 0
    while i < len(body):
        if body[i] == "\\":
            out.append(body[i + 1])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return out


def literal_text(text: str) -> str:
    return "".join(literal_char(c) for c in text)
