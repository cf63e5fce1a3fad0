"""Every argument of every `dist-moe` subcommand says what it is, and an optional one its default."""
import argparse

import pytest

from dist_moe.cli import build_parser

FLAGS = (argparse._StoreTrueAction, argparse._HelpAction)


def _subcommands():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_subcommand_is_walked():
    assert set(_subcommands()) == {"train", "report", "place", "simulate", "plan", "calibrate"}


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_argument_has_help_naming_its_default(command):
    parser = _subcommands()[command]
    missing, no_default = [], []
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        if not text.strip() or action.help is argparse.SUPPRESS:
            missing.append(name)
        # an optional value (not a flag, not required) says what happens when it is left out
        elif action.option_strings and not isinstance(action, FLAGS) and not action.required \
                and "default" not in text:
            no_default.append(name)
    assert not missing, f"dist-moe {command}: no help for {missing}"
    assert not no_default, f"dist-moe {command}: help does not name the default of {no_default}"
