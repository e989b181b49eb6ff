"""The files of a ``multipart/form-data`` body (``curl -F image=@cat.png``), in order.

Parsed with python-multipart's streaming parser over the whole body, which the front end has
already read within ``max_body_bytes``; only file parts are accepted.
"""

from __future__ import annotations

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from service.errors import BadRequestError, InvalidInputError
from service.frontend.handlers.instances import content_type_parameter


def multipart_files(body: bytes, content_type: str) -> list[bytes]:
    """The contents of a ``multipart/form-data`` body's file parts, in order; 400 when the
    body is not well formed, 422 for a part that is not a file."""
    boundary = content_type_parameter(content_type, "boundary")
    if not boundary:
        raise BadRequestError("a multipart/form-data body needs a boundary in its Content-Type")
    parts: list[tuple[dict[bytes, bytes], list[bytes]]] = []
    header_field: list[bytes] = []
    header_value: list[bytes] = []
    ended: list[bool] = []

    def on_part_begin() -> None:
        parts.append(({}, []))

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_field.append(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.append(data[start:end])

    def on_header_end() -> None:
        parts[-1][0][b"".join(header_field).lower()] = b"".join(header_value)
        header_field.clear()
        header_value.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1][1].append(data[start:end])

    def on_end() -> None:
        ended.append(True)

    try:
        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": on_part_begin,
                "on_header_field": on_header_field,
                "on_header_value": on_header_value,
                "on_header_end": on_header_end,
                "on_part_data": on_part_data,
                "on_end": on_end,
            },
        )
        parser.write(body)
        parser.finalize()
    except MultipartParseError as error:
        raise BadRequestError(f"the multipart/form-data body is malformed: {error}") from None
    if not ended:
        raise BadRequestError("the multipart/form-data body ends before its closing boundary")
    files = []
    for index, (headers, chunks) in enumerate(parts):
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        if b"filename" not in disposition:
            name = disposition.get(b"name", b"").decode("latin-1")
            raise InvalidInputError(
                f"multipart part {index} ({name!r}) is not a file; send each image as a file "
                "part (curl -F image=@picture.png)"
            )
        files.append(b"".join(chunks))
    return files
