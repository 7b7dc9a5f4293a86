"""`gorgon generate`: speculative generation from the command line, streaming accepted tokens."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from gorgon.heads import GorgonError, load_target
from gorgon.heads.errors import int_at_least
from gorgon.heads.files import not_found_locally_or_on_hub, read_text
from gorgon.heads.model import load_with_heads
from gorgon.heads.target import check_same_tokenizer

from .acceptance import Sampling
from .calibrate import verify_costs
from .drafters import DraftModelDrafter, HeadsDrafter
from .generate import speculative_generate
from .kernels import KERNELS, use_cpu_kernels
from .tree import best_tree_size


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gorgon generate",
        description="Generate with a target and its Medusa heads (or a draft model). Greedy (the default) gives "
                    "exactly the target's own greedy output, only faster; sampling keeps the target's distribution "
                    "exactly.")
    add_model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message; the reply is streamed")
    src.add_argument("--chat", action="store_true", help="an interactive chat on stdin (empty line or Ctrl-D ends)")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="feed --prompt as is, without the chat template")
    p.add_argument("--acceptance", choices=["exact", "typical"], default="exact",
                   help="exact (lossless; default) or typical (Medusa's typical acceptance: LOSSY, sampling only)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print tau, target forwards and tokens/s to stderr")
    return p


def add_model_arguments(p: argparse.ArgumentParser, drafter_required: bool = True) -> None:
    """What `gorgon generate` and `gorgon bench` share: the target, the drafter, the tree, sampling, device.

    --heads (Medusa heads) or --draft (a small model with the target's tokenizer): one is required.
    """
    p.add_argument("--target", default=None, help="hub id or local path of the target (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    group = p.add_mutually_exclusive_group(required=drafter_required)
    group.add_argument("--heads", help="heads folder or hub id (from train/heads.py or save_pretrained)")
    group.add_argument("--draft", help="a small draft model (hub id or path) sharing the target's tokenizer")
    p.add_argument("--draft-tokens", type=int_at_least(1), default=4,
                   help="tokens a --draft model proposes per step (default 4)")
    p.add_argument("--tree", default="auto", help="'auto' (the tree saved with the heads for this device, else a "
                   "default), a node count N (the best N-node tree from the heads' measured accuracies), or a JSON "
                   "file with a list of rank paths, e.g. [[0],[1],[0,0]]")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (default) is off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 (default) is off")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--cpu-kernels", choices=KERNELS, default="fast",
                   help="on the CPU: fast (default: linear layers on weights prepacked for oneDNN, so verifying a "
                        "few tokens costs about one step) or stock (torch's default kernels); ignored on CUDA")


def load_drafter(args, tree):
    """The target and the drafter the arguments name, on the chosen CPU kernels.

    With heads and `--tree auto`, the tree's size is chosen for this machine: from the heads'
    measured accuracies and the verify costs measured here (a few seconds, cached).
    """
    if args.draft and args.tree != "auto":
        raise GorgonError("--tree applies to --heads only: a --draft model proposes a chain of --draft-tokens")
    if args.heads:
        target, heads = load_with_heads(args.heads, args.target, device=args.device, dtype=args.dtype)
        use_cpu_kernels(target.model, args.cpu_kernels)
        if tree == "auto" and heads.trees.get("accuracies"):
            tree = best_tree_size(heads.trees["accuracies"][: heads.config.num_heads], verify_costs(target.model))
            print(f"gorgon: a {tree}-node tree fits this machine best (--tree N to choose another)", file=sys.stderr)
        return target, HeadsDrafter(heads, tree)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = load_target(args.target, device=args.device, dtype=args.dtype)
    try:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=target.model.dtype)
    except (OSError, ValueError) as err:
        raise not_found_locally_or_on_hub("draft model", args.draft, err) from err
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(args.draft)
    except (OSError, ValueError):
        draft_tokenizer = None  # weights only: the vocabulary size check below is all there is to go on
    if draft_tokenizer is not None:
        check_same_tokenizer(target.tokenizer, draft_tokenizer, f"draft {args.draft}")
    use_cpu_kernels(target.model, args.cpu_kernels)
    draft = draft.to(target.model.device).eval()
    use_cpu_kernels(draft, args.cpu_kernels)
    return target, DraftModelDrafter(draft, args.draft_tokens).check_vocab(target.model)


def read_tree(value: str):
    """'auto', a node count, or a JSON file of rank paths."""
    if value == "auto":
        return "auto"
    if value.isdigit():
        return int(value)
    path = Path(value)
    if not path.is_file():
        raise GorgonError(f"tree file {value} not found: pass 'auto' or a JSON file with a list of rank paths")
    try:
        paths = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise GorgonError(f"tree file {value} is not valid JSON ({err.msg}): "
                          "write a list like [[0],[1],[0,0]]") from err
    if not isinstance(paths, list) or not all(isinstance(x, list) for x in paths):
        raise GorgonError(f"tree file {value} must hold a list of rank paths like [[0],[1],[0,0]]")
    return paths


class TextStream:
    """Prints the decoded text as tokens arrive, re-decoding so multi-token characters come out whole."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.tokens, self.shown = tokenizer, out, [], ""

    def __call__(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    target, drafter = load_drafter(args, read_tree(args.tree))
    tok = target.tokenizer
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=target.model.device).manual_seed(args.seed)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def reply(user_text: str) -> str:
        if args.raw or not getattr(tok, "chat_template", None):
            ids = tok(user_text, return_tensors="pt").input_ids
        else:
            messages.append({"role": "user", "content": user_text})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            ids = ids["input_ids"]
        stream = TextStream(tok)
        result = speculative_generate(target.model, drafter, ids.to(target.model.device), args.max_new_tokens,
                                      sampling=sampling, acceptance=args.acceptance, stop_strings=args.stop,
                                      tokenizer=tok, generator=generator, streamer=stream)
        print(flush=True)
        if args.stats:
            print(f"[{len(result.tokens)} tokens, {result.target_forwards} target forwards, tau {result.tau:.2f}, "
                  f"{result.tokens_per_s:.1f} tokens/s]", file=sys.stderr)
        text = tok.decode(result.tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        return text

    if args.prompt is not None:
        reply(args.prompt)
        return 0
    for line in sys.stdin:
        if not line.strip():
            break
        reply(line.strip())
    return 0
