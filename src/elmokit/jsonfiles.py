"""Reading JSON that users may have edited (configs, run records, data lines): one parser whose
every failure is a `JSONFileError` (a ValueError) naming the file (and, for data, the line) and
what is wrong, never a traceback from inside `json`.

    read_json(path)                  the value in a JSON file
    decode_json(text, source)         the value in a string, `source` naming where it came from

What the standard parser lets through as other errors is caught here: text that is not UTF-8
(UnicodeDecodeError), nesting deeper than Python's recursion limit (RecursionError: `[[[[...]]]]`),
and integers over the interpreter's digit limit (ValueError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JSONFileError(ValueError):
    """A JSON file or line that cannot be read, with where and why in its message."""


def decode_json(text: str | bytes, source: str) -> Any:
    """The value `text` holds; `source` ('config.json', 'data.jsonl:3') starts every error."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise JSONFileError(f"{source}: not valid JSON (invalid UTF-8 byte 0x{error.object[error.start]:02x} at "
                                f"byte {error.start}; JSON is UTF-8 text)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise JSONFileError(f"{source}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
                            ) from None
    except RecursionError:
        raise JSONFileError(f"{source}: JSON nested too deeply to read (arrays or objects thousands of levels "
                            "inside one another)") from None
    except ValueError as error:  # an integer longer than the interpreter converts
        raise JSONFileError(f"{source}: not readable JSON ({error})") from None


def read_json(path: str | Path) -> Any:
    """The value in the JSON file at `path` (OSError as the system reports it: missing, a directory)."""
    return decode_json(Path(path).read_bytes(), str(path))
