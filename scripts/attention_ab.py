"""A verify forward with transformers' SDPA attention against gorgon's tree attention, interleaved.

    OMP_NUM_THREADS=1 python scripts/attention_ab.py [--target PATH] [--contexts 128 512 1024] [--nodes 8]

Both run on the CPU fast path's linear layers; only attention differs (`gorgon.decode.attention`:
key/value heads shared under the tree's mask instead of copied). Each round times one verify
forward over a tree of --nodes (a chain and branches), lm_head included, on a cache of each
--contexts size, first with one attention then the other; the medians are printed with the
ratio, the hidden states checked identical, and the CPU's flags.
"""

import statistics
import time

import torch
from transformers import DynamicCache

from gorgon.decode.attention import use_tree_attention
from gorgon.decode.calibrate import cpu_flags, cpu_name
from gorgon.decode.kernels import use_cpu_kernels
from gorgon.decode.verify import verify
from gorgon.heads import load_target
from gorgon.heads.cache import crop_cache, with_cache
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.methods.medusa.drafter import REFERENCE_ACCURACIES
from gorgon.heads.target import lm_logits
from gorgon.heads.tree import MAX_TREE_NODES, build_tree, tree_from_accuracies


@torch.inference_mode()
def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="hub id or local path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--contexts", type=int_at_least(1), nargs="+", default=[128, 512, 1024],
                   help="cache sizes to time at (default 128 512 1024)")
    p.add_argument("--nodes", type=int_at_least(2, MAX_TREE_NODES), default=8,
                   help="tree nodes verified per forward (default 8)")
    p.add_argument("--repeat", type=int_at_least(1), default=40,
                   help="timed rounds per cache size (default 40)")
    args = p.parse_args()
    target = load_target(args.target, device="cpu", dtype="float32")
    model, decoder = target.model, target.model.get_decoder()
    use_cpu_kernels(model, "fast")
    tree = build_tree(tree_from_accuracies(REFERENCE_ACCURACIES, args.nodes))
    tokens = torch.arange(10, 10 + tree.size)
    vocab = model.config.get_text_config().vocab_size
    print(f"{cpu_name()}; flags: {' '.join(cpu_flags()) or '-'}; {torch.get_num_threads()} thread(s)")
    print("| cache | transformers' SDPA (ms) | tree attention (ms) | ratio | identical |\n|---|---|---|---|---|")
    for context in args.contexts:
        prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
        cache = DynamicCache()
        decoder(input_ids=prompt, **with_cache(decoder, cache), use_cache=True)
        times, hidden = {False: [], True: []}, {}
        for round_ in range(args.repeat + 1):  # the first round warms up
            for tree_attention in (False, True):
                use_tree_attention(model, tree_attention)
                start = time.perf_counter()
                out = verify(model, cache, tokens, tree).last_hidden_state[0]
                lm_logits(model, out)
                elapsed = time.perf_counter() - start
                crop_cache(cache, context)
                hidden[tree_attention] = out
                if round_:
                    times[tree_attention].append(elapsed * 1000)
        sdpa, tree_ms = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {context} | {sdpa:.2f} | {tree_ms:.2f} | {sdpa / tree_ms:.3f}x | "
              f"{torch.equal(hidden[False], hidden[True])} |")


if __name__ == "__main__":
    run_script(main, "scripts/attention_ab.py")
