"""How far two `gorgon data` outputs of the same prompts agree: two engines (`--engine transformers` and `vllm`),
two dtypes or kernels.

    gorgon data --prompts P --limit 64 --out runs/data/hf                  # greedy: the default temperature 0
    gorgon data --prompts P --limit 64 --out runs/data/vllm --engine vllm  # from vLLM's venv, gorgon installed there
    python scripts/data_agreement.py runs/data/hf runs/data/vllm

Answers are matched by conversation id and compared in the target's tokens: identical answers, and for the others
the token where they part (greedy answers part only where two tokens' logits are near a tie that the two engines'
kernels round apart, and everything after follows from that one token). A folder's settings that differ are
listed, so a comparison of unlike runs is plain. `--json` prints one JSON line.
"""

import json
import statistics
from pathlib import Path

from gorgon.heads.command import ArgumentParser, run_script, user_path
from gorgon.heads.errors import GorgonError


def answers(folder: str) -> tuple[dict, dict]:
    """A data folder's assistant turns by conversation id, and its gorgon_data.json settings."""
    import datasets

    path = Path(folder)
    if not (path / "gorgon_data.json").is_file():
        raise GorgonError(f"{folder} is not a `gorgon data` output (no gorgon_data.json): pass the --out of a run")
    about = json.loads((path / "gorgon_data.json").read_text())
    rows = datasets.load_from_disk(str(path))
    found = {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows}
    return found, about


def main():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first", type=user_path, help="a `gorgon data` output folder")
    p.add_argument("second", type=user_path, help="another, of the same prompts")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args()
    (a, about_a), (b, about_b) = answers(args.first), answers(args.second)
    if about_a["target_fingerprint"] != about_b["target_fingerprint"]:
        raise GorgonError(f"{args.first} and {args.second} come from different targets (fingerprints "
                          f"{about_a['target_fingerprint']} and {about_b['target_fingerprint']}): compare runs of one")
    shared = [i for i in a if i in b]
    if not shared:
        raise GorgonError(f"{args.first} and {args.second} answer no conversation in common: run both on the same "
                          "--prompts and --limit")
    from transformers import AutoTokenizer

    from gorgon.heads.target import target_source

    tok = AutoTokenizer.from_pretrained(target_source(about_a["settings"]["target"]))  # its tokens, not its weights
    parted, same = [], 0
    for i in shared:
        x = tok("".join(a[i]), add_special_tokens=False).input_ids
        y = tok("".join(b[i]), add_special_tokens=False).input_ids
        if x == y:
            same += 1
        else:
            parted.append(next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))))
    differ = sorted(k for k in set(about_a["settings"]) | set(about_b["settings"])
                    if about_a["settings"].get(k) != about_b["settings"].get(k))
    report = {"conversations": len(shared), "identical": same, "parted_at_tokens": parted,
              "median_parting_token": statistics.median(parted) if parted else None,
              "settings_that_differ": {k: [about_a["settings"].get(k), about_b["settings"].get(k)] for k in differ}}
    if args.json:
        print(json.dumps(report))
        return
    print(f"{same} of {len(shared)} answers identical" + (
        f"; the others part at answer token {', '.join(map(str, sorted(parted)))}" if parted else ""))
    for k, (x, y) in report["settings_that_differ"].items():
        print(f"  {k}: {x} / {y}")


if __name__ == "__main__":
    run_script(main, "scripts/data_agreement.py")
