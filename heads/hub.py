"""The Hugging Face Hub: drafter folders fetched by repo id, and folders uploaded in one commit."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlparse

from .errors import GorgonError
from .files import local_path_problem, looks_like_path
from .methods import loaded_files

CONFIG_NAME = "config.json"
UNREACHABLE = "GORGON_HUB_UNREACHABLE"  # the Hub's host, set beside HF_HUB_OFFLINE when it did not resolve
PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def offline_if_hub_unreachable() -> None:
    """At a command's start: when the Hub's host name does not resolve (no network), work from the local cache
    as HF_HUB_OFFLINE=1 does. Without it huggingface_hub retries each file five times (about 25 s a file) before
    it falls back to the cache or fails. Left to the user when they set HF_HUB_OFFLINE either way or a proxy
    (which resolves names itself), and once huggingface_hub is imported (it reads HF_HUB_OFFLINE then)."""
    if "HF_HUB_OFFLINE" in os.environ or any(os.environ.get(name) for name in PROXIES) \
            or "huggingface_hub" in sys.modules:
        return
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    if host and not resolves(host):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ[UNREACHABLE] = host


def resolves(host: str) -> bool:
    """Whether `host` resolves; a lookup still running after 3 seconds counts as yes (a slow network)."""
    result = {}

    def look_up():
        try:
            socket.getaddrinfo(host, 443)
            result["ok"] = True
        except OSError:
            result["ok"] = False

    thread = threading.Thread(target=look_up, daemon=True)
    thread.start()
    thread.join(3.0)
    return result.get("ok", True)


def offline_reason() -> str:
    """Why gorgon works from the local cache only: the unreachable Hub it found, or the user's HF_HUB_OFFLINE."""
    host = os.environ.get(UNREACHABLE)
    return f"the Hub's {host} does not resolve" if host else "HF_HUB_OFFLINE is set"


def offline_fix() -> str:
    """What turns the Hub back on: a network for the host gorgon found unreachable, else unsetting the user's
    HF_HUB_OFFLINE."""
    return "connect" if os.environ.get(UNREACHABLE) else "unset it"


def not_found_locally_or_on_hub(what: str, text: str, err: Exception) -> GorgonError:
    """The error for a name that is neither a local folder nor reachable on the hub."""
    problem = local_path_problem(text)
    if problem:
        return GorgonError(f"{what} {problem}: pass a folder")
    where = (f"the local hub cache ({offline_reason()})" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
             else "the hub (or it is unreachable)")
    return GorgonError(f"no {what} {text!r}: no local folder by that name, and {where} has none "
                       f"({err.__class__.__name__}): check the path or the hub id")


def resolve_heads_folder(name_or_path: str | os.PathLike) -> Path:
    """A local heads folder (with its config.json) as is; anything else is a hub repo id, fetched to the hub
    cache: only the files any heads folder gorgon reads may hold (its own, an engine's layout with sharded
    weights, FasterDecoding's .pt)."""
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise GorgonError(f"{path} has no {CONFIG_NAME}: it is not a heads folder (train heads with "
                              "train/heads.py or pass the folder that `save_pretrained` wrote)")
        return path
    text = str(name_or_path)
    problem = local_path_problem(text)
    if problem:
        raise GorgonError(f"heads {problem}: pass a folder written by save_pretrained or a hub id like user/repo")
    if looks_like_path(text) or text.count("/") != 1:
        raise GorgonError(f"no heads at {text}: pass a folder written by save_pretrained or a hub id like user/repo")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=[CONFIG_NAME, "*.md", *loaded_files()]))
    except Exception as err:  # the hub client raises many types; all mean "not reachable or not there"
        raise not_found_locally_or_on_hub("heads", text, err) from err


def is_hub_id(name: str) -> bool:
    """Whether `name` is a Hub repo id (and not a folder on this machine)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if looks_like_path(name) or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_repo_id(repo_id: str, setting: str) -> None:
    """The Hub's rules for a repo id, checked without the network: a training run that uploads at the end
    learns of a malformed one before it trains, not after."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise GorgonError(f"{setting} {repo_id!r} is not a Hub repo id: pass user/name (or org/name) of letters, "
                          "digits, -, _ and .") from err


