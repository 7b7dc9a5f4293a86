"""Where one speculative step's time goes, against one plain decoding step, on the same cache.

    OMP_NUM_THREADS=1 python scripts/profile_step.py --heads runs/heads/smollm2-135m [--tree 4] [--json]
    OMP_NUM_THREADS=1 python scripts/profile_step.py --heads ... --questions scripts/data/mt_bench.jsonl  # real text
    OMP_NUM_THREADS=1 python scripts/profile_step.py --draft runs/drafts/smollm2-l6 --draft-tokens 3
    OMP_NUM_THREADS=1 python scripts/profile_step.py --heads ... --cpu-kernels stock   # torch's stock CPU kernels
    python scripts/profile_step.py --random-target llama-8b/config.json --exit-layer 8 --tree 8  # self-speculation
    python scripts/profile_step.py --random-target llama-8b/config.json --tree 64 --dtype bfloat16 --json

Times each part of a step with the library's own functions (median of --repeat runs, cache of
--context tokens: random ones, or a real conversation with --questions): the drafter's proposal,
the verify forward (for self-speculation also with the draft's first layers reused: the step counts that
one), the target's greedy argmax over the tree (`gorgon.decode.argmax`), greedy
acceptance and the cache compaction (the proposal and the argmax each after a target forward, as in
decoding: timed back to back they found their weights in the CPU's caches, and the EAGLE
head's proposal looked 6.4 ms where, after a target forward, it took 9.4); and the cost of a forward
over each token count tree sizing times (1 to 16 on a CPU; the argmax included) relative to one.
`--json` prints one JSON line instead of the table:
{"plain_ms", "verify_ratio", "step_ratio", "tree_size", "kernels", "cpu_flags", ...}.
"""

import argparse
import json
from pathlib import Path

import torch

from gorgon.decode.acceptance import accept_greedy
from gorgon.decode.argmax import target_argmax
from gorgon.decode.attention import decoding_attention
from gorgon.decode.calibrate import cpu_flags, cpu_name, measure_verify_costs, median_ms
from gorgon.decode.kernels import kernels_in_use, stock_rows, use_cpu_kernels
from gorgon.decode.options import DecodeSettings, add_model_arguments, load_drafter, read_tree
from gorgon.decode.questions import load_questions
from gorgon.decode.verify import accepted_rows, features, keep_path, verify
from gorgon.heads import MedusaDrafter, MedusaHeads
from gorgon.heads.cache import crop_cache, growing_cache, with_cache
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.errors import GorgonError
from gorgon.heads.methods.self_spec import EarlyExit, SelfSpecDrafter
from gorgon.heads.quantize import quantize_model
from gorgon.heads.target import lm_logits, resolve_device, resolve_dtype


def profile(model, drafter, context: int, repeat: int, prompt: torch.Tensor | None = None) -> dict[str, float]:
    """Milliseconds of each part of one speculative step, and of a plain step, on a cache of `context`
    tokens: `prompt` (1, context) if given, else random tokens."""
    device, layers = model.device, drafter.feature_layers
    if prompt is None:
        prompt = torch.randint(0, model.config.get_text_config().vocab_size, (1, context), device=device)
    parts = {}
    cache = growing_cache()
    decoder = model.get_decoder()
    out = decoder(input_ids=prompt, **with_cache(decoder, cache), use_cache=True,
                  output_hidden_states=layers is not None)
    fresh = features(out, layers)
    root = lm_logits(model, out.last_hidden_state[0, -1]).argmax()
    shares_cache = hasattr(drafter, "attach_cache")  # self-speculation drafts into the target's cache
    if shares_cache:
        drafter.attach_cache(cache)

    def reset():
        crop_cache(cache, context)

    def timed(fn, reset=reset):
        return median_ms(fn, repeat, reset, device)

    parts["plain step (1 token + lm_head)"] = timed(
        lambda: lm_logits(model, decoder(input_ids=root.view(1, 1), **with_cache(decoder, cache),
                                         use_cache=True).last_hidden_state))
    tokens, tree = drafter.propose(root, fresh, prompt[0])  # a drafter with a cache takes in the prompt here
    hidden_states = layers is not None

    def target_forward():  # as in decoding: the target's forward between two proposals or two argmaxes
        reset()                                             # (after a self-speculation draft's entries)
        verify(model, cache, tokens, tree, hidden_states)   # reads every weight, so the drafter's and the
        reset()                                             # output layer's leave the CPU's caches

    parts["drafter propose"] = timed(lambda: drafter.propose(root, fresh[-1:], prompt[0]), target_forward)
    parts[f"verify forward ({tree.size} nodes)"] = timed(lambda: verify(model, cache, tokens, tree, hidden_states))
    if shares_cache:  # the same tree verified from the draft's layer-N states: the later layers alone where it can
        def redraft():
            reset()
            drafter.propose(root, fresh[-1:], prompt[0])

        redraft()
        parts[f"verify forward ({tree.size} nodes), first layers reused"] = timed(
            lambda: verify(model, cache, tokens, tree, drafted=drafter.drafted), redraft)
        reset()
    node_hidden = verify(model, cache, tokens, tree).last_hidden_state[0]
    reset()
    parts["target argmax over the tree"] = timed(lambda: target_argmax(model, node_hidden), target_forward)
    best = target_argmax(model, node_hidden)
    parts["greedy acceptance"] = timed(lambda: accept_greedy(tree, tokens, best), lambda: None)
    path, _ = accept_greedy(tree, tokens, best)
    nodes = accepted_rows(path, device)

    def reverify():  # each compaction needs a freshly verified tree in the cache
        reset()
        verify(model, cache, tokens, tree)

    verify(model, cache, tokens, tree)
    parts["cache compaction"] = timed(lambda: keep_path(cache, context, nodes), reverify)
    reset()
    return parts


