"""Output folders: whose they are, who writes them now, how output is put in place, and what a rerun
that goes on from earlier work must find unchanged.

Every command that writes an --out (`gorgon data`, training, `gorgon bench`, `gorgon export`) keeps these
rules, so none writes over files it did not make (`check_output`), two never write one place at once
(`holding`), a failure or a kill leaves nothing half-written there (`staging`, `move_into_place`), and going
on from earlier work is refused when its settings changed (`changed_settings`). Each command's own rules
(what its marker is, what a finished output holds) stay with the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import GorgonError, user_error_line
from .files import atomic_write_text, host_name, new_temp, process_alive, remove_stale_temps


def check_output(out: Path, ours, overwrite: bool, kind: str = "folder", own_entry=None) -> bool:
    """Before any work: may a command write its output (a `kind`: folder or file) at `out`?

    Anything that is not this command's own output is never written over: a file where a folder is
    wanted (or the reverse), a non-empty folder or a file it did not make. gorgon's own
    earlier output (`ours(out)` is true) is replaced only with --overwrite; a folder replaced whole
    must hold nothing else (`own_entry(path)` is true of each entry), so a user's file put inside is
    not removed with it. Returns whether earlier output will be replaced. The place is then checked
    for writing, so a read-only disk fails now.
    """
    if out.is_symlink():  # replacing or removing it would act on the link, not on what it points to
        raise GorgonError(f"--out {out} is a symbolic link (to {os.readlink(out)}): pass the path it points to, or "
                          "another --out")
    exists = out.exists() or os.path.lexists(out)
    if exists and (out.is_dir() != (kind == "folder")):
        raise GorgonError(f"--out {out} is {'a file' if kind == 'folder' else 'a folder'}: pass a {kind} path")
    replace = False
    if exists and (kind == "file" or any(out.iterdir())):
        if not ours(out):
            raise GorgonError(f"--out {out} already holds files this command did not write: choose a new "
                              f"{'or empty folder' if kind == 'folder' else 'file'}")
        if not overwrite:
            raise GorgonError(f"--out {out} holds earlier gorgon output: pass --overwrite to replace it, or choose "
                              f"another --out")
        foreign = sorted(p.name for p in out.iterdir() if not own_entry(p)) if own_entry and kind == "folder" else []
        if foreign:
            raise GorgonError(f"--out {out} holds {foreign[0]}, which gorgon did not write: move it away, or choose "
                              "another --out")
        replace = True
    check_writable(out if kind == "folder" else out.parent)
    return replace


def check_report_output(out: str | Path, is_report, overwrite: bool) -> None:
    """Before any work: may a JSON report go to `out`, and its plot beside it (the same name, .png)?
    A .png `out` is refused: the plot would be written over the report; so is a folder path ("runs/x/")."""
    if str(out).endswith(("/", os.sep)):
        raise GorgonError(f"--out {out} is a folder path: pass the report's .json path, such as {out}report.json")
    out = Path(out)
    if out.suffix == ".png":
        raise GorgonError("--out is the JSON report, and its plot is written beside it with the suffix .png: "
                          "pass a .json path")
    check_output(out, is_report, overwrite, kind="file")
    check_output(out.with_suffix(".png"), lambda png: is_report(out) and is_plot(png), overwrite, kind="file")


def is_plot(path: Path) -> bool:
    """A PNG that matplotlib wrote (it names itself in the file's Software text, ahead of the image data), as
    gorgon's plots are: an image of the user's own beside a report is not taken for the report's plot."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"Software\x00Matplotlib" in head


def check_heads_destination(folder: Path, weights_name: str) -> None:
    """Refuse to save heads where they would replace what gorgon did not write: onto a file, or into a folder
    whose config.json is another model's (or that holds weights without one). Heads saved here before are
    saved over, as transformers' save_pretrained does."""
    if os.path.lexists(folder) and not folder.is_dir():
        raise GorgonError(f"{folder} is a file, not a folder: save the heads into a new or empty folder")
    config = folder / "config.json"
    try:
        ours = "target_fingerprint" in json.loads(config.read_text())  # every gorgon heads config has it
    except FileNotFoundError:
        ours = not (folder / weights_name).exists()
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours:
        raise GorgonError(f"{folder} holds another model's {config.name if config.exists() else weights_name}, "
                          "which saving heads there would replace: save them into a new or empty folder")


def check_writable(folder: Path, fix: str = "choose a writable --out") -> None:
    """Create `folder` (and its parents) and write a scratch file there; fail in one line, ending in `fix`,
    if that fails. The folders it made are removed again, so a command that then stops on bad input leaves
    no empty --out behind (writers create their folders: `atomic_write` makes its file's parents)."""
    made = missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise GorgonError(f"cannot write to {folder} ({err.strerror or err.__class__.__name__}): {fix}") from err
    finally:
        remove_empty_folders(made)


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first: what `mkdir(parents=True)`
    would make, so that a command that fails can take them away again (`remove_empty_folders`)."""
    folder = Path(folder)
    return [p for p in (folder, *folder.parents) if not os.path.lexists(p)]


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove each folder (deepest first) that is empty; one that holds anything (another process wrote
    there meanwhile) stays, and so do its parents."""
    for path in folders:
        try:
            path.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return


def process_start(pid: int) -> str:
    """When a process started, in the kernel's clock ticks since boot (Linux's /proc; "" elsewhere): with its id,
    it tells the process that took a lock from a later one that was given the same id."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def check_unlocked(lock: Path, writer: str, written: Path | None = None) -> None:
    """Refuse when a live process of this machine holds `lock` (`take_lock`): a second writer would write beside
    it. A lock left by a killed process (gone, or its id since given to a process that started later) or taken
    on another machine is not in the way. `writer` names the holder in the message ("training run"), `written`
    what it writes (default: the lock's folder)."""
    try:
        host, pid, *started = lock.read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return
    if host != host_name() or pid == os.getpid() or not process_alive(pid):
        return
    if started and process_start(pid) not in ("", started[0]):  # "": unreadable, so taken as the same process
        return
    raise GorgonError(f"{written or lock.parent} is being written by another {writer} (process {pid}, still "
                      f"running): wait for it to end, or stop it (kill {pid}), then retry")


def take_lock(lock: Path) -> None:
    """Mark `lock`'s folder as this process's (this machine's name, this process's id and start) until
    `drop_lock`."""
    atomic_write_text(lock, f"{host_name()} {os.getpid()} {process_start(os.getpid())}\n")


def holds_lock(lock: Path) -> bool:
    """Whether this process, on this machine, holds `lock` (`take_lock`): on a shared disk another machine's
    process may have the same id."""
    with contextlib.suppress(OSError, ValueError):
        host, pid, *_ = lock.read_text().split()
        return host == host_name() and int(pid) == os.getpid()
    return False


def drop_lock(lock: Path) -> None:
    """Give back `lock` if this process holds it."""
    if holds_lock(lock):
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def holding(lock: Path, writer: str, written: Path | None = None):
    """Hold `lock` while the block writes what it guards, so a second command writing there is refused instead
    of racing this one (`check_unlocked`; `writer` and `written` as there). It is given back when the block
    ends, however it ends, and the folders made for it go again if nothing else was written in them."""
    check_unlocked(lock, writer, written)
    made = missing_folders(lock.parent)
    take_lock(lock)
    try:
        yield
    finally:
        drop_lock(lock)
        remove_empty_folders(made)


@contextlib.contextmanager
def staging(out: Path, doing: str):
    """A new folder beside `out` to write output into whole before it is put in place (`move_into_place`), so
    no reader sees half of it. A failure or Ctrl-C removes it, and the folders made for it; a kill leaves it,
    named as this process's, for the next command's `remove_stale_temps` (`doing` names it: "exporting")."""
    made = missing_folders(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.{doing}-"
    remove_stale_temps(out.parent, prefix)
    folder = new_temp(out.parent, prefix, is_dir=True)
    try:
        yield folder
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        remove_empty_folders(made)
        raise


def move_into_place(tmp: Path, out: Path, marker: str) -> None:
    """Put a finished folder `tmp` at `out`: renamed whole onto a missing `out` (readers see all of it or
    nothing); into an empty folder that exists (the user's, perhaps with permissions of its own, or a mount
    point) entry by entry, `marker` first, so a move cut short leaves output gorgon knows as its own. An `out`
    that another process filled meanwhile (it was checked before the work) is refused in one line."""
    try:
        if not (out.is_dir() and not any(out.iterdir())):
            os.replace(tmp, out)  # fails on a folder that is not empty
            return
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GorgonError(f"--out {out} was written by another process while this one worked ({err.strerror}): "
                          "nothing of this run's was put there; rerun with another --out") from err
    os.replace(tmp / marker, out / marker)
    for entry in tmp.iterdir():
        os.replace(entry, out / entry.name)
    tmp.rmdir()


@contextlib.contextmanager
def full_disk_is_one_line(out: Path, then: str = "rerun"):
    """A write that fails on a full disk becomes one line, ending in what to do once space is freed (`then`).
    torch and safetensors report a full disk in their own words (a RuntimeError at a checkpoint, a
    SafetensorError), not as an OSError, so the free space is checked (under 16 MiB counts as full)."""
    try:
        yield
    except Exception as err:
        if user_error_line(err) is not None:
            raise
        folder = next(p for p in [out, *out.absolute().parents] if p.exists())
        free = shutil.disk_usage(folder).free
        if free >= 16 * 2**20:
            raise
        raise GorgonError(f"the disk holding {out} is full ({free // 2**20} MiB free; {err.__class__.__name__} while "
                          f"writing): free some space, then {then}") from err


def changed_settings(recorded: dict, current: dict, may_change=(), absent_is_none: bool = False) -> list[str]:
    """The settings, by name, that differ from those recorded by the work a rerun goes on from (a training
    checkpoint, an unfinished dataset, a stopped bench), but for `may_change`. A key the record lacks was
    recorded before that setting existed, so it had its default and counts as unchanged; with `absent_is_none`,
    it counts as None (a bench report leaves out what that run did not use, such as compared heads)."""
    return sorted(key for key, value in current.items() if key not in may_change
                  and (key in recorded or absent_is_none) and recorded.get(key) != value)
