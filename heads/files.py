"""Files every stage writes or reads: atomic writes (readers never see half a file) and JSONL."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .errors import GorgonError


def looks_like_path(text: str) -> bool:
    """A local path rather than a hub id ("user/repo"): starts like a path or has more than one slash."""
    return text.startswith((".", "/", "~")) or text.count("/") > 1


def atomic_write(path: Path, write) -> None:
    """Call write(tmp_path) then rename over `path`, so readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text))


def read_jsonl(path: Path) -> list:
    """One JSON value per line, blank lines skipped; a bad line is an error naming its number."""
    records = []
    # Split on "\n" only: str.splitlines() also breaks at U+2028 and friends inside strings.
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise GorgonError(f"{path} line {n} is not valid JSON ({err.msg}): fix or remove that line") from err
    return records