def random_target(args):
    """A target built from a config with random weights, and random heads with the asked-for tree."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(args.device)
    if not Path(args.random_target).is_file():
        raise GorgonError(f"--random-target {args.random_target} is not a file: pass a model's config.json")
    config = AutoConfig.from_pretrained(args.random_target)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(args.dtype, device)).eval()
    quantize_model(model, args.quantize)
    use_cpu_kernels(model, args.cpu_kernels)
    tree = read_tree(args.tree)
    if args.exit_layer:  # self-speculation: the target's own first N layers draft, with a random exit over the
        vocab = config.get_text_config().vocab_size  # first 32k tokens (EAGLE-3's draft vocabulary size)
        exit_ = EarlyExit.for_target(model, args.exit_layer, draft_tokens=torch.arange(min(32000, vocab)))
        return model, SelfSpecDrafter(exit_, nodes=tree if isinstance(tree, int) else None)
    return model, MedusaDrafter(MedusaHeads.for_target(model, num_heads=4), None if tree == "auto" else tree)


def conversation(target, questions: str, length: int) -> torch.Tensor:
    """(1, length) ids: the file's first question under the chat template, then the target's greedy answer."""
    ids = target.chat_ids([{"role": "user", "content": load_questions(questions, 1)[0]["turns"][0]}])
    if ids.shape[1] >= length:
        return ids[:, :length]
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=length - ids.shape[1],
                                min_new_tokens=length - ids.shape[1], do_sample=False)
    return out[:, :length]


def main():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, sampling=False, generates=False)
    p.add_argument("--random-target", metavar="CONFIG",
                   help="instead of --heads/--draft: build the target from this config.json with random weights, "
                        "with 4 random Medusa heads (costs need no real weights, e.g. an 8B-shaped Llama)")
    p.add_argument("--exit-layer", type=int_at_least(1), default=None,
                   help="with --random-target: a self-speculation draft from its first N layers (a random exit) "
                        "instead of Medusa heads, to see what verifying with the draft's layers reused saves")
    p.add_argument("--context", type=int_at_least(1), default=256, help="cached tokens before the step (default 256)")
    p.add_argument("--questions", default=None,
                   help="cache a real conversation instead of random tokens: the first question of this .jsonl "
                        "(e.g. scripts/data/mt_bench.jsonl) and the target's greedy answer, --context tokens in "
                        "all. On random tokens an EAGLE head is unsure and drafts a smaller tree than in use")
    p.add_argument("--repeat", type=int_at_least(1), default=15,
                   help="timed runs per figure; the median is kept (default 15)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = p.parse_args()
    if args.exit_layer and not args.random_target:
        p.error("--exit-layer builds a random exit on --random-target: a trained one loads with --heads")
    if args.questions and args.random_target:
        p.error("--questions needs a real target's tokenizer: it does not go with --random-target")
    if args.random_target:
        model, drafter = random_target(args)
    elif args.heads or args.draft or args.context_draft:
        target, drafter = load_drafter(DecodeSettings.from_args(args))
        model = target.model
    else:
        p.error("one of --heads, --draft, --context-draft or --random-target is required")
    prompt = conversation(target, args.questions, args.context) if args.questions else None
    with torch.inference_mode(), decoding_attention(model.device):  # the attention decoding runs on
        parts = profile(model, drafter, args.context, args.repeat, prompt)
    costs = measure_verify_costs(model, context=args.context, repeat=args.repeat)
    plain = parts["plain step (1 token + lm_head)"]
    verifies = [k for k in parts if k.startswith("verify forward")]  # the step counts the last: with reuse, if any
    spec = sum(v for k, v in parts.items() if not k.startswith("plain") and (k not in verifies or k == verifies[-1]))
    kernels = kernels_in_use(model) if model.device.type == "cpu" else "cuda"
    if args.json:
        print(json.dumps({
            "plain_ms": round(plain, 3),
            "verify_ratio": {str(n): round(ms / costs[1], 3) for n, ms in costs.items()},
            "step_ratio": round(spec / plain, 3), "tree_size": drafter.max_nodes, "kernels": kernels,
            "stock_rows": stock_rows(model),
            "cpu_flags": cpu_flags(), "dtype": str(model.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "context": args.context,
            "cache": "conversation" if prompt is not None else "random tokens",
            "parts_ms": {k: round(v, 3) for k, v in parts.items()},
            "device": model.device.type if model.device.type == "cpu" else torch.cuda.get_device_name(model.device),
            "cpu": cpu_name(), "torch": torch.__version__}))
        return
    print(f"{model.dtype}, {torch.get_num_threads()} thread(s), {kernels} kernels "
          f"(products of up to {stock_rows(model)} rows on the stock kernel), "
          f"cache of {args.context} {'tokens of a conversation' if prompt is not None else 'random tokens'}, "
          f"tree of {drafter.max_nodes}; CPU flags: {' '.join(cpu_flags()) or '-'}")
    for name, ms in parts.items():
        print(f"  {name:<36} {ms:7.1f} ms  {ms / plain:5.2f}x plain")
    print(f"  {'speculative step, total':<36} {spec:7.1f} ms  {spec / plain:5.2f}x plain"
          f"  -> break-even tau {spec / plain:.2f}")
    print("forward over n tokens (greedy argmax included) / one token: "
          + ", ".join(f"{n}: {ms / costs[1]:.2f}x" for n, ms in costs.items()))


if __name__ == "__main__":
    run_script(main, "scripts/profile_step.py")
