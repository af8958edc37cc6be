"""
The C{llmgw} console script: C{llmgw sim ...}, C{llmgw certs ...},
C{llmgw ctl ...}, C{llmgw store ...}.
"""

from __future__ import annotations

import sys

USAGE = """usage: llmgw COMMAND [ARGS...]

commands:
  sim     run an engine simulator (OpenAI API) for tests, benchmarks and rehearsals
  certs   make the fleet CA and the certificates of the server and agents
  ctl     run the fleet through the admin API: nodes, models, keys, usage, weights
  store   the store's schema: store migrate [--dry-run] applies pending migrations
"""


def main(argv: list[str] | None = None) -> int:
    """
    Dispatch to a subcommand.

    @param argv: arguments without the program name; C{sys.argv[1:]} if None.
    @return: the process exit status.
    """
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "sim":
        from llmgw.sim.cli import main as sim_main

        return sim_main(rest)
    if command == "ctl":
        from llmgw.cli.ctl import main as ctl_main

        return ctl_main(rest)
    if command == "certs":
        from llmgw.cli.certs import main as certs_main

        return certs_main(rest)
    if command == "store":
        from llmgw.cli.store import main as store_main

        return store_main(rest)
    sys.stderr.write(f"llmgw: unknown command {command!r}\n{USAGE}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
