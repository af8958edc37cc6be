"""
C{llmgw certs}: the fleet CA and the certificates of the server and agents,
for the mutually authenticated agent link (L{llmgw.wire.tls}).  The
command line only; L{llmgw.wire.certs} makes the certificates.  The commands
and the files they write::

    llmgw certs init   --dir D                      D/ca.pem, D/ca-key.pem
    llmgw certs server --dir D --host NAME[,NAME]   D/server.pem, D/server-key.pem
    llmgw certs agent  --dir D --node-id ID         D/agents/ID/{ca,agent,agent-key}.pem

Keys are ECDSA P-256, written PEM with mode 0600; certificates PEM.
"""

from __future__ import annotations

import argparse
import sys

from llmgw.wire.certs import CertsError, init_ca, issue_agent, issue_server


def main(argv: list[str]) -> int:
    """
    C{llmgw certs init|server|agent ...}.

    @return: the exit status: 0, 1 on a failure (one line on stderr), 2 on
        bad arguments.
    """
    parser = argparse.ArgumentParser(
        prog="llmgw certs",
        description="The fleet CA and the certificates of the agent link.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="make the fleet CA")
    init.add_argument("--dir", required=True, help="folder for ca.pem, ca-key.pem")
    init.add_argument("--days", type=int, default=3650)
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    server = commands.add_parser("server", help="make the server's certificate")
    server.add_argument("--dir", required=True, help="the CA's folder")
    server.add_argument(
        "--host", required=True, help="NAME[,NAME...]: DNS names or IP addresses"
    )
    server.add_argument("--days", type=int, default=825)
    agent = commands.add_parser("agent", help="make a node's certificate")
    agent.add_argument("--dir", required=True, help="the CA's folder")
    agent.add_argument("--node-id", required=True, help="the node id, its CN")
    agent.add_argument("--days", type=int, default=825)
    args = parser.parse_args(argv)
    if not 1 <= args.days <= 36500:
        sys.stderr.write(f"llmgw certs: --days: bad value {args.days}: 1 to 36500\n")
        return 2
    try:
        if args.command == "init":
            where = init_ca(args.dir, args.days, args.force)
        elif args.command == "server":
            where = issue_server(args.dir, args.host.split(","), args.days)
        else:
            where = issue_agent(args.dir, args.node_id, args.days)
    except (CertsError, OSError, ValueError) as e:
        # ValueError: cryptography refusing a file or a value.
        sys.stderr.write(f"llmgw certs: {e}\n")
        return 1
    sys.stdout.write(f"wrote {where}\n")
    return 0
