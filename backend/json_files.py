"""Reading the JSON files of model and checkpoint folders, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, what: str, error: type[Exception]) -> dict[str, Any]:
    """The JSON object in `path` (`what` names it in errors); `error` when missing, unreadable or not an object."""
    if not path.is_file():
        raise error(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: {what} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: {what} must hold a JSON object")
    return data
