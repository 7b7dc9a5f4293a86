"""Where one speculative step's time goes, against one plain decoding step, on the same cache.

    OMP_NUM_THREADS=1 python scripts/profile_step.py --heads runs/heads/smollm2-135m [--tree 16] [--dtype float32]
    OMP_NUM_THREADS=1 python scripts/profile_step.py --draft runs/drafts/smollm2-l6 --draft-tokens 3

Times each part of a step with the library's own functions (median of --repeat runs, cache of
--context tokens): the drafter's proposal (heads, or a draft model's chain with its own cache),
the verify forward, the target's lm_head over the tree, greedy acceptance, and the cache
compaction. Prints milliseconds and ratios to a plain step.
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from gorgon.decode.acceptance import accept_greedy
from gorgon.decode.cli import add_model_arguments, load_drafter, read_tree
from gorgon.decode.verify import crop_cache, keep_path, verify
from gorgon.heads.target import base_model, lm_logits


def median_ms(fn, repeat: int, reset) -> float:
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
        reset()
    return statistics.median(times[1:])  # the first run warms up


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    target, drafter = load_drafter(args, read_tree(args.tree))
    model = target.model
    tree = drafter.tree
    prompt = torch.randint(100, model.config.vocab_size, (1, args.context), device=model.device)
    results = {}
    with torch.inference_mode():
        cache = DynamicCache()
        hidden = base_model(model)(input_ids=prompt, past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
        root = lm_logits(model, hidden).argmax()

        def reset():
            crop_cache(cache, args.context)

        results["plain step (1 token + lm_head)"] = median_ms(
            lambda: lm_logits(model, base_model(model)(input_ids=root.view(1, 1), past_key_values=cache,
                                                       use_cache=True).last_hidden_state), args.repeat, reset)
        tokens = drafter.propose(root, hidden, prompt[0])
        results["drafter propose"] = median_ms(lambda: drafter.propose(root, hidden, prompt[0]), args.repeat, reset)
        results[f"verify forward ({tree.size} nodes)"] = median_ms(lambda: verify(model, cache, tokens, tree),
                                                                   args.repeat, reset)
        node_hidden = verify(model, cache, tokens, tree)
        reset()
        results["target lm_head over the tree"] = median_ms(lambda: lm_logits(model, node_hidden), args.repeat, reset)
        logits = lm_logits(model, node_hidden)
        results["greedy acceptance"] = median_ms(lambda: accept_greedy(tree, tokens, logits), args.repeat, lambda: None)
        path, _ = accept_greedy(tree, tokens, logits)
        nodes = torch.tensor(path, device=model.device)

        def compact():
            verify(model, cache, tokens, tree)
            start = time.perf_counter()
            keep_path(cache, args.context, nodes)
            return (time.perf_counter() - start) * 1000

        compact_times = []
        for _ in range(args.repeat):
            compact_times.append(compact())
            reset()
        results["cache compaction"] = statistics.median(compact_times)
    plain = results["plain step (1 token + lm_head)"]
    spec = sum(v for k, v in results.items() if not k.startswith("plain"))
    print(f"{model.dtype}, {torch.get_num_threads()} thread(s), cache of {args.context} tokens, tree of {tree.size}")
    for name, ms in results.items():
        print(f"  {name:<36} {ms:7.1f} ms  {ms / plain:5.2f}x plain")
    print(f"  {'speculative step, total':<36} {spec:7.1f} ms  {spec / plain:5.2f}x plain"
          f"  -> break-even tau {spec / plain:.2f}")


if __name__ == "__main__":
    main()
