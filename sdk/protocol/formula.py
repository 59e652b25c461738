"""The one expression language of manifests, over a plugin's inputs: work-unit formulas
(arithmetic, a number) and input rules (a condition). Expressions are parsed with
``ast``, checked node by node (only the operators and functions below, only names that
are inputs) and evaluated without builtins, so a manifest is data, never code.

Functions: ``min max abs`` everywhere; in rules also ``floor ceil`` (integers),
``given(x)`` (the input was sent: not absent, not ""), ``clip_tokens(text)`` (at least how
many tokens a CLIP text encoder reads: sdk.protocol.tokens) and ``adapter_count(text)`` (how many
LoRA adapters the ``adapters`` input names; a malformed one fails the rule with what is
wrong: sdk.protocol.adapters).
"""
from __future__ import annotations

import ast
import functools
import math
from typing import Any, Mapping

from .adapters import check_adapters
from .tokens import clip_tokens

_ARITHMETIC = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load,
               ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub,
               ast.UAdd, ast.Call)
_CONDITIONS = _ARITHMETIC + (ast.Compare, ast.BoolOp, ast.And, ast.Or, ast.Not, ast.Lt,
                             ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)
_FUNCS = {"min": min, "max": max, "abs": abs}


def _given(value: Any) -> bool:
    return value is not None and value != ""


def _adapter_count(text: Any) -> int:
    return len(check_adapters(text if isinstance(text, str) else None))


RULE_FUNCS = {**_FUNCS, "floor": math.floor, "ceil": math.ceil, "given": _given,
              "clip_tokens": clip_tokens, "adapter_count": _adapter_count}


def compile_formula(expr: str, names: set[str], *, condition: bool = False):
    """``expr`` compiled for :func:`evaluate`; raises ValueError naming what is not
    allowed. ``condition``: a rule (comparisons, and/or/not and the rule functions)."""
    funcs = RULE_FUNCS if condition else _FUNCS
    allowed = _CONDITIONS if condition else _ARITHMETIC
    if not isinstance(expr, str) or len(expr) > 500:
        raise ValueError("must be an expression of at most 500 characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    ops = "comparisons, and, or, not, " if condition else ""
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ValueError(f"{type(node).__name__} is not allowed; use + - * /, {ops}numbers "
                             f"and {', '.join(sorted(funcs))}()")
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in funcs) or node.keywords:
                raise ValueError(f"only {', '.join(f + '()' for f in sorted(funcs))} may be "
                                 "called")
        elif isinstance(node, ast.Name) and node.id not in names and node.id not in funcs:
            raise ValueError(f"{node.id!r} is not an input; inputs: {sorted(names)}")
        elif isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):
            raise ValueError(f"constant {node.value!r} is not a number")
    return compile(tree, "<manifest expression>", "eval")


def names_outside_given(expr: str) -> set[str]:
    """The input names ``expr`` uses other than as ``given(name)``'s argument: a rule
    applies only when all of them were sent (or have a default)."""
    tree = ast.parse(expr, mode="eval")
    inside = {id(arg) for node in ast.walk(tree)
              if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "given"
              for arg in node.args}
    return {node.id for node in ast.walk(tree)
            if isinstance(node, ast.Name) and id(node) not in inside and node.id not in RULE_FUNCS}


def evaluate(code, values: Mapping[str, Any], *, condition: bool = False) -> Any:
    funcs = RULE_FUNCS if condition else _FUNCS
    return eval(code, {"__builtins__": {}}, {**funcs, **values})  # noqa: S307 - AST-checked


@functools.lru_cache(maxsize=256)
def _compiled(expr: str, names: frozenset[str]):
    """:func:`compile_formula`, once per formula and set of input names (every job
    evaluates its plugin's formula; parsing and checking it each time is wasted work)."""
    return compile_formula(expr, set(names))


def evaluate_formula(expr: str, inputs: Mapping[str, Any]) -> float:
    """A work-unit formula's value on validated inputs."""
    return float(evaluate(_compiled(expr, frozenset(inputs)), inputs))
