"""gpt-oss's tool calls (harmony, see `text.harmony`): a message in the commentary channel
with the function as its recipient, its body the arguments' JSON:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(`<|start|>assistant` is absent right after the prompt, which ends with it; the recipient
may come before the channel: `<|start|>assistant to=functions.f<|channel|>commentary json`.)
`<|call|>` ends the turn (a stop token: the runtime trims it), so a turn holds one call.
Analysis messages (reasoning) are skipped; the final channel's text, a commentary message
without a recipient (a preamble) and text outside any message are content.
"""

from __future__ import annotations

from typing import Any

from spruce.constrained.convert import Conversion
from spruce.constrained.core.patterns import escape_literal
from spruce.runtime.server.openai.tool_format_base import PartialCall, Scan, ToolCallFormat
from spruce.runtime.server.openai.tool_tags import ANY_OBJECT, structural
from spruce.runtime.text import harmony

FUNCTIONS = "functions."


def call_header(name: str) -> str:
    """The header the constraint writes (the form gpt-oss's own output takes)."""
    return (
        f"{harmony.CHANNEL}commentary to={FUNCTIONS}{name} {harmony.CONSTRAIN}json{harmony.MESSAGE}"
    )


class HarmonyToolFormat(ToolCallFormat):
    name = "gpt-oss"
    # gpt-oss's template: channels, the call's end marker and the tools' namespace
    markers = (harmony.CHANNEL, harmony.CALL, "namespace functions")
    instructions = (
        "To call a function, write <|start|>assistant<|channel|>commentary "
        "to=functions.<function-name> <|constrain|>json<|message|><args-json-object><|call|>"
    )
    special_tokens = True
    open_tag = f"{harmony.CHANNEL}commentary to={FUNCTIONS}"  # starts a call

    def scan(self, text: str, final: bool) -> Scan:
        scan, content = Scan(""), []
        for m in harmony.messages(text, inside=False, final=final):
            recipient = m.recipient
            if recipient is None:
                if m.channel != "analysis":
                    content.append(m.body)
            elif recipient.startswith(FUNCTIONS):
                name = recipient[len(FUNCTIONS) :]
                scan.calls.append(PartialCall(name, m.body.strip(), m.closed))
            else:  # a built-in tool (browser, python): no function of the request
                content.append(m.raw)
                scan.broken = final
        scan.content = "".join(content).strip() if final else "".join(content)
        return scan

    def constraint(
        self, calls: list[dict], single: bool, parallel: bool, conversion: Conversion
    ) -> dict[str, Any]:
        """One call (a harmony turn ends at its call) of one of `calls`."""
        options = [
            escape_literal(call_header(f["name"]))
            + f"(?:{conversion.schema_regex(f.get('parameters') or ANY_OBJECT)})"
            for f in calls
        ]
        return {"regex": "|".join(f"(?:{o})" for o in options)}

    def structural_tag(self, functions: list[dict], parallel: bool) -> dict[str, Any]:
        """Free text (other messages); a commentary message to a function starts a call
        (exact), which ends the turn."""
        tags = [
            {
                "type": "tag",
                "begin": call_header(f["name"]),
                "content": {
                    "type": "json_schema",
                    "json_schema": f.get("parameters") or ANY_OBJECT,
                },
                "end": "",
            }
            for f in functions
        ]
        return structural({"type": "triggered_tags", "triggers": [self.open_tag], "tags": tags,
                           "stop_after_first": True})  # fmt: skip
