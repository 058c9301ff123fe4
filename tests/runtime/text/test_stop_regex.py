"""stop_regex and no_stop_trim without a model: a character tokenizer (token id = code point)
drives the StopChecker (scheduler side) and OutputText (the text a caller sees)."""

from __future__ import annotations

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.request import FinishReason, Req
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.update import Reporter
from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.text.detokenizer import OutputText, RequestOutput
from spruce.runtime.text.stop import STOP_REGEX_TAIL_TOKENS, StopChecker


class CharTokenizer:
    eos_token_ids = frozenset({2})

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def run(text: str, **sampling) -> tuple[Req, FinishReason | None]:
    """Appends text one character per step until the checker stops the request."""
    req = Req("r", [ord("p")], SamplingParams(max_new_tokens=10_000, **sampling))
    checker = StopChecker(CharTokenizer(), frozenset({2}))
    for c in text:
        req.output_ids.append(ord(c))
        reason = checker.check(req, 1)
        if reason is not None:
            req.finish(reason)
            return req, reason
    return req, None


def visible(req: Req) -> str:
    out = OutputText(CharTokenizer(), req.sampling, req.prompt_ids)
    out.apply(0, req.output_ids, req.finish_reason)
    return out.text


def test_stops_at_the_step_the_first_match_completes():
    req, reason = run("abc 12 and 345", stop_regex=(r"\d+",))
    assert reason == FinishReason("stop", r"\d+")
    assert req.output_ids[-1] == ord("1")  # stopped on the first digit
    assert visible(req) == "abc "


def test_no_stop_trim_keeps_the_match():
    req, _ = run("abc 12 and 345", stop_regex=(r"\d\d",), no_stop_trim=True)
    assert visible(req) == "abc 12"


def test_earliest_of_stop_strings_and_regexes_is_trimmed():
    req, reason = run("xx END yy 7", stop=("yy",), stop_regex=(r"E.D",))
    assert reason.matched == r"E.D"
    assert visible(req) == "xx "


def test_a_regex_spanning_tokens_and_anchors_in_a_long_output():
    long = "a" * (STOP_REGEX_TAIL_TOKENS + 50)
    req, reason = run(long + "\nDONE", stop_regex=(r"^DONE",))
    assert reason is None  # ^ is the start of the output, not of the checked tail
    req, reason = run(long + "\nDONE", stop_regex=(r"(?m)^DONE",))
    assert reason is not None and visible(req) == long + "\n"


def test_streamed_text_is_trimmed_at_the_end():
    req = Req("r", [ord("p")], SamplingParams(stop_regex=(r"[0-9]+!",)))
    out = OutputText(CharTokenizer(), req.sampling, req.prompt_ids)
    sent = ""
    for c in "ok 12":
        sent += out.apply(0, [ord(c)], None)
    # the token that completes the match comes with the finish
    sent += out.apply(0, [ord("!")], FinishReason("stop", r"[0-9]+!"))
    assert sent == "ok 12"  # a match's start is not held back while streaming ...
    assert out.text == "ok "  # ... the final text is trimmed


def test_no_stop_trim_keeps_the_stop_token_text():
    req = Req("r", [ord("p")], SamplingParams(no_stop_trim=True))
    req.output_ids += [ord("h"), ord("i"), ord("!")]
    req.finish(FinishReason("stop", ord("!")))  # "!" as a stop token id
    assert visible(req) == "hi!"
    req.sampling = SamplingParams()
    assert visible(req) == "hi"


def meta_info(sampling: SamplingParams) -> dict:
    """The meta_info a caller gets for a finished request, built from its update."""
    valid = ValidRequest([1], sampling, RequestOptions(), None)
    req = Req("r", [1], sampling)
    req.finish(FinishReason("length"))
    output = RequestOutput(CharTokenizer(), valid, "r")
    output.apply(Reporter(req).update())
    return output.meta_info()


def test_custom_params_are_noted_in_meta_info():
    assert "custom_params" in meta_info(SamplingParams(custom_params={"token_id": 5}))["ignored"]
    assert "ignored" not in meta_info(SamplingParams())


def test_a_rollback_restarts_the_text_from_the_kept_ids():
    """Jump-forward re-tokenized the last two ids: the update drops them and the text is
    made again from what is left plus the new ids."""
    out = OutputText(CharTokenizer(), SamplingParams(), [ord("p")])
    assert out.apply(0, [ord(c) for c in "abcd"], None) == "abcd"
    assert out.apply(2, [ord(c) for c in "cdef"], None) == "ef"
    assert out.ids == [ord(c) for c in "abcdef"] and out.text == "abcdef"
