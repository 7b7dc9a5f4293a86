"""What every command shares: its argument parser and option types, and how it ends: a user's error as one
line and exit status 2 (told to torch's launcher too), Ctrl-C as 130, warnings on one line."""

import argparse
import contextlib
import difflib
import json
import os
import sys
import time
import warnings
from pathlib import Path

from .errors import user_error_line


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with a bad option in one line, as every other error (argparse prints its whole
    usage before the error): the problem, then where the options are explained."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {self.unknown_option() or message} (see {self.prog} --help)\n")

    def unknown_option(self) -> str | None:
        """The first long option given that this parser lacks, with the closest it has. argparse names a missing
        required option before an unrecognised one, which hides a typo (--promt), and gives no hint for the
        training scripts' spelling (--max_new_tokens)."""
        known = [name for action in self._actions for name in action.option_strings if name.startswith("--")]
        for token in getattr(self, "_given", []):
            if token == "--":
                break
            name = token.split("=", 1)[0]
            if not name.startswith("--") or name in known or sum(k.startswith(name) for k in known) == 1:
                continue
            close = difflib.get_close_matches(name.replace("_", "-"), known, n=1, cutoff=0.6)
            return f"unrecognized option {name}" + (f" (did you mean {close[0]}?)" if close else "")
        return None


def user_path(text: str) -> str:
    """An argparse type for a path or hub id: `~` is the home folder, as the training scripts read it (the shell
    expands it in `--out ~/x` but not in `--out=~/x`, which made a folder named ~ here)."""
    return os.path.expanduser(text)


def int_at_least(low: int, high: int | None = None):
    """An argparse type: a whole number >= `low` (and <= `high`), so --limit 0 or --max-new-tokens -1 fail
    as they are parsed, before any model loads."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, not {value}")
        return value
    parse.__name__ = f"int >= {low}" if high is None else f"int from {low} to {high}"
    return parse


def exit_status(main, name: str) -> int:
    """Call `main()` and say how it ended as an exit status: its own (None is 0); 2, after one line `name:
    error: ...`, for bad input or a full or read-only disk; 130 on Ctrl-C. Anything else is a bug: raised.
    gorgon's own warnings print as one line `name: warning: ...`."""
    one_line_warnings(name)
    try:
        return main() or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return reader_gone()
    except Exception as err:
        line = user_error_line(err)
        if line is None:
            raise
        text = f"{name}: error: {line}"
        if not printed_by_another_process(text):  # N processes that fail alike print one line, not N
            write_error_line(text)
        tell_launcher(text)
        return 2


def tell_launcher(text: str) -> None:
    """Under torch's launcher (`accelerate launch` with several processes), also leave the error line where it
    reads a failed process's cause: its error file (torchelastic's, named by TORCHELASTIC_ERROR_FILE). The
    report it prints after the processes end then gives the line as each failure's cause, where it would
    point to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"message": text, "timestamp": int(time.time())}, f)


def printed_by_another_process(text: str) -> bool:
    """Whether another process of this launch, on this machine, already printed this error line: the first to
    fail prints it, then every process leaves it in its error file (`tell_launcher`), and torch's launcher gives
    each process's file a folder of its own beside the others' (.../attempt_0/<local rank>/error.json). Not under
    that launcher, or laid out otherwise, every process prints its line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    for other in Path(path).parent.parent.glob("*/" + Path(path).name):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if json.loads(other.read_text(encoding="utf-8")).get("message") == text:
                return True
    return False


def one_line_warnings(name: str) -> None:
    """Print gorgon's warnings (their text starts "gorgon: ") as `name: warning: ...` on one line: Python adds
    the file, the line number and the source line, which tell a command-line user nothing."""
    global _command
    _command = name
    warnings.formatwarning = _one_line


def _one_line(message, category, filename, lineno, line=None) -> str:
    text = str(message)
    if text.startswith("gorgon: "):
        return f"{_command}: warning: {text.removeprefix('gorgon: ')}\n"
    return _python_format(message, category, filename, lineno, line)


_command = "gorgon"  # the command whose warnings `_one_line` prints


_python_format = warnings.formatwarning


def run_script(main, name: str) -> None:
    """A script's entry point (`python train/NAME.py`, `accelerate launch -q train/NAME.py`, `python
    scripts/NAME.py`), with `gorgon`'s exit statuses (`exit_status`; accelerate adds its own traceback
    to a failure unless launched with -q)."""
    sys.exit(exit_status(main, name))


def reader_gone() -> int:
    """The end of a pipe reading our output closed early (`--help | head`): no traceback, and stdout pointed at
    /dev/null so the interpreter's last flush does not fail again. The exit status is a shell's for SIGPIPE."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def write_error_line(text: str) -> None:
    """One write, newline included: with PYTHONUNBUFFERED, print's two writes let another process
    (accelerate's launcher, another rank) write between the message and its newline."""
    sys.stderr.write(text + "\n")
