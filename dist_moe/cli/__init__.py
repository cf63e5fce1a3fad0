"""The ``dist-moe`` command; one module per subcommand (train, report, place, simulate, plan, calibrate),
each with ``add_parser(sub, debug)`` and ``run(args)`` (``train.run`` also takes the key=value overrides
argparse leaves over)."""
from __future__ import annotations

import argparse

from dist_moe.cli import calibrate, place, plan, report, simulate, train
from dist_moe.errors import report as report_error

COMMANDS = {"report": report, "place": place, "simulate": simulate, "plan": plan, "calibrate": calibrate}


class _Parser(argparse.ArgumentParser):
    """A bad argument ends as dist-moe's one line and exit 2, not argparse's usage block (printed by every
    rank under a launcher); subcommand parsers are made of this class too."""

    def error(self, message):
        raise ValueError(f"{message} (see {self.prog} --help)")


def build_parser() -> _Parser:
    """The ``dist-moe`` parser with every subcommand (tests/cli/test_cli_help.py walks it)."""
    parser = _Parser(prog="dist-moe", description="distributed Mixture-of-Experts training")
    # the deepspeed launcher inserts --local_rank=N before the command; the rank comes from the environment
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_parser(sub, debug)
    for command in COMMANDS.values():
        command.add_parser(sub, debug)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = None
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command == "train":
            return train.run(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return COMMANDS[args.command].run(args)
    except (Exception, KeyboardInterrupt) as e:  # every failure ends as one line and an exit code (errors.py)
        return report_error(e, getattr(args, "debug", False))
