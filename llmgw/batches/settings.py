"""
The C{[batches]} table of the server's file (docs/batches.md): each key
declared once with its kind, default and meaning.  A leaf beside the
modules that read it: it imports only L{llmgw.config_checks}, so that
reading the file pulls in none of the batches' machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config_checks import Number, Table, setting, settings_keys


@dataclass(frozen=True)
class BatchesConfig:
    """
    The C{[batches]} table.

    @ivar interactive_ttft_share: how much longer, as a share of its time
        to first token without batch work, an interactive request may wait
        for its first token while batch lines run beside it (0.2: at most
        1.2 times); L{llmgw.batches.room.EngineRoom} keeps to it.
    """

    interactive_ttft_share: float = setting(
        0.2,
        Number(least=0, most=10),
        "Batch lines never cost an interactive request more than this share"
        " of its time to first token without them (0.2: at most 1.2 times):"
        " the room batch work gets beside a model's interactive traffic is"
        " cut while its requests' time to first token runs past it.",
    )


BATCHES_TABLE = Table(
    "[batches]",
    "Batch work (the Files and Batches APIs): how it runs beside the"
    " interactive traffic.",
    settings_keys(BatchesConfig),
)


def parse_batches(table: object) -> BatchesConfig:
    """
    @return: the C{[batches]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    return BatchesConfig(**BATCHES_TABLE.read(table))
