"""The runtime behind its driver (issue 56): nothing above mbolt/runtime reaches the driver's
llama.cpp runner (`driver.runner`); what the server, the commands and the tracer need of the
context is a method or property of `Driver` that says what it is for.

mbolt/bench is not checked yet: bench/ab_llama.py still reads `stream.runner.native_filter`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mbolt"
BELOW_OR_EXEMPT = {"runtime", "bench"}


def runner_uses(source: str, name: str) -> list[str]:
    """`file:line` of every attribute access `.runner` in a module's source."""
    return [f"{name}:{node.lineno}" for node in ast.walk(ast.parse(source, name))
            if isinstance(node, ast.Attribute) and node.attr == "runner"]


def test_the_finder_sees_a_runner_reached():
    src = "def f(driver):\n    return driver.runner.tokenize('x')\n"
    assert runner_uses(src, "m.py") == ["m.py:2"]
    assert runner_uses("from mbolt.runtime.runner import Phase\nrunner = 1\n", "m.py") == []


def test_nothing_above_the_driver_reaches_its_runner():
    files = [p for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).parts[0] not in BELOW_OR_EXEMPT]
    assert any(p.parts[-2] == "serve" for p in files) and any(p.parts[-2] == "trace" for p in files)
    found = [u for p in files for u in runner_uses(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert found == [], f"reached around the driver: {', '.join(found)}"
