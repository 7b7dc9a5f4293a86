"""`gorgon generate`: speculative generation from the command line, streaming accepted tokens."""

from __future__ import annotations

import argparse
import sys

import torch

from gorgon.heads.command import ArgumentParser
from gorgon.heads.errors import GorgonError

from .acceptance import Sampling
from .generate import ACCEPTANCE_RULES, check_stop_strings, chosen_sampling, speculative_generate
from .options import DecodeSettings, add_model_arguments, check_sampling_options, load_drafter


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="gorgon generate",
        description="Generate with a target and a drafter: its heads (Medusa or EAGLE), a draft "
                    "model, or prompt lookup (--context-draft). Greedy (the default) gives "
                    "exactly the target's own greedy output, only faster; sampling keeps the target's distribution "
                    "exactly.")
    add_model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message; the reply is streamed")
    src.add_argument("--chat", action="store_true", help="an interactive chat on stdin (empty line or Ctrl-D ends)")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="feed --prompt as is, without the chat template")
    p.add_argument("--acceptance", choices=ACCEPTANCE_RULES, default="exact",
                   help="exact (lossless; default) or typical (Medusa's typical acceptance: LOSSY, sampling only)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true",
                   help="print tau (tokens per target forward), target forwards and tokens/s to stderr")
    return p


class TextStream:
    """Prints the decoded text as tokens arrive, re-decoding so multi-token characters come out whole."""

    def __init__(self, tokenizer):
        # sys.stdout is read now, not when the module was imported: it may have been replaced since
        self.tokenizer, self.out, self.tokens, self.shown = tokenizer, sys.stdout, [], ""

    def __call__(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    # Every check that needs no model, before the target loads.
    check_sampling_options(args)
    chosen_sampling(None, Sampling(args.temperature), args.acceptance)
    check_stop_strings(args.stop)
    if args.system is not None and args.raw:
        raise GorgonError("--system goes through the chat template, which --raw skips: drop one of them")
    settings = DecodeSettings.from_args(args)
    target, drafter = load_drafter(settings)
    sampling = Sampling.like_generate(target.model, args.temperature, args.top_k, args.top_p)
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
            ids = target.chat_ids(messages)
        stream = TextStream(tok)
        result = speculative_generate(target.model, drafter, ids.to(target.model.device), args.max_new_tokens,
                                      sampling=sampling, acceptance=args.acceptance, stop_strings=args.stop,
                                      tokenizer=tok, generator=generator, streamer=stream)
        print(flush=True)
        if args.stats:
            reused = (f", {result.reused_rows} of {result.verified_rows} verified nodes reused the draft's first "
                      "layers" if result.verified_rows else "")  # self-speculation
            print(f"[{len(result.tokens)} tokens, {result.target_forwards} target forwards, tau (tokens per target "
                  f"forward) {result.tau:.2f}, "
                  f"{result.tokens_per_s:.1f} tokens/s{reused}]", file=sys.stderr)
        text = tok.decode(result.tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        return text

    if args.prompt is not None:
        reply(args.prompt)
        return 0
    typed = sys.stdin.isatty()
    if typed:
        print("gorgon generate: type a message and press Enter; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        if typed:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        reply(line.strip())
