"""The cost of a Medusa-1 training step against the frozen target forward alone.

    OMP_NUM_THREADS=1 python scripts/bench_train.py --data runs/data/smollm2-sharegpt [--batch-size 8]

Both run on the same batches of real training examples: (a) the target's forward under
inference mode, (b) a whole Medusa-1 step (that forward, the heads' loss, backward, AdamW).
Prints tokens/s of each, their ratio, and peak memory (max RSS on CPU, allocated on CUDA).
"""

import argparse
import resource
import statistics
import time

import torch

from gorgon.heads import MedusaHeads, load_target
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.methods.medusa.objective import medusa_loss
from gorgon.train.examples import collate, frequent_tokens, load_examples


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="`gorgon data` output folder, or a .jsonl/.json file of conversations")
    p.add_argument("--target", default=None, help="hub id or local path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="conversations per step (default 8)")
    p.add_argument("--max-length", type=int_at_least(2), default=512,
                   help="most tokens per conversation (default 512)")
    p.add_argument("--steps", type=int_at_least(1), default=6, help="timed steps of each kind (default 6)")
    p.add_argument("--draft-vocab-size", type=int_at_least(0), default=8192,
                   help="the heads' draft vocabulary (default 8192; 0: the full vocabulary)")
    args = p.parse_args()
    target = load_target(args.target)
    model = target.model.requires_grad_(False)
    examples = load_examples(args.data, target.tokenizer, args.max_length)
    if len(examples) < (args.steps + 1) * args.batch_size:
        p.error(f"--data has {len(examples)} conversations and a warm-up plus --steps {args.steps} batches of "
                f"--batch-size {args.batch_size} need {(args.steps + 1) * args.batch_size}: lower --steps or "
                "--batch-size")
    heads = MedusaHeads.for_target(model).float()
    if args.draft_vocab_size:
        heads.set_draft_vocab(frequent_tokens(examples, args.draft_vocab_size, heads.config.vocab_size)[0])
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3)
    pad = target.tokenizer.pad_token_id or 0
    batches = [collate(examples[i * args.batch_size:(i + 1) * args.batch_size], pad) for i in range(args.steps + 1)]
    batches = [{k: v.to(model.device) for k, v in b.items()} for b in batches]

    def forward_only(batch):
        with torch.inference_mode():
            model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    def medusa1_step(batch):
        with torch.inference_mode():
            hidden = model.get_decoder()(input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"]).last_hidden_state
        loss, _ = medusa_loss(heads, hidden.clone(), batch["input_ids"], batch["loss_mask"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    results = {}
    for name, fn in [("frozen forward", forward_only), ("Medusa-1 step", medusa1_step)]:
        fn(batches[0])  # warm-up
        times = []
        for batch in batches[1:]:
            start = time.perf_counter()
            fn(batch)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches[1:])
        results[name] = (tokens / sum(times), statistics.median(times))
    print(f"{model.dtype}, {torch.get_num_threads()} thread(s), batch {args.batch_size} x <= {args.max_length} tokens, "
          f"draft vocabulary {args.draft_vocab_size or 'full'}")
    for name, (tps, step) in results.items():
        print(f"  {name:<16} {tps:8.0f} tokens/s   {step:6.2f} s per batch")
    ratio = results["Medusa-1 step"][1] / results["frozen forward"][1]
    print(f"  Medusa-1 step / frozen forward: {ratio:.2f}x;  peak memory {peak_memory_mb(model.device):.0f} MB")


if __name__ == "__main__":
    run_script(main, "scripts/bench_train.py")
