"""Every command's --help: flags shown as flags, every option explained, one name per concept."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from mbolt.cli import COMMANDS, app

NAMES = [name for name, _, _ in COMMANDS]


def _params(name):
    cmd = typer.main.get_command(app).commands[name]
    # typer vendors its own click: check the kind, not the class
    opts = [p for p in cmd.params if p.param_type_name == "option"]
    assert opts, name  # every command has options: an empty list would make these tests vacuous
    return opts


@pytest.mark.parametrize("name", NAMES)
def test_help_shows_flags_as_flags_and_explains_every_option(name):
    r = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.output  # typer 0.29 renders `--json <bool>`: pinned below it
    for p in _params(name):
        assert p.help, f"{name} {p.opts}: no help text"
        if p.is_flag:
            assert not re.search(rf"{re.escape(p.opts[0])}\s+(BOOLEAN|<bool>)", r.output)


def test_one_option_name_per_concept():
    # the old spellings of these concepts are gone from every command
    retired = {"--max-new-tokens", "--n-tokens", "--tokens-new", "--limit", "--budgets", "--cache", "--train-share",
               "--io-threads", "--file"}
    for name in NAMES:
        opts = {o for p in _params(name) for o in p.opts + p.secondary_opts}
        assert not opts & retired, (name, opts & retired)
        if "--new-tokens" in opts:
            assert "-n" in opts, name


def test_json_is_a_flag_everywhere():
    for name in NAMES:
        for p in _params(name):
            if "--json" in p.opts:
                assert p.is_flag, name


def test_the_demo_suggests_only_options_that_exist():
    import shlex

    from mbolt.report.tables import demo_next_steps

    text = demo_next_steps({"workdir": "wd"}).plain
    cmds = [shlex.split(line.split("(")[0])[1:] for line in text.splitlines() if line.strip().startswith("mbolt ")]
    assert len(cmds) >= 7
    for args in cmds:
        known = {o for p in _params(args[0]) for o in p.opts + p.secondary_opts}
        used = {a for a in args if a.startswith("-")}
        assert used <= known, (args[0], used - known)
