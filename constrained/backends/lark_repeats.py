"""Counted repeats in a Lark grammar, checked before it is compiled: llguidance builds a
lexeme's repeats out as it lexes, so `/a{1000}{1000}/` (a million positions) passes its
syntax check, then fills the lexer past its limit on the first token it takes, after
hundreds of megabytes and a second per mask. A repeat's count is multiplied by the counts
of the repeats around it, in the regex, the rule and the rules that refer to it
(`B: A{300}` with `A: /a{1000}/` is 300,000); past MAX_REPEAT_PRODUCT the grammar is refused.

    check_repeats(lark_text, "lark")    # ConstraintError naming the rule
"""

from __future__ import annotations

import re

from spruce.constrained.core.errors import ConstraintError

# Measured with llguidance 1.9 on a small vocabulary (shared machine): a lexeme of n
# repeated positions costs about 0.6 us x n a mask (a{100}{100}: 4 ms, a{300}{300}: 54 ms,
# a{500}{500}: 320 ms), and past ~250,000 the lexer refuses its first token. At this cap
# a mask stays within the ~20 ms a step gives masks.
MAX_REPEAT_PRODUCT = 32768

_RULE = re.compile(r"^\??([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?(?:\[[^\]\n]*\])?\s*:", re.MULTILINE)
_LARK_TOKEN = re.compile(
    r"(?P<skip>//[^\n]*|%\w+[^\n]*|<\[[0-9,\-\s]*\]>|\"(?:\\.|[^\"\\])*\"i?)"
    r"|(?P<regex>/(?:\\.|\[(?:\\.|[^\]\\])*\]|[^/\\\n])+/[a-z]*)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<open>[(\[])|(?P<close>[)\]])"
    r"|(?P<repeat>\{\s*(?P<low>\d*)\s*(?:,\s*(?P<high>\d*)\s*)?\}|~\s*(?P<tlow>\d+)(?:\s*\.\.\s*(?P<thigh>\d+))?)"
    r"|(?P<other>.)",
    re.DOTALL,
)
_REGEX_TOKEN = re.compile(
    r"(?P<skip>\\.|\[\^?\]?(?:\\.|[^\]\\])*\])"
    r"|(?P<open>\((?:\?[:=!<a-zA-Z-]*>?)?)|(?P<close>\))"
    r"|(?P<repeat>\{(?P<low>\d*)(?:,(?P<high>\d*))?\})"
    r"|(?P<other>.)",
    re.DOTALL,
)


def check_repeats(lark: str, what: str) -> None:
    """ConstraintError naming `what` and the rule when a rule's counted repeats multiply
    past MAX_REPEAT_PRODUCT."""
    rules = _rules(lark)
    products: dict[str, int] = {}
    for name in rules:
        product = _rule_product(name, rules, products, set())
        if product > MAX_REPEAT_PRODUCT:
            raise ConstraintError(
                f"{what}: rule {name}'s counted repeats multiply to {product} positions (at "
                f"most {MAX_REPEAT_PRODUCT}, what llguidance's lexer can hold); lower the "
                "{m,n} counts or repeat in a rule that recurses instead"
            )


def _rules(lark: str) -> dict[str, str]:
    """Each rule's name -> its body (alternatives on the lines that follow included)."""
    heads = list(_RULE.finditer(lark))
    bodies: dict[str, str] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(lark)
        bodies[head.group(1)] = bodies.get(head.group(1), "") + " | " + lark[head.end() : end]
    return bodies


def _rule_product(name: str, rules: dict[str, str], done: dict[str, int], seen: set[str]) -> int:
    if name in done:
        return done[name]
    if name in seen or name not in rules:  # recursion repeats without a count; a token name
        return 1
    seen.add(name)
    product = _product(rules[name], _LARK_TOKEN, lambda ref: _rule_product(ref, rules, done, seen))
    seen.discard(name)
    done[name] = product
    return product


def _product(text: str, pattern: re.Pattern, reference=None) -> int:
    """The largest product of nested counted repeats in `text` (1 when none)."""
    frames, last = [1], 1  # per open group: the largest product inside it
    for token in pattern.finditer(text):
        kind = token.lastgroup
        if kind == "regex":
            last = _product(token.group()[1 : token.group().rindex("/")], _REGEX_TOKEN)
        elif kind == "name" and reference is not None:
            last = reference(token.group())
        elif kind == "open":
            frames.append(1)
            continue
        elif kind == "close" and len(frames) > 1:
            last = frames.pop()
        elif kind == "repeat":
            last *= _count(token)
        elif kind in ("skip", "other"):
            last = 1
        frames[-1] = max(frames[-1], last)
    return max(frames)


def _count(token: re.Match) -> int:
    """The most times a repeat runs its item (`{m,}`: m; `~ m..n`: n)."""
    groups = token.groupdict()
    high = groups.get("high") or groups.get("thigh")
    low = groups.get("low") or groups.get("tlow") or "1"
    return max(int(high) if high else int(low), 1)
