"""A distilled draft model's model card."""

from __future__ import annotations

from ...card import batch_section, card_metadata, data_line, speed_section
from ...target import hub_name


def draft_vocab_line(metrics: dict) -> str:
    """The card's sentence on the saved draft vocabulary, if the draft has one (older metrics lack the keys)."""
    size = metrics.get("draft_vocab_size")
    if not size:
        return ""
    share = metrics["draft_vocab_coverage"]
    return (f"\nIn gorgon it drafts from its {size} most frequent answer tokens (`draft_vocab.safetensors`), through "
            f"an output layer cut to them: they are {share['train']:.1%} of the training answers' tokens and "
            f"{share['held_out']:.1%} of the held-out ones.\n")


def draft_card(ref: str, recipe: dict, metrics: dict, hub: dict) -> str:
    """A distilled draft model's card: what it started from, how close it follows the target, usage. Its
    base_model is the model it was distilled from (the target, when cut from the target's own layers)."""
    target_name = metrics["target_name"]
    base = hub_name(target_name)
    before, after, tau = metrics["before"], metrics["after"], metrics["expected_tau"]
    beta, lmbda = recipe["beta"], recipe["lmbda"]
    divergence = {0.0: "forward KL", 1.0: "reverse KL"}.get(beta, f"generalised JSD (beta {beta})")
    policy = f", {lmbda:.0%} of batches answered by the draft itself" if lmbda else ""
    how = (f"It was distilled with gorgon (trl GKD, {divergence}{policy}{', LoRA merged' if recipe['lora'] else ''},\n"
           f"{metrics['steps']} steps) on {data_line(recipe, metrics)}." if metrics["steps"] else
           "It is not distilled: saved with `--max_steps 0`, as the baseline that distillation is measured against.")
    tags = ["speculative-decoding", "draft-model", "distillation"]
    return f"""{card_metadata(hub, "transformers", tags)}

# Draft model for {target_name}

A {metrics['student_parameters'] / 1e6:.1f}M-parameter draft model for speculative decoding with {target_name}
({metrics['target_parameters'] / 1e6:.1f}M). It started from {metrics['student']}.
{how}

Speculative decoding with it gives exactly the target's own output; the draft only sets the speed.
{draft_vocab_line(metrics)}
## How closely it follows the target

On {metrics['eval_conversations']} held-out conversations ({metrics['eval_tokens']} answer tokens):

| | KL(target \\|\\| draft) | top-1 agreement | expected tokens per step ({metrics['draft_tokens']} drafted) |
|---|---|---|---|
| before distillation | {before['kl']:.3f} | {before['top1']:.3f} | {tau['before']:.2f} |
| after distillation | {after['kl']:.3f} | {after['top1']:.3f} | {tau['after']:.2f} |

Expected tokens per step assume each drafted token matches independently with the top-1 agreement.

## Speed

{speed_section(metrics.get('bench'), '--draft', ref)}{batch_section(metrics.get('batch_bench'))}

## Use

```bash
gorgon generate --draft {ref} --draft-tokens {metrics['draft_tokens']} --prompt "Hello"
```

In transformers' own assisted generation:
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
target = AutoModelForCausalLM.from_pretrained("{base}")
draft = AutoModelForCausalLM.from_pretrained("{ref}")
tok = AutoTokenizer.from_pretrained("{ref}")
ids = tok.apply_chat_template([{{"role": "user", "content": "Hello"}}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
out = target.generate(**ids, assistant_model=draft, do_sample=False, max_new_tokens=128)
```

In vLLM:
```python
from vllm import LLM
llm = LLM(model="{base}", speculative_config={{"model": "{ref}",
                                                "num_speculative_tokens": {metrics['draft_tokens']}}})
```
"""
