"""The one exception type users see: a single line that names the problem and the fix; and the checks that
word a bad value that way (keys, configs)."""

import dataclasses
import difflib
import errno
import types
import typing


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


def check_keys(keys, known, where: str) -> None:
    """Refuse a key that is not a setting (in a recipe, on the command line, in a config.json),
    naming the close matches: a misspelt `learning_rate` must not silently train with the default."""
    for key in keys:
        if key not in known:  # an abbreviation by initials (lr: learning_rate), else keys spelt alike
            close = [k for k in sorted(known) if "".join(w[0] for w in k.split("_") if w) == key] or \
                difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(sorted(known))}"
            raise GorgonError(f"unknown key {key!r} {where}: {hint}")


def first_problem(err: Exception, most: int = 240) -> str:
    """One line for a load error: torch's state-dict error lists each mismatch on a line of its own under a
    header; the first mismatch (the tensor and both shapes) is the one to show."""
    lines = [" ".join(line.split()) for line in str(err).splitlines() if line.strip()]
    listed = [line for line in lines[1:] if line.startswith(("size mismatch", "Missing key", "Unexpected key"))]
    text = (listed or lines or [err.__class__.__name__])[0]
    return text if len(text) <= most else text[: most - 3] + "..."


def config_from_dict(cls, data: dict, source: str, what: str):
    """A dataclass config from a config.json's fields. A hand-edited or foreign file fails here in one line
    naming the field (unknown, missing, or of the wrong JSON type), not in a TypeError while the model is
    built or a size mismatch when its weights load."""
    fields = dataclasses.fields(cls)
    unknown = [key for key in data if key not in {f.name for f in fields}]
    if len(unknown) > 1:  # not a misspelt key: another method's folder, or a model's
        raise GorgonError(f"{source} is not {what} (it has {', '.join(map(repr, unknown[:3]))}"
                          f"{', ...' if len(unknown) > 3 else ''}): gorgon.heads.load_heads loads any method's heads")
    check_keys(data, {f.name for f in fields}, f"in {source}")
    missing = [f.name for f in fields if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise GorgonError(f"{source} lacks {', '.join(missing)}: it is not {what} (re-save the heads)")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if not _fits(value, hints[key]):
            name = hints[key].__name__ if type(hints[key]) is type else str(hints[key])
            raise GorgonError(f"{source} has {key} = {value!r}, which is not {name}: correct it, or re-save the heads")
    return cls(**data)


def _fits(value, hint) -> bool:
    """Whether a JSON value has a field's type (a bool is no number; an int is a float)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, typing.get_origin(hint) or hint)
