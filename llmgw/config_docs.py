"""
The configuration reference, C{docs/configuration.md}, printed from the
settings themselves: every table the server's file (L{SERVER_TABLES}) and
the agent's file (L{AGENT_TABLES}) take, each key with its kind, default
and meaning as its table declares it (L{llmgw.config_checks.Table})::

    python -m llmgw.config_docs            # write docs/configuration.md
    python -m llmgw.config_docs --check    # exit 1 when it is stale

(C{make config-docs} runs the first; C{tests/test_config_docs.py} fails
while the checked-in file differs from what this prints.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from llmgw.agent.settings import AGENT_TABLES
from llmgw.config import SERVER_TABLES
from llmgw.config_checks import REQUIRED, Key, Table

PATH = os.path.join("docs", "configuration.md")
"""
Where the reference is kept, from the project's root.
"""

_HEADER = """\
# Configuration reference

Every key of the two configuration files, with its type, default and
meaning.  Generated from the settings themselves (`make config-docs`, that
is `python -m llmgw.config_docs`): do not edit by hand;
`tests/test_config_docs.py` fails while this file differs from what the
code prints.

An unknown key, a missing one or a bad value stops the daemon with one
line naming the key and the value.  A key's type is the check its value
passes, declared once with the setting: its bounds (`duration >= 10ms`,
`integer, 0 to 64`) and allowed values are those the daemon enforces.
Types:

- duration: a number of seconds, or a string with a unit, `ms`, `s`, `m`,
  `h` or `d`: `"250ms"`, `"5s"`, `"2m"`.
- size: a number of bytes, or a string with a unit, `B`, `KB`, `KiB`,
  `MB`, `MiB`, `GB` or `GiB`: `"32MiB"`.
- Twisted server endpoint: a string such as `"tcp:8080"` or
  `"ssl:8443:privateKey=key.pem:certKey=cert.pem"`.

A default of "required" means the table must give the key; "none", that
the setting is off (or taken from elsewhere, as its meaning says) unless
the key is given.
"""


def render_default(key: Key) -> str:
    """
    @return: C{key}'s default as the reference shows it: a TOML value a
        file could give (C{"5s"}, C{"32MiB"}, C{true}, C{[20000, 20999]}),
        as its kind spells it, C{key.shown}, C{required} or C{none}.
    """
    if key.shown:
        return key.shown
    value = key.default
    if value is REQUIRED:
        return "required"
    if value is None:
        return "none"
    return key.kind.spell(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(table: Table, top: str) -> list[str]:
    """
    @param top: the heading of the file's top level.
    @raise ValueError: a key without a meaning or a kind.
    """
    lines = [f"### {f'`{table.name}`' if table.name else top}", "", table.doc, ""]
    lines += ["| Key | Type | Default | Meaning |", "|---|---|---|---|"]
    for key in table.keys:
        where = f"{table.name or top}: {key.name}"
        if not key.doc.strip():
            raise ValueError(f"{where}: a key without a meaning")
        if not key.words.strip():
            raise ValueError(f"{where}: a key without a type")
        default = render_default(key)
        if default not in ("required", "none"):
            default = f"`{default}`"
        lines.append(
            f"| `{key.name}` | {_cell(key.words)} | {_cell(default)}"
            f" | {_cell(key.doc)} |"
        )
    return [*lines, ""]


def reference(
    server: Sequence[Table] = SERVER_TABLES, agent: Sequence[Table] = AGENT_TABLES
) -> str:
    """
    @return: the whole reference, Markdown.
    @raise ValueError: a key without a meaning or a type.
    """
    lines = [_HEADER]
    lines += [
        "## The server's file",
        "",
        "`twistd llmgw-server --config FILE.toml`; `twistd llmgw-router"
        " --config` reads the same file (its `[store]`, `[limits]`, `[auth]`,"
        " `[router]`, `[cors]`, `[batches]` and top-level keys).",
        "",
    ]
    for table in server:
        lines += _table(table, "Top level")
    lines += ["## The agent's file", "", "`twistd llmgw-agent --config FILE.toml`.", ""]
    for table in agent:
        lines += _table(table, "Top level")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str]) -> int:
    """
    Write the reference to L{PATH} under the current folder, or with
    C{--check} compare it.

    @return: the exit status: 1 when C{--check} finds it stale.
    """
    text = reference()
    if list(argv) == ["--check"]:
        try:
            with open(PATH, encoding="utf-8") as f:
                current = f.read()
        except OSError:
            current = ""
        if current != text:
            sys.stderr.write(f"{PATH} is stale: run make config-docs\n")
            return 1
        return 0
    if argv:
        sys.stderr.write("usage: python -m llmgw.config_docs [--check]\n")
        return 2
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
