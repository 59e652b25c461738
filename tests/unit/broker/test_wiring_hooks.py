"""The broker's collaborators are passed at construction (issue #21): no module sets a hook
on an object after it was built, and listeners join the job service's events in the wiring
(broker/services.py) alone. A static scan of broker/, so a new ``x.on_done = ...`` fails
here instead of waiting for a review."""
from __future__ import annotations

import ast
from pathlib import Path

import broker

BROKER = Path(broker.__file__).parent

# What was assigned after construction before (JobService, Dispatcher, VerificationService,
# CanaryService, ProviderService, DisputeService): each may only be set by its own
# __init__, on ``self``.
HOOKS = {"on_queued", "on_released", "cancel_hook", "checkpoints", "on_receipt",
         "second_opinion", "on_settled", "on_ended", "eligible", "on_quota", "on_answer",
         "on_connected", "on_resolved"}
JOINS = {"join_placement", "join_receipts", "join_ends"}


def _modules():
    for path in sorted(BROKER.rglob("*.py")):
        yield path.relative_to(BROKER.parent).as_posix(), ast.parse(path.read_text(), str(path))


def _stored_attributes(tree: ast.AST):
    """(attribute node, the function it is assigned in or None) for every ``x.name = ...``."""
    def visit(node: ast.AST, function: ast.AST | None):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else function
            if isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store):
                yield child, function
            yield from visit(child, inner)
    yield from visit(tree, None)


def _hook_assignments():
    found = []
    for name, tree in _modules():
        for attr, function in _stored_attributes(tree):
            hook = attr.attr in HOOKS or attr.attr.startswith("on_")
            on_self = isinstance(attr.value, ast.Name) and attr.value.id == "self"
            in_init = function is not None and function.name == "__init__"
            if hook and not (on_self and in_init):
                found.append(f"{name}:{attr.lineno}: {ast.unparse(attr)} = ...")
    return found


def test_no_broker_module_sets_a_hook_after_construction():
    assert _hook_assignments() == []


def test_the_scan_finds_a_hook_set_from_outside():
    """The scan itself: an assignment of the kind it looks for is found."""
    tree = ast.parse("def wire(jobs, d):\n    jobs.on_settled = d.settled\n"
                     "class A:\n    def later(self):\n        self.on_ended = None\n")
    stored = [(a.attr, f.name if f else None) for a, f in _stored_attributes(tree)]
    assert stored == [("on_settled", "wire"), ("on_ended", "later")]


def test_listeners_join_the_job_events_in_the_wiring_only():
    joined = {}
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in JOINS:
                joined.setdefault(name, set()).add(node.func.attr)
    assert joined == {"broker/services.py": JOINS}
