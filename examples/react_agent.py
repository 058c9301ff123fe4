"""A ReAct-style agent: the model thinks, picks an action with select, and the program
calls a Python tool (a calculator) and feeds the observation back.

    python examples/react_agent.py [--address tcp://127.0.0.1:30001]
"""

from __future__ import annotations

import ast
import operator

from _runtime import use_runtime

import spruce.lang as sl

PROMPT = """Answer the question. Always use the calculator before you finish.
Each step is a Thought, then an Action: calculator[expression] or finish[answer].

Question: What is 12 times 7?
Thought: I need to multiply 12 by 7.
Action: calculator[12 * 7]
Observation: 84
Thought: The calculator says 84.
Action: finish[84]

Question: What is 150 minus 62?
Thought: I need to subtract 62 from 150.
Action: calculator[150 - 62]
Observation: 88
Thought: The calculator says 88.
Action: finish[88]

"""
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg}  # fmt: skip


def calculator(expression: str) -> str:
    """The tool: arithmetic on numbers only (no eval of arbitrary code)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only + - * / on numbers")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else round(result, 6))


@sl.function
def react(s, question, max_steps=3):
    s += PROMPT + f"Question: {question}\n"
    for _ in range(max_steps):
        s += "Thought:" + sl.gen("thought", max_tokens=32, stop="\n") + "\n"
        s += "Action: " + sl.select("action", choices=["calculator", "finish"]) + "["
        if s["action"] == "finish":
            s += sl.gen("answer", max_tokens=16, stop=["]", "\n"]) + "]\n"
            return s["answer"]
        s += sl.gen("expression", max_tokens=24, stop=["]", "\n"]) + "]\n"
        s += f"Observation: {calculator(s['expression'])}\n"
    return None


def main() -> None:
    use_runtime(__doc__.splitlines()[0])
    state = react.run(question="What is 347 times 29?", temperature=0)
    if not state.ok:
        raise SystemExit(f"error: {state.error()}")
    print(state.text()[len(PROMPT) :])
    print("final answer:", state.ret_value)


if __name__ == "__main__":
    main()
