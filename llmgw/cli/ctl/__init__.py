"""
C{llmgw ctl}: the admin API from the command line (docs/keys.md).
Tables by default, C{--json} for scripts; a failure is one line on stderr
and a non-zero exit status.  Usage::

    llmgw ctl [--admin-url URL] [--admin-key KEY] [--json] COMMAND ...

L{parser} reads the command line, L{COMMANDS} maps the command's name to
its function (L{llmgw.cli.ctl.commands}), L{Client} calls the API.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO

from llmgw.cli.ctl.client import Client, CtlError
from llmgw.cli.ctl.commands import COMMANDS, command_name
from llmgw.cli.ctl.parser import DEFAULT_ADMIN_URL, parser
from llmgw.cli.ctl.show import table

__all__ = ["DEFAULT_ADMIN_URL", "CtlError", "main", "parser", "run", "table"]


def run(args: argparse.Namespace, out: IO[str]) -> None:
    """
    Run the command C{args} name and write its answer to C{out}: the API's
    JSON with C{--json}, else its text.

    @raise CtlError: the command failed.
    """
    client = Client(args.admin_url, args.admin_key)
    result, text = COMMANDS[command_name(args)](client, args, out)
    out.write(json.dumps(result, indent=2) + "\n" if args.json else text)


def main(argv: list[str]) -> int:
    """
    @param argv: the arguments after C{llmgw ctl}.
    @return: the exit status: 0, or 1 after one line on stderr.
    """
    args = parser().parse_args(argv)
    try:
        run(args, sys.stdout)
    except CtlError as e:
        sys.stdout.flush()
        sys.stderr.write(f"llmgw ctl: {e}\n")
        return 1
    return 0
