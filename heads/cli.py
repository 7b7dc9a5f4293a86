"""The `gorgon` command: one subcommand per stage, each dispatched to that stage's own `main`.

Stages are imported only when chosen, so `gorgon generate` never imports the training stack.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from .command import exit_status
from .hub import offline_if_hub_unreachable

COMMANDS = {
    "data": ("gorgon.train.data", "self-distillation: the target answers prompts; writes a datasets folder"),
    "train": ("gorgon.train.heads", "train Medusa or EAGLE heads from a YAML recipe, in one "
                                    "process (`accelerate launch train/heads.py` runs the same on several)"),
    "draft": ("gorgon.train.draft", "distil a small draft model, in one process (`accelerate launch train/draft.py` "
                                    "runs the same on several)"),
    "generate": ("gorgon.decode.cli", "generate with a target plus heads or a draft model, streaming accepted tokens"),
    "export": ("gorgon.heads.export", "write heads in a serving engine's format: Medusa (vLLM, TGI, TensorRT-LLM), "
                                      "EAGLE-3 (vLLM, SGLang), speculators"),
    "push": ("gorgon.heads.push", "upload a heads or draft folder (and its model card) to the Hugging Face Hub"),
    "bench": ("gorgon.decode.bench", "tau (tokens per target forward), tokens/s and speedup over plain generate, "
                                     "with an identical-output check"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return ("usage: gorgon COMMAND [options]   (gorgon COMMAND --help for its options; gorgon --version)\n\n"
            "commands:\n"
            + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"gorgon {version('gorgon')}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"gorgon: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    return exit_status(lambda: run_command(name, rest), f"gorgon {name}")  # Ctrl-C in its first seconds too


def run_command(name: str, argv: list[str]) -> int:
    offline_if_hub_unreachable()  # before the command's imports: huggingface_hub reads HF_HUB_OFFLINE once
    return importlib.import_module(COMMANDS[name][0]).main(argv)


if __name__ == "__main__":
    sys.exit(main())
