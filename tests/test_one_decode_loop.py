"""One decode loop (issue 56): in mbolt/ and scripts/, llama.cpp's llama_decode is called by the
runner alone (runtime/runner.py, `LlamaRunner._decode`), and only the driver (runtime/driver.py)
drives the runner over tokens (`eval`, `decode_step`, `mixed_pass`); every command, benchmark and
probe decodes through the driver. Read from the code's syntax trees, so comments and strings that
name the calls do not count.

Two calls of llama_decode stand outside the runner, each for a reason the test states:
- runtime/kernel_load.py: one llama_decode of one token on a throwaway context, the first graph
  that shows where llama.cpp put each weight (not a loop over tokens);
- bench/ik_worker.py: the ik_llama.cpp peer's worker, run by the peer's own Python environment with
  its own library (no mbolt there: it cannot run mbolt's driver, by design)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER, DRIVER = "mbolt/runtime/runner.py", "mbolt/runtime/driver.py"
FIRST_GRAPH, PEER = "mbolt/runtime/kernel_load.py", "mbolt/bench/ik_worker.py"
RUNNER_STEPS = ("eval", "decode_step", "mixed_pass")  # the runner's methods that run llama_decode
LOOPS = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def calls(source: str, name: str, attrs: tuple[str, ...]) -> list[tuple[str, bool]]:
    """(`file:line`, inside a loop) of every call of a function or method named one of `attrs`."""
    found = []

    def walk(node, in_loop: bool) -> None:
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if called in attrs:
                found.append((f"{name}:{node.lineno}", in_loop))
        for child in ast.iter_child_nodes(node):
            walk(child, in_loop or isinstance(node, LOOPS))

    walk(ast.parse(source, name), False)
    return found


def tree_sources(root: Path) -> dict[str, str]:
    """Every module of mbolt/ and scripts/ under `root`, by its path relative to it."""
    return {str(p.relative_to(root)): p.read_text() for d in ("mbolt", "scripts")
            for p in sorted((root / d).rglob("*.py"))}


def offenders(root: Path) -> list[str]:
    """What breaks the rule in the tree at `root`: llama_decode called outside the runner (the two
    stated exceptions aside, the first-graph call only once and outside a loop), or the runner's
    steps called outside the driver."""
    bad = []
    for name, src in tree_sources(root).items():
        decodes = calls(src, name, ("llama_decode",))
        if name == RUNNER:
            bad += [f"{where}: a second llama_decode in the runner" for where, _ in decodes[1:]]
        elif name == FIRST_GRAPH:
            bad += [f"{where}: llama_decode in a loop" for where, looped in decodes if looped]
            bad += [f"{where}: a second llama_decode" for where, _ in decodes[1:]]
        elif name != PEER:
            bad += [f"{where}: llama_decode outside the runner" for where, _ in decodes]
        if name not in (RUNNER, DRIVER):
            bad += [f"{where}: the runner driven outside the driver" for where, _ in calls(src, name, RUNNER_STEPS)]
    return bad


def test_the_finder_sees_calls_and_loops():
    src = ("def f(L, ctx, r, ids):\n"
           "    L.llama_decode(ctx, b)\n"
           "    for t in ids:\n"
           "        r.eval([t])\n"
           "    return [r.decode_step([(0, t)]) for t in ids]\n")
    assert calls(src, "m.py", ("llama_decode",)) == [("m.py:2", False)]
    assert calls(src, "m.py", RUNNER_STEPS) == [("m.py:4", True), ("m.py:5", True)]
    assert calls("x = eval\n# r.eval([t]) in a comment\ns = 'llama_decode(ctx)'\n", "m.py",
                 ("llama_decode", *RUNNER_STEPS)) == []


def test_the_stated_exceptions_are_what_they_say():
    src = tree_sources(ROOT)
    assert len(calls(src[RUNNER], RUNNER, ("llama_decode",))) == 1
    assert [looped for _, looped in calls(src[FIRST_GRAPH], FIRST_GRAPH, ("llama_decode",))] == [False]
    peer = src[PEER]
    assert "import mbolt" not in peer and "from mbolt" not in peer  # standalone: the peer's environment
    assert calls(peer, PEER, ("llama_decode",))
    # the driver does drive the runner over tokens (what every other module goes through)
    assert {where for where, looped in calls(src[DRIVER], DRIVER, RUNNER_STEPS)}


def test_only_the_runner_calls_llama_decode_and_only_the_driver_drives_it():
    assert offenders(ROOT) == []
