"""``StepHost`` (``core/step_host.py``): the members a ``Step`` reads of its runner are exactly
the protocol's, and the runner has every one of them."""

from __future__ import annotations

import ast
from pathlib import Path

from engine_util import make_core

import rltserve.core
from rltserve.core.step_host import StepHost

# The modules a Step runs in; each names its runner ``r``, ``runner`` or ``<object>.r``.
STEP_MODULES = sorted(
    p for p in Path(rltserve.core.__file__).parent.glob("step*.py") if p.name != "step_host.py"
)


def protocol_methods() -> set[str]:
    return {n for n, v in vars(StepHost).items() if callable(v) and not n.startswith("_")}


def protocol_members() -> set[str]:
    return set(StepHost.__annotations__) | protocol_methods()


def runner_reads(path: Path) -> set[str]:
    reads = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("r", "runner")) or (
                isinstance(owner, ast.Attribute) and owner.attr == "r"
            ):
                reads.add(node.attr)
    return reads


def test_steps_read_exactly_the_protocols_members():
    assert len(STEP_MODULES) > 3
    reads = set().union(*map(runner_reads, STEP_MODULES))
    assert reads == protocol_members()


def test_the_runner_has_every_member(huginn_rv1):
    core = make_core(huginn_rv1)
    try:
        runner = core.runner
        assert {m for m in protocol_members() if not hasattr(runner, m)} == set()
        assert protocol_methods() == {"deliver", "attention", "timed", "tensor", "scalar"}
        assert all(callable(getattr(runner, m)) for m in protocol_methods())
    finally:
        core.shutdown()