def upload_folder(folder: str | os.PathLike, repo_id: str, private: bool = False, revision: str | None = None,
                  commit_message: str = "Upload gorgon heads", local: bool = True,
                  replacing: dict[str, str] | None = None, card_if_missing: str | None = None) -> str:
    """Create the repo if needed and upload a folder in one commit (training checkpoints left out),
    removing the repo's `loaded_files()` that the folder does not have. `local`: the folder is the user's (a
    failure says it is unchanged), not a temporary one. `replacing`: texts uploaded in place of some of its
    files (a card made for the repo), which stay as they are in the folder. `card_if_missing`: a model card
    uploaded where the repo has none (one there, a training run's, is not replaced)."""
    from huggingface_hub import HfApi, is_offline_mode

    kept = f"; the local folder {folder} is unchanged" if local else ""
    if is_offline_mode():  # huggingface_hub's own line says to unset HF_HUB_OFFLINE, which gorgon may have set
        raise GorgonError(f"upload to {repo_id} needs the Hub, but {offline_reason()}{kept}: {offline_fix()}, then "
                          "retry")
    api = HfApi()
    with tempfile.TemporaryDirectory() as staged:
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            if card_if_missing and "README.md" not in api.list_repo_files(repo_id, revision=revision):
                replacing = {**(replacing or {}), "README.md": card_if_missing}
            if replacing:
                folder = linked_copy(Path(folder), Path(staged), replacing)
            info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                                     commit_message=commit_message, ignore_patterns=["checkpoints/*", ".*"],
                                     delete_patterns=loaded_files())
        except Exception as err:
            reason = str(err).strip().split("\n")[0] or err.__class__.__name__
            raise GorgonError(f"upload to {repo_id} failed ({reason}){kept}: {upload_fix(err)}") from err
    return str(getattr(info, "commit_url", info))


def linked_copy(folder: Path, staged: Path, replacing: dict[str, str]) -> Path:
    """`folder` as links to its files in `staged` (nothing large is copied; checkpoints are left out), with the
    texts of `replacing` written in place of those files."""
    for path in folder.rglob("*"):
        name = path.relative_to(folder)
        if path.is_file() and name.parts[0] != "checkpoints" and name.as_posix() not in replacing:
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            (staged / name).symlink_to(path.resolve())
    for name, text in replacing.items():
        (staged / name).write_text(text, encoding="utf-8")
    return staged


def check_can_upload(setting: str) -> None:
    """Before long work that ends in an upload (`setting` names the option that asks for it): fail now, not after
    it, when the Hub is switched off (HF_HUB_OFFLINE) or no login is found."""
    from huggingface_hub import get_token, is_offline_mode

    later = f"or drop {setting} and upload the result with `gorgon push` afterwards"
    if is_offline_mode():
        raise GorgonError(f"{setting} uploads the result at the end, but {offline_reason()}: {offline_fix()}, {later}")
    if get_token() is None:
        raise GorgonError(f"{setting} uploads the result at the end, but no Hub login was found: log in with `hf auth "
                          f"login` (or set HF_TOKEN), {later}")


def upload_fix(err: Exception) -> str:
    """What to do about a failed upload, by what failed: the repo id, the login, the Hub, or the connection."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    if isinstance(err, HFValidationError):
        return "pass the repo id as user/name (or org/name)"
    if getattr(getattr(err, "response", None), "status_code", None) in (401, 403):
        return "log in with `hf auth login` (or set HF_TOKEN) as a user with write access to the repo, and retry"
    if isinstance(err, HfHubHTTPError):
        return "retry; if it fails again, check the repo on the Hub"
    return "check the connection to the Hub (and HF_ENDPOINT, if set), then retry"


class PushToHubMixin:
    """`push_to_hub` for anything with `save_pretrained(folder)`: save to a temporary folder, upload it."""

    def push_to_hub(self, repo_id: str, private: bool = False, revision: str | None = None,
                    commit_message: str = "Upload gorgon heads") -> str:
        """Upload to the Hub in one commit; returns the commit URL. What `save_pretrained` writes, and a short
        model card where the repo has none (`model_card`): `gorgon push FOLDER` uploads a training run's folder
        with its full card, metrics and plot."""
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return upload_folder(tmp, repo_id, private=private, revision=revision, commit_message=commit_message,
                                 local=False, card_if_missing=self.model_card(repo_id))
