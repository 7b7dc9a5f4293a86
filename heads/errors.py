"""The one exception type users see: a single line that names the problem and the fix."""

import difflib
import errno
import sys


class GorgonError(Exception):
    """Bad input or state that the user can fix; the CLI prints it without a traceback."""


# Failures of the machine, not of gorgon, that a user fixes (free space, a writable place):
# the command entry points print these as one line too, wherever in the work they happen.
_DISK_ERRORS = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space or raise the quota",
                errno.EROFS: "choose a writable --out", errno.EACCES: "check the permissions"}


def user_error_line(err: Exception) -> str | None:
    """The one line to print for an error the user can fix (a GorgonError, or a full, read-only or
    forbidden disk); None for anything else, which is a bug and keeps its traceback."""
    if isinstance(err, GorgonError):
        return str(err)
    if isinstance(err, OSError) and err.errno in _DISK_ERRORS:
        where = f" {err.filename}" if err.filename else ""
        return f"cannot write{where} ({err.strerror}): {_DISK_ERRORS[err.errno]}"
    return None


def int_at_least(low: int):
    """An argparse type: a whole number >= `low` (so --limit 0 or --max-new-tokens -1 fail as they are parsed)."""
    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


def check_keys(keys, known, where: str) -> None:
    """Refuse a key that is not a setting (in a recipe, on the command line, in a config.json),
    naming the close matches: a misspelt `learning_rate` must not silently train with the default."""
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(sorted(known))}"
            raise GorgonError(f"unknown key {key!r} {where}: {hint}")


def run_script(main, name: str) -> None:
    """A script's entry point (`python train/NAME.py`, `accelerate launch -q train/NAME.py`, `python
    scripts/NAME.py`): bad input, or a full or read-only disk, exits 2 with one line (accelerate adds
    its own traceback unless launched with -q)."""
    try:
        sys.exit(main())
    except Exception as err:
        line = user_error_line(err)
        if line is None:
            raise
        write_error_line(f"{name}: error: {line}")
        sys.exit(2)


def write_error_line(text: str) -> None:
    """One write, newline included: with PYTHONUNBUFFERED, print's two writes let another process
    (accelerate's launcher, another rank) write between the message and its newline."""
    sys.stderr.write(text + "\n")
