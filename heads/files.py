"""Files every stage writes or reads: atomic writes (readers never see half a file), JSONL, configs and
weights. The folders a command writes them into are `outputs.py`'s."""

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
from pathlib import Path

from .errors import GorgonError, first_problem


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
def naming_failed_writes(path: Path):
    """A write that fails (a full disk) is an OSError naming `path`: one raised by a write names no file, so its
    one line (`user_error_line`) would not say which."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


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
