"""The runtime behind its driver (issue 56): nothing above mbolt/runtime reaches the driver's
llama.cpp runner (`driver.runner`); what the server, the commands and the tracer need of the
context is a method or property of `Driver` that says what it is for.

mbolt/bench is checked too (`ab` reads `native_filter` of the driver). The driver forwards nothing
implicitly either: what it gives of its arm is a property or method of its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mbolt"
BELOW = {"runtime"}


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
             if p.relative_to(PACKAGE).parts[0] not in BELOW]
    assert {"serve", "trace", "bench", "rewrite"} <= {p.parts[-2] for p in files}
    found = [u for p in files for u in runner_uses(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert found == [], f"reached around the driver: {', '.join(found)}"


def test_the_driver_passes_no_attribute_on_to_its_arm():
    """What the driver gives of its arm is named on `Driver`, one by one: no __getattr__ forwarding
    the rest (an arm's internals, such as its store or its plan, are asked of `driver.arm`)."""
    from types import SimpleNamespace

    import pytest

    from mbolt.runtime.driver import Driver

    assert not any("__getattr__" in vars(k) for k in Driver.__mro__ if k is not object)
    d = Driver.__new__(Driver)  # no llama.cpp: the properties read the arm alone
    d.arm = SimpleNamespace(mm="the map", n_ubatch=512, cache_slots=8, store="the store", plan="the plan")
    assert (d.mm, d.n_ubatch, d.cache_slots) == ("the map", 512, 8)
    for name in ("store", "plan", "step_routing"):
        with pytest.raises(AttributeError):
            getattr(d, name)
