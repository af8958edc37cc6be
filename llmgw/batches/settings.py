"""
The C{[batches]} table: the limits of the Files and Batches APIs
(docs/batches.md), read by the server and by every router of a tier (they
serve the same routes on the same store).  Imports only the configuration
checks, as every settings module that C{llmgw.config} composes.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config_checks import POSITIVE, Number, Size, Table, setting, settings_keys

MAX_FILE_SIZE = 200 * 1024 * 1024
"""
The default largest upload, bytes: OpenAI's limit on a batch's input file
(200 MB, its Batch API guide).
"""

MAX_LINES = 50_000
"""
The default most requests in one batch: OpenAI's limit on a batch's input
file (its Batch API guide).
"""


@dataclass(frozen=True)
class BatchesConfig:
    """
    The C{[batches]} table.
    """

    max_file_size: int = setting(
        MAX_FILE_SIZE,
        Size(),
        "The largest upload POST /v1/files takes, its form's few hundred bytes"
        " around the file included (the route's body limit, in place of"
        " [router] max_body_size); a larger one is refused with a 413.",
    )
    max_lines: int = setting(
        MAX_LINES,
        POSITIVE,
        "The most requests in one batch (lines of its input file, or requests"
        " of an Anthropic Message Batch); a batch with more is refused.",
    )
    interactive_ttft_share: float = setting(
        0.2,
        Number(least=0, most=10),
        "Batch lines never cost an interactive request more than this share"
        " of its time to first token without them (0.2: at most 1.2 times):"
        " the room batch work gets beside a model's interactive traffic is"
        " cut while its requests' time to first token runs past it.",
    )
    max_lines_in_flight: int = setting(
        64,
        POSITIVE,
        "Batch lines the leading server's runner has in flight at most, over"
        " every batch and model (each model's room may allow fewer).",
    )


BATCHES_TABLE = Table(
    "[batches]",
    "The Files and Batches APIs: files uploaded for batches, and the batches"
    " run on what the fleet leaves idle (docs/batches.md).",
    settings_keys(BatchesConfig),
)


def parse_batches(table: object) -> BatchesConfig:
    """
    @return: the C{[batches]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    return BatchesConfig(**BATCHES_TABLE.read(table))


__all__ = [
    "BATCHES_TABLE",
    "MAX_FILE_SIZE",
    "MAX_LINES",
    "BatchesConfig",
    "parse_batches",
]
