"""
A C{multipart/form-data} upload read from the request's body, for
C{POST /v1/files} (C{file} and C{purpose}, as the C{openai} SDK's
C{files.create} sends them).

The body is already on disk (twisted.web spools a body of 100 kB or more,
or of unknown length, to a temporary file) and within C{[batches]
max_file_size} (L{llmgw.router.edge.site.LimitedRequest}).  The parser is
the C{multipart} package's L{PushMultipartParser}, fed 64 KiB at a time:
the file's bytes are copied once, into one buffer whose bytes are handed on
as they are (C{BytesIO.getvalue} shares its buffer).
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO
from typing import IO

from multipart import (
    MultipartError,
    MultipartSegment,
    PushMultipartParser,
    parse_options_header,
)

CHUNK = 64 * 1024
"""
Bytes read from the body at a time.
"""

MAX_FIELD = 64 * 1024
"""
The most bytes of a form field that is not a file.
"""


class FormError(Exception):
    """
    The body is not a form with what the route needs; C{str(error)} says
    what, for a 400.
    """


@dataclass(frozen=True)
class Upload:
    """
    A form's file and fields.

    @ivar fields: each text field's last value.
    @ivar filename: the C{file} part's name, as the client gave it.
    @ivar content: the C{file} part's bytes.
    """

    fields: dict[str, str]
    filename: str
    content: bytes


def read_upload(body: IO[bytes], content_type: bytes | None) -> Upload:
    """
    @param body: the request's body, read from its start.
    @param content_type: the request's C{Content-Type}.
    @return: the form, its C{file} part read whole.
    @raise FormError: not C{multipart/form-data} with a boundary, a broken
        form, no C{file} part, or a text field over L{MAX_FIELD}.
    """
    kind, options = parse_options_header((content_type or b"").decode("latin-1"))
    boundary = options.get("boundary")
    if kind != "multipart/form-data" or not boundary:
        raise FormError("The body must be multipart/form-data, with a boundary.")
    fields: dict[str, str] = {}
    filename: str | None = None
    content = b""
    try:
        with PushMultipartParser(boundary) as parser:
            part: MultipartSegment | None = None
            buffer = BytesIO()
            while not parser.closed:
                for event in parser.parse(body.read(CHUNK)):
                    if isinstance(event, MultipartSegment):
                        part, buffer = event, BytesIO()
                    elif event:
                        buffer.write(event)
                        if (part is None or part.filename is None) and (
                            buffer.tell() > MAX_FIELD
                        ):
                            raise FormError(f"A form field is over {MAX_FIELD} bytes.")
                    elif part is not None:
                        if part.name == "file" and part.filename is not None:
                            filename, content = part.filename, buffer.getvalue()
                        elif part.filename is None:
                            fields[part.name] = buffer.getvalue().decode(
                                "utf-8", "replace"
                            )
                        part = None
    except MultipartError as error:
        raise FormError(f"The form cannot be read: {error}") from None
    if filename is None:
        raise FormError("The form has no file part named 'file'.")
    return Upload(fields, filename, content)


__all__ = ["FormError", "Upload", "read_upload"]
