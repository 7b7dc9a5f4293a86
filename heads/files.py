"""Files every stage writes or reads: atomic writes (readers never see half a file) and JSONL."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

from .errors import GorgonError, first_problem, user_error_line


def looks_like_path(text: str) -> bool:
    """A local path rather than a hub id ("user/repo"): starts like a path or has more than one slash."""
    return text.startswith((".", "/", "~")) or text.count("/") > 1


def local_path_problem(text: str) -> str | None:
    """Why `text`, which names something on disk, is not a readable folder (None when it names nothing
    on disk, or a folder): so a broken local path is not reported as a failed hub download."""
    path = Path(text).expanduser()
    try:
        path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{text} is a symlink loop"
        return f"{text} is a broken symlink" if os.path.lexists(path) else None
    return None if path.is_dir() else f"{text} is a file, not a folder"


def new_temp(folder: Path, prefix: str, is_dir: bool = False) -> Path:
    """A new, uniquely named file (or folder) in `folder` with the mode any new one gets (0666, or
    0777, less the umask), so another user (a serving engine) can read what is renamed from it:
    tempfile's are private (0600, 0700), and reading the umask means setting it, which other threads see.
    Its name says which machine and process made it, so `remove_stale_temps` can tell a killed writer's."""
    while True:
        path = folder / f"{prefix}{host_name()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            if is_dir:
                os.mkdir(path, 0o777)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


def remove_stale_temps(folder: Path, prefix: str) -> None:
    """Remove the `new_temp(folder, prefix)` files and folders whose process, on this machine, is gone (a kill
    during a write leaves them; an 8B model's weights would stay behind as a hidden copy). Another machine's
    (a shared disk) and a live process's are kept."""
    name = re.compile(re.escape(prefix) + re.escape(host_name()) + r"-(\d+)-[0-9a-f]{8}\.tmp")
    for path in Path(folder).glob(f"{glob.escape(prefix)}*.tmp"):
        match = name.fullmatch(path.name)
        if match and not process_alive(int(match[1])):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


def host_name() -> str:
    """This machine's name, as file names may hold it."""
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"


def process_alive(pid: int) -> bool:
    """Whether a process of this machine runs with this id."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        pass
    return True


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


def follow_umask(folder: Path) -> None:
    """Give every file under `folder` the mode any new file gets (0666 less the umask): safetensors writes
    private files (0600), and with it save_pretrained, peft and accelerate's save_state, so weights that
    gorgon has them save into a folder of its own are made readable as the umask allows."""
    probe = new_temp(Path(folder), ".mode-")
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def atomic_write(path: Path, write) -> None:
    """Call write(tmp_path) then rename over `path`, so readers never see a half-written file.
    Missing parent folders are made; what a killed earlier write of `path` left is removed. A failed write
    (a full disk) is an OSError naming `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, f".{path.name}.")
    tmp = new_temp(path.parent, f".{path.name}.")
    mode = tmp.stat().st_mode & 0o777  # a writer may replace the file with a private one (safetensors does)
    try:
        with naming_failed_writes(path):
            write(str(tmp))
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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


@contextlib.contextmanager
def naming_failed_writes(path: Path):
    """A write that fails (a full disk) is an OSError naming `path`: one raised by a write names no file, so its
    one line (`user_error_line`) would not say which."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


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


def save_figure(fig, path: Path) -> None:
    """Lay out a matplotlib figure, write it as a PNG atomically and close it (pyplot keeps every figure
    open until closed)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


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


def write_weights(folder: Path, state: dict, config: dict, weights_name: str = "model.safetensors") -> None:
    """Save tensors (a safetensors file) and config.json into `folder`, each atomically. The tensors are
    copied whole to the CPU: safetensors refuses tensors that share memory (a shared LM head repeated)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    atomic_write(folder / weights_name, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_text(folder / "config.json", json.dumps(config, indent=2) + "\n")


def read_text(path: Path) -> str:
    """A text file's contents; a binary or non-UTF-8 file is an error saying so."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise GorgonError(f"{path} is not UTF-8 text (byte {err.start} cannot be decoded): pass a text file") from err


def read_config(path: Path, what: str = "heads") -> dict:
    """A drafter folder's config.json; one that cannot be read or parsed is one line naming the fix."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GorgonError(f"cannot read {path} ({err.__class__.__name__}): re-save or re-download the {what}") from err


def config_or_none(folder: Path) -> dict | None:
    """A folder's config.json as a dict, or None where it has none that parses to one: for telling what a
    folder holds before choosing how to load it (`read_config` says why one cannot be read)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_model_config(config) -> bool:
    """Whether a parsed config.json is a transformers model's (a draft model, a target) rather than gorgon
    heads': a model's names its architectures, heads' name their target (`target_name`)."""
    return isinstance(config, dict) and bool(config.get("architectures")) and "target_name" not in config


def read_jsonl(path: Path) -> list:
    """One JSON value per line, blank lines skipped; a bad line is an error naming its number."""
    records = []
    # Split on "\n" only: str.splitlines() also breaks at U+2028 and friends inside strings.
    for n, line in enumerate(read_text(path).split("\n"), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise GorgonError(f"{path} line {n} is not valid JSON ({err.msg}): fix or remove that line") from err
    return records


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


@contextlib.contextmanager
def reading_weights(folder: Path, weights_name: str):
    """Loading a drafter's weights: a missing, corrupt or mismatched file is one line naming the fix."""
    from safetensors import SafetensorError

    try:
        yield
    except FileNotFoundError as err:
        raise GorgonError(f"{folder} has no {weights_name}: re-save or re-download the heads") from err
    except (SafetensorError, OSError) as err:
        raise GorgonError(f"the weights in {folder} are corrupt ({err}): re-save or re-download the heads") from err
    except (RuntimeError, KeyError) as err:
        raise GorgonError(f"the weights in {folder} do not match its config.json ({first_problem(err)}): re-save "
                          "the heads") from err


def read_safetensors_folder(folder: Path, what: str) -> dict:
    """Every tensor in a folder's .safetensors files (an engine's checkpoint may be sharded); `what` names
    the layout in the error when there are none."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise GorgonError(f"{folder} has a {what} config.json but no .safetensors weights")
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors
