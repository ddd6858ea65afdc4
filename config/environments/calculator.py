"""A calculator tool for builtin:arithmetic ("What is 12 + 34? Answer with the number only.", label "46"): a
multi-turn episode in which the model may compute before it answers. config/agent-calculator.yaml trains on it:
    .venv/bin/snakemake --profile cluster_profiles/local all --configfile config/agent-calculator.yaml

The protocol, as the system message (SYSTEM) tells the model:
    calc: 12 + 34          -> a user message "12 + 34 = 46"
    a tool call            -> a tool message "46": {"name": "calculator", "arguments": {"expression": "12 + 34"}}
    12 + 34 is 46.         -> the final answer (the reply's last integer): reward 1.0 if it is the label, else 0.0
    anything else          -> "Answer with a number, or use calc: <expression>." and another turn
Expressions are integers, + - * / and parentheses, parsed with `ast` and evaluated by hand (never eval); anything
else, or a division by zero, comes back as an error text. Division is exact: 7 / 2 = 7/2.
"""
import ast
import operator
import re
from fractions import Fraction

SYSTEM = ("You can use a calculator: write `calc: <expression>` (integers, + - * / and parentheses) and you get the "
          "result. When you know the answer, reply with the number only.")
FEEDBACK = "Answer with a number, or use calc: <expression>."
CALC = re.compile(r"calc:\s*`?([^\n`]*)", re.IGNORECASE)  # up to the end of the line or a backtick
NUMBER = re.compile(r"-?\d+")
MAX_CHARS = 64  # longer expressions are refused: no huge products
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        return BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    raise ValueError("only integers, + - * / and parentheses")


def calculate(expression) -> str:
    """The expression's value as text ("46", "7/2"), or "error: ..."."""
    expression = str(expression).strip()
    if len(expression) > MAX_CHARS:
        return f"error: longer than {MAX_CHARS} characters"
    try:
        return str(_value(ast.parse(expression, mode="eval").body))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"


class Environment:
    tools = [{"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: integers, + - * / and parentheses.",
        "parameters": {"type": "object", "required": ["expression"],
                       "properties": {"expression": {"type": "string", "description": "e.g. 12 + 34"}}}}}]

    def reset(self, prompt: str, label, seed: int):
        self.label = None if label is None else str(label).strip()
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]

    def step(self, reply):
        if reply.tool_calls:  # one tool message per call
            return [{"role": "tool", "content": self.tool(call)} for call in reply.tool_calls], 0.0, False
        call = CALC.search(reply.text)
        if call:
            expression = call.group(1).strip()
            result = calculate(expression)
            return result if result.startswith("error") else f"{expression} = {result}", 0.0, False
        numbers = NUMBER.findall(reply.text)  # the last: small models restate the problem before the answer
        if not numbers:
            return FEEDBACK, 0.0, False
        correct = numbers[-1] == self.label
        return [], float(correct), True, {"success": correct}

    def tool(self, call: dict) -> str:
        arguments = call.get("arguments")
        if call.get("name") != "calculator" or not isinstance(arguments, dict) or "expression" not in arguments:
            return 'error: call calculator with {"expression": "..."}'
        return calculate(arguments["expression"])
