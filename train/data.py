"""`gorgon data`: the frozen target answers prompts, and its answers become the training set.

Heads learn what the target itself would say next, so the data is the target's own output
(as Medusa-2 and EAGLE-3 regenerate theirs). Work is written in shards as it goes
(`OUT.partial/shard-NNNNN.jsonl`, each renamed into place when complete), so a killed run
rerun with the same command picks up where it stopped. Several shards are answered in one
continuously batched call, so the batch stays full across shard boundaries; each prompt samples
from its own seed, so the result equals an uninterrupted run however the calls fall. At the end
the shards become a `datasets` dataset at OUT with `id` and `messages` columns, plus
`gorgon_data.json` recording target and settings.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gorgon.decode.kernels import KERNELS, use_cpu_kernels
from gorgon.heads.command import ArgumentParser, int_at_least, user_path
from gorgon.heads.errors import GorgonError, first_problem
from gorgon.heads.files import atomic_write_text, naming_failed_writes, read_jsonl
from gorgon.heads.outputs import changed_settings, check_output, check_unlocked, holding, move_into_place, staging
from gorgon.heads.quantize import quantization, scheme_problem
from gorgon.heads.target import Target, context_length, fits_context, load_target, resolve_device, resolve_dtype

from .batching import continuous_generate
from .recipe import in_checkout
from .records import METADATA_NAME, damaged_data, from_hub, is_dataset, load_conversations

# Prompts per continuously batched call, in batches: the batch drains only at the end of a call,
# so the fewer calls, the fuller the batch (128 ShareGPT prompts at batch 32: one call was 1.29x
# faster than two of 64), at the cost of redoing up to one call's work after a kill.
BATCHES_PER_CALL = 8
LOCK = ".gorgon-data.lock"  # in OUT.partial while a run writes it: this machine and the process's id


@dataclass
class DataSettings:
    """Everything that decides the output; a resumed run must use the same."""

    prompts: str
    target: str | None = None
    limit: int | None = None
    max_new_tokens: int = 512
    batch_size: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    turns: str = "first"          # first | all
    max_prompt_tokens: int | None = None  # skip longer prompts (training windows would cut their answers)
    batch_tokens: int = 32768     # at most this many padded tokens (prompt + answer) in one batch
    shard_size: int = 64
    chat_template: str | None = None
    engine: str = "transformers"  # transformers | vllm
    dtype: str = "auto"           # the target's: recorded as resolved (float32 on a CPU, bfloat16 on CUDA)
    quantize: str = "none"        # the target's weights (gorgon.heads.quantize): none, int4, int8, w8a8, w4a8


def row_seed(*parts) -> int:
    """A prompt's own sampling seed, from the run's seed and where the prompt sits in the run."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


class Engine:
    """Generation with transformers, continuously batched (train/batching.py).

    On the CPU the linear layers run on the prepacked oneDNN kernels by default (decode/kernels.py):
    a 32-row decoding step was 8% faster and a prefill 13% (embedded target, one thread)."""

    def __init__(self, target: Target, settings: DataSettings, cpu_kernels: str = "fast"):
        self.model, self.tok, self.s = target.model, target.tokenizer, settings
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.eos = self.model.generation_config.eos_token_id
        self.eos = set(self.eos if isinstance(self.eos, list) else [self.eos])
        if self.model.device.type == "cpu":
            use_cpu_kernels(self.model, cpu_kernels)

    def generate(self, prompts: list[list[int]], seeds: list[int], on_batch=None, temperature: float | None = None,
                 max_new_tokens: int | None = None) -> list[list[int]]:
        """Completions (EOS dropped) for token-id prompts, in the given order; `seeds`: one per prompt."""
        with torch.inference_mode():
            return continuous_generate(
                self.model, prompts, max_new_tokens=max_new_tokens or self.s.max_new_tokens, eos=self.eos,
                pad=self.pad, batch_size=self.s.batch_size, batch_tokens=self.s.batch_tokens,
                temperature=self.s.temperature if temperature is None else temperature, top_p=self.s.top_p,
                seeds=seeds, on_done=on_batch)


class VllmEngine(Engine):
    """The same contract through vLLM (run on its CPU build: install gorgon into vLLM's environment).

    Prompts, settings, shards and resume are shared with `Engine`; only `generate` differs.
    vLLM loads the weights itself, so once the fingerprint is taken the transformers copy is
    moved to the meta device (its config stays, its memory goes): one copy of the target.
    """

    def __init__(self, target: Target, settings: DataSettings):
        check_vllm()
        import vllm

        super().__init__(target, settings, cpu_kernels="stock")  # vLLM runs its own copy of the weights
        target.fingerprint  # noqa: B018 -- computed from the weights before they are released
        source = target.model.name_or_path
        target.model.to("meta")
        self.llm = vllm.LLM(model=source, seed=settings.seed, dtype=settings.dtype)
        self.vllm = vllm

    def generate(self, prompts, seeds, on_batch=None, temperature=None, max_new_tokens=None):
        params = [self.vllm.SamplingParams(temperature=self.s.temperature if temperature is None else temperature,
                                           top_p=self.s.top_p, seed=seed,
                                           max_tokens=max_new_tokens or self.s.max_new_tokens) for seed in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result = [[t for t in o.outputs[0].token_ids if t not in self.eos] for o in outs]
        if on_batch:
            on_batch(len(prompts), sum(map(len, result)))
        return result


def chat_ids(tok, messages: list[dict], template: str | None) -> list[int]:
    """The prompt's token ids under the chat template (`template`, else the tokenizer's); a template that fails
    (a syntax error, or its own raise_exception for these messages) is one line."""
    from jinja2 import TemplateError

    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                       chat_template=template)["input_ids"]
    except TemplateError as err:
        which = "--chat-template" if template else "the tokenizer's chat template"
        raise GorgonError(f"{which} failed ({type(err).__name__}: {' '.join(str(err).split())}): fix the "
                          "template, or pass another with --chat-template FILE") from err


def answer_conversations(engine: Engine, convs: list[dict], positions: list[int], settings: DataSettings,
                         context: int | None, on_batch=None) -> list[tuple[dict | None, int]]:
    """Regenerate the assistant turns of some conversations, round by round so each round is one call.

    `positions`: where each conversation sits in the run, which seeds its sampling. Returns, per
    conversation, its record (None when no turn was answered) and how many of its user turns were
    skipped as too long (for the context or for --max-prompt-tokens).
    """
    tok, template = engine.tok, settings.chat_template
    histories = [([{"role": "system", "content": c["system"]}] if c["system"] else []) for c in convs]
    rounds = max(len(c["turns"]) for c in convs) if settings.turns == "all" else 1
    alive = [True] * len(convs)
    skipped = [0] * len(convs)
    for r in range(rounds):
        batch, owners = [], []
        for i, c in enumerate(convs):
            if alive[i] and r < len(c["turns"]):
                ids = chat_ids(tok, histories[i] + [{"role": "user", "content": c["turns"][r]}], template)
                too_long = settings.max_prompt_tokens and len(ids) > settings.max_prompt_tokens
                if too_long or not fits_context(context, len(ids), settings.max_new_tokens):
                    skipped[i] = len(c["turns"]) - r if settings.turns == "all" else 1
                    alive[i] = False
                    continue
                batch.append(ids)
                owners.append(i)
        if not batch:
            break
        seeds = [row_seed(settings.seed, positions[i], r) for i in owners]
        for i, completion in zip(owners, engine.generate(batch, seeds, on_batch)):
            histories[i] += [{"role": "user", "content": convs[i]["turns"][r]},
                             {"role": "assistant", "content": tok.decode(completion, skip_special_tokens=True)}]
    return [({"id": c["id"], "messages": h} if any(m["role"] == "assistant" for m in h) else None, n)
            for c, h, n in zip(convs, histories, skipped)]


def user_prefix(tokenizer) -> str:
    """The chat template's text up to where a user message begins (what Magpie feeds the model)."""
    marker = "\u2063GORGON\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise GorgonError("the chat template does not place the user message verbatim, so `self` prompts cannot be "
                          "drawn from it: pass --prompts with a file instead")
    return text[: text.index(marker)]


def self_prompts(engine: Engine, settings: DataSettings, count: int, progress: bool = True) -> list[dict]:
    """User turns written by the target itself from its template's user prefix (Magpie), deduplicated; a
    progress bar of their own (on stderr) while they are written, before the answers' bar."""
    from tqdm.auto import tqdm

    prefix = engine.tok(user_prefix(engine.tok), add_special_tokens=False)["input_ids"]
    seen, convs = set(), []
    bar = tqdm(total=count, unit="prompt", desc="gorgon data: writing prompts", disable=not progress,
               dynamic_ncols=True)
    for attempt in range(1, 11):  # duplicates are dropped, so draw again for the shortfall
        need = count - len(convs)
        if need <= 0:
            break
        seeds = [row_seed(settings.seed, "self", attempt, j) for j in range(need)]
        for tokens in engine.generate([prefix] * need, seeds, temperature=settings.temperature or 1.0,
                                      max_new_tokens=min(128, settings.max_new_tokens),
                                      on_batch=lambda n_prompts, _: bar.update(n_prompts)):
            text = engine.tok.decode(tokens, skip_special_tokens=True).strip()
            key = " ".join(text.lower().split())
            if len(key) >= 8 and key not in seen:
                seen.add(key)
                convs.append({"id": f"self-{len(convs)}", "system": None, "turns": [text]})
        bar.n = len(convs)  # the distinct ones: a repeat is drawn again
        bar.refresh()
    bar.close()
    if len(convs) < count:
        print(f"gorgon data: the target wrote {len(convs)} distinct prompts of the {count} asked for (in 10 rounds of "
              "drawing, the others repeated one or were under 8 characters); raise --temperature for more variety",
              file=sys.stderr)
    return convs[:count]


def check_settings(partial: Path, record: dict, restart: bool, fingerprints: tuple[str, ...] = ()) -> None:
    """A resumed run must match the one that wrote the shards, otherwise the shards would mix: an
    unfinished run with other settings is an error, or with `restart` (--overwrite) is started over.

    `record` holds the settings and the prompts' hash, and the target's fingerprint once it has
    loaded (any of `fingerprints` matches it): the first call, before the target loads, fails fast; the
    one after records the run."""
    path = partial / "settings.json"
    if path.exists():
        diff = record_changes(json.loads(path.read_text()), record, fingerprints)
        if diff and not restart:
            raise GorgonError(f"{partial} holds an unfinished run with other settings ({', '.join(diff)}): rerun "
                              "with the same options to resume it, or pass --overwrite to start over")
        if diff:  # its shards, settings and prompts go; this run's lock stays
            for entry in partial.iterdir():
                if entry.name != LOCK:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    if not path.exists() and "fingerprint" in record:  # a new run, or one started over
        atomic_write_text(path, json.dumps(record, indent=1))


def record_changes(old: dict, new: dict, fingerprints: tuple[str, ...] = ()) -> list[str]:
    """How a run's record differs from one written earlier: its settings, the prompts' hash and, where
    both have it, the target's fingerprint, any the target answers to (`fingerprints`) counting as its
    own (a record from before a key existed is not checked for it)."""
    diff = changed_settings(old["settings"], new["settings"])
    if old.get("prompts_sha256", new["prompts_sha256"]) != new["prompts_sha256"] and "limit" not in diff:
        diff.append("prompts_sha256 (the prompts' contents)")  # another --limit takes other prompts: not said
    if "fingerprint" in old and "fingerprint" in new and old["fingerprint"] not in (new["fingerprint"], *fingerprints):
        diff.append("target fingerprint")
    return diff


def prompts_hash(convs: list[dict] | None) -> str | None:
    """The prompts' contents, so an edited prompts file is not mistaken for the one a run started
    from; None for prompts the target writes (kept in the unfinished run itself)."""
    if convs is None:
        return None
    return hashlib.sha256(json.dumps(convs, sort_keys=True).encode()).hexdigest()


def is_complete(out: Path) -> bool:
    """Whether a dataset folder holds every file its state.json lists. A dataset moved into an existing empty
    folder puts its metadata there first (so a kill then leaves a folder gorgon knows as its own), and the
    data after it."""
    try:
        files = json.loads((out / "state.json").read_text())["_data_files"]
        return (out / "dataset_info.json").is_file() and all((out / f["filename"]).is_file() for f in files)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def in_dataset(path: Path) -> bool:
    """A file `gorgon data` (or `datasets`) writes in a dataset folder: --overwrite removes these, and no other."""
    return any(fnmatch.fnmatch(path.name, name) for name in (METADATA_NAME, "dataset_info.json", "state.json",
                                                              "data-*-of-*.arrow", "cache-*.arrow"))


def read_metadata(folder: str | os.PathLike) -> dict | None:
    """What `gorgon data` recorded beside a dataset (target, fingerprint, settings, counts); None for other data."""
    path = Path(folder) / METADATA_NAME
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise damaged_data(folder, f"{METADATA_NAME} cannot be read: {first_problem(err)}") from err
    if not isinstance(meta, dict):
        raise damaged_data(folder, f"{METADATA_NAME} is not a JSON object")
    return meta


def describe(folder: str | os.PathLike) -> str:
    """The data as a model card names it: the folder, and its size and prompts when `gorgon data` wrote it."""
    meta = read_metadata(folder)
    line = f"`{folder}`"
    if meta is not None:
        line += (f": {meta['conversations']} conversations answered by the target itself "
                 f"(`gorgon data`, prompts `{meta['settings']['prompts']}`)")
    return line


def hub_datasets(source: str) -> list[str]:
    """The Hub datasets training data came from, for a model card's `datasets:` metadata (the Hub links the
    model to them): the data itself when read from the Hub (it was read, so it is one), and the prompts `gorgon
    data` answered when it recorded them as a Hub dataset."""
    meta = read_metadata(source) or {}
    return ([source] if from_hub(source) else []) + ([meta["settings"]["prompts"]] if meta.get("prompts_from_hub")
                                                    else [])


@contextlib.contextmanager
def shards_said_on_ctrl_c(partial: Path):
    """Ctrl-C says how many shards `partial` keeps for the rerun to go on from."""
    try:
        yield
    except KeyboardInterrupt:
        shards = len(list(partial.glob("shard-*.jsonl")))
        if shards:
            print(f"\ngorgon data: the {shards} shard(s) finished so far are kept in {partial}: rerun the same "
                  "command to go on from them", file=sys.stderr)
        raise


def check_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise GorgonError("--engine vllm needs vLLM: `pip install vllm`, or use --engine transformers")


def check_data_settings(settings: DataSettings, out: Path) -> None:
    """The settings' ranges and combinations, before anything is read or loaded."""
    from gorgon.decode.acceptance import Sampling

    if settings.turns not in ("first", "all"):
        raise GorgonError(f"--turns must be 'first' or 'all', not {settings.turns!r}")
    for name in ("batch_size", "shard_size", "batch_tokens", "max_new_tokens", "limit", "max_prompt_tokens"):
        if getattr(settings, name) is not None and getattr(settings, name) < 1:  # limit and max_prompt_tokens: None
            raise GorgonError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(settings, name)}")
    Sampling(settings.temperature, 0, settings.top_p)  # the range check of temperature and top-p
    if settings.top_p != 1.0 and settings.temperature == 0 and settings.prompts != "self":
        raise GorgonError(f"--top-p {settings.top_p} samples, and --temperature 0 answers greedily: pass a "
                          "--temperature above 0 too, or drop --top-p")
    problem = scheme_problem(settings.quantize)
    if problem:
        raise GorgonError(f"--quantize {problem}")
    if settings.engine == "vllm" and settings.quantize != "none":
        raise GorgonError("--quantize quantizes the transformers engine's target: drop it with --engine vllm, or "
                          "pass vLLM a checkpoint already quantized as --target")
    if settings.engine == "vllm":
        check_vllm()
    if settings.prompts == "self" and not settings.limit:
        raise GorgonError("--prompts self needs --limit N: how many prompts the target should write")
    if os.path.exists(settings.prompts) and os.path.realpath(out) == os.path.realpath(settings.prompts):
        raise GorgonError(f"--out {out} is the --prompts path: choose another --out")


def make_dataset(settings: DataSettings, out: str | os.PathLike, target: Target | None = None,
                 progress: bool = True, overwrite: bool = False, cpu_kernels: str = "fast",
                 device: str = "auto") -> Path:
    """Generate the self-distillation dataset at `out`; resumes from `out`.partial when present.

    `out` must be new, an empty folder, or a dataset gorgon data wrote, which is replaced only
    with `overwrite`: the output is swapped in whole, so a folder of other files is refused."""
    out = Path(os.path.abspath(out))  # `.` has no name to put OUT.partial beside it under
    check_data_settings(settings, out)
    dtype = target.model.dtype if target else resolve_dtype(settings.dtype, resolve_device(device))
    resolved = {"dtype": str(dtype).removeprefix("torch.")}  # auto: by device
    if target is not None:  # what was passed is what answers
        resolved["quantize"] = quantization(target.model)
    settings = DataSettings(**{**asdict(settings), **resolved})
    convs = None if settings.prompts == "self" else load_conversations(settings.prompts, settings.limit)
    # The CPU kernels round differently, which can resolve a near-tie the other way: a resume keeps them too.
    kernels = cpu_kernels if settings.engine == "transformers" else None
    record = {"settings": {**asdict(settings), "cpu_kernels": kernels}, "prompts_sha256": prompts_hash(convs),
              "prompts_from_hub": convs is not None and from_hub(settings.prompts)}
    partial = out.parent / f"{out.name}.partial"  # the unfinished run, resumed from here
    cut_short = is_dataset(out) and not is_complete(out)  # killed while moving in: made again from the shards
    if is_dataset(out) and not overwrite and not cut_short:
        diff = record_changes(read_metadata(out), record)
        if diff:
            raise GorgonError(f"{out} holds a dataset made with other settings ({', '.join(diff)}): pass --overwrite "
                              "to regenerate it, or choose another --out")
        if (partial / "settings.json").is_file() and not record_changes(json.loads(
                (partial / "settings.json").read_text()), record):  # a run killed right after its swap
            check_unlocked(partial / LOCK, "gorgon data run")  # not one that --overwrite regenerates
            shutil.rmtree(partial)
        print(f"gorgon data: {out} is already complete; pass --overwrite to regenerate it")
        return out
    replace = check_output(out, is_dataset, overwrite or cut_short, own_entry=in_dataset)
    check_partial(partial, record, overwrite)
    template = None
    if settings.chat_template:
        if not Path(settings.chat_template).is_file():
            raise GorgonError(f"chat template {settings.chat_template} not found: pass a Jinja file")
        template = Path(settings.chat_template).read_text()
    # The lock refuses a second `gorgon data` into the same --out, which would race this one (at the final swap,
    # or --overwrite starting the shards over); settings or shards stay, to resume; a finished run removes it all.
    with holding(partial / LOCK, "gorgon data run"), shards_said_on_ctrl_c(partial):
        target = target or load_target(settings.target, device=device, dtype=settings.dtype,
                                       quantize=settings.quantize)
        tok = target.tokenizer
        if template is None and not getattr(tok, "chat_template", None):
            raise GorgonError(f"the tokenizer of {target.name} has no chat template: pass --chat-template FILE (Jinja)")
        chat_ids(tok, [{"role": "user", "content": "Hello"}], template)  # a broken template fails before any work
        context = context_length(target.model)
        if context is not None and settings.max_new_tokens >= context:  # before the run's settings are written
            raise GorgonError(f"--max-new-tokens {settings.max_new_tokens} leaves no room for a prompt in the "
                              f"context of {context} tokens: lower it")
        engine_settings = DataSettings(**{**asdict(settings), "chat_template": template})
        engine = (VllmEngine(target, engine_settings) if settings.engine == "vllm"
                  else Engine(target, engine_settings, cpu_kernels))
        check_settings(partial, {**record, "fingerprint": target.fingerprint}, restart=overwrite,
                       fingerprints=target.fingerprints)
        if convs is None:
            prompts_file = partial / "self_prompts.jsonl"
            if not prompts_file.exists():
                written = self_prompts(engine, engine_settings, settings.limit, progress)
                atomic_write_text(prompts_file, "".join(json.dumps(c) + "\n" for c in written))
            convs = read_jsonl(prompts_file)
        start = time.perf_counter()
        tokens = answer_shards(engine, engine_settings, convs, partial, context, progress)
        rows, skipped = read_shards(partial, math.ceil(len(convs) / settings.shard_size))
        if not rows:  # shards of skipped turns only: nothing for a corrected rerun to go on from
            shutil.rmtree(partial)
            if settings.max_prompt_tokens:
                raise GorgonError(f"no prompt fit --max-prompt-tokens {settings.max_prompt_tokens} and the context of "
                                  f"{context} tokens with --max-new-tokens {settings.max_new_tokens}: raise "
                                  "--max-prompt-tokens, lower --max-new-tokens or use shorter prompts")
            raise GorgonError(f"no prompt fit the context of {context} tokens with --max-new-tokens "
                              f"{settings.max_new_tokens}: lower --max-new-tokens or use shorter prompts")
        metadata = {"target": target.name, "target_fingerprint": target.fingerprint, **record,
                    "conversations": len(rows), "skipped_turns_too_long": skipped}
        write_dataset(rows, metadata, out, replace)
        shutil.rmtree(partial)
        secs = time.perf_counter() - start
        turns = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in rows)
        print(f"gorgon data: {len(rows)} conversations ({turns} answers) written to {out}; "
              f"{tokens} tokens generated this run in {secs:.1f} s ({tokens / max(secs, 1e-9):.1f} tokens/s); "
              f"{skipped} turns skipped as too long for the context or --max-prompt-tokens")
    return out


def check_partial(partial: Path, record: dict, overwrite: bool) -> None:
    """The folder an unfinished run keeps its shards in (`out`.partial): gorgon's own or absent, not another
    run's that is still going, and made with the same settings unless --overwrite starts it over."""
    if os.path.lexists(partial) and not partial.is_dir():
        raise GorgonError(f"{partial} is a file, where gorgon data keeps an unfinished run: move it away or choose "
                          "another --out")
    if partial.is_dir() and not (partial / "settings.json").is_file() \
            and any(entry.name != LOCK for entry in partial.iterdir()):
        raise GorgonError(f"{partial} holds files gorgon did not write, where it keeps an unfinished run: move them "
                          "away or choose another --out")
    check_unlocked(partial / LOCK, "gorgon data run")  # before --overwrite could start its shards over
    check_settings(partial, record, restart=overwrite)


def answer_shards(engine, settings: DataSettings, convs: list, partial: Path, context: int | None,
                  progress: bool) -> int:
    """Answer the conversations of every shard not yet in `partial`, a few shards per engine call, each shard
    written whole (so a killed run loses at most the call under way); returns the tokens generated."""
    from tqdm.auto import tqdm

    def shard_positions(i: int) -> range:
        return range(i * settings.shard_size, min((i + 1) * settings.shard_size, len(convs)))

    done = {p.name for p in partial.glob("shard-*.jsonl")}
    todo = [i for i in range(math.ceil(len(convs) / settings.shard_size)) if f"shard-{i:05d}.jsonl" not in done]
    start, tokens, answered = time.perf_counter(), 0, 0
    left = sum(len(shard_positions(i)) for i in todo)  # prompts not yet in a shard
    bar = tqdm(total=len(convs), unit="prompt", desc="gorgon data", disable=not progress, dynamic_ncols=True,
               initial=len(convs) - left)
    shown = {"saved": len(convs) - left}  # the bar's figures; saved: in shards, which a rerun keeps

    def on_batch(n_prompts: int, n_tokens: int) -> None:
        nonlocal tokens, answered
        tokens, answered = tokens + n_tokens, answered + n_prompts
        if settings.turns == "first":  # a finished answer is a finished conversation
            bar.update(n_prompts)
        else:  # turns: the bar moves per call
            shown["answers"] = answered
        shown["tok_per_s"] = f"{tokens / (time.perf_counter() - start):.1f}"
        bar.set_postfix(**shown)

    per_call = max(1, BATCHES_PER_CALL * settings.batch_size // settings.shard_size)
    for shards in (todo[k: k + per_call] for k in range(0, len(todo), per_call)):
        positions = [j for i in shards for j in shard_positions(i)]
        answers = dict(zip(positions, answer_conversations(engine, [convs[j] for j in positions], positions,
                                                           settings, context, on_batch)))
        for i in shards:
            shard = [answers[j] for j in shard_positions(i)]
            atomic_write_text(partial / f"shard-{i:05d}.jsonl",
                              json.dumps({"skipped": sum(n for _, n in shard)}) + "\n"
                              + "".join(json.dumps(r) + "\n" for r, _ in shard if r is not None))
        left -= len(positions)
        bar.n = shown["saved"] = len(convs) - left  # counts the skipped prompts too
        bar.set_postfix(**shown)
    bar.close()
    return tokens


def read_shards(partial: Path, n_shards: int) -> tuple[list[dict], int]:
    """The conversations in a run's shards, in prompt order, and how many turns were skipped as too long."""
    rows, skipped = [], 0
    for i in range(n_shards):
        header, *records = read_jsonl(partial / f"shard-{i:05d}.jsonl")
        skipped += header["skipped"]
        rows += records
    return rows, skipped


def write_dataset(rows: list[dict], metadata: dict, out: Path, replace: bool) -> None:
    """The dataset and its metadata, written beside `out` and moved into place (the metadata last), replacing
    the dataset there when `replace`. A run killed in between leaves the shards in `out`.partial, from which
    the rerun writes it again."""
    import datasets

    with staging(out, "writing") as staged:
        with naming_failed_writes(out):
            datasets.Dataset.from_list(rows).save_to_disk(str(staged))
        atomic_write_text(staged / METADATA_NAME, json.dumps(metadata, indent=1) + "\n")
        if replace:
            shutil.rmtree(out)
        move_into_place(staged, out, METADATA_NAME)


def parser() -> argparse.ArgumentParser:
    d = DataSettings(prompts="")  # the defaults, in one place
    p = ArgumentParser(
        prog="gorgon data",
        description="Self-distillation: the frozen target answers prompts; the answers become the heads' training "
                    "data (a `datasets` folder with a `messages` column). Rerun the same command to resume.")
    p.add_argument("--prompts", type=user_path, required=True,
                   help="a .jsonl/.json file (MT-Bench turns, ShareGPT conversations, "
                   "OpenAI messages, {prompt}, Alpaca), a dataset folder, a hub dataset name, or 'self' (the target "
                   "writes the prompts itself; needs --limit)")
    p.add_argument("--out", type=user_path, required=True, help="output dataset folder")
    p.add_argument("--target", type=user_path, default=None,
                   help="hub id or path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="use at most N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=d.max_new_tokens,
                   help=f"longest answer per turn (default {d.max_new_tokens})")
    p.add_argument("--batch-size", type=int_at_least(1), default=d.batch_size,
                   help=f"rows generated together (default {d.batch_size}); a finished row is replaced by a waiting "
                        "prompt")
    p.add_argument("--batch-tokens", type=int_at_least(1), default=d.batch_tokens,
                   help="most cache slots (rows x (longest prompt + answer)) in the batch, so long prompts run "
                        f"with fewer rows (default {d.batch_tokens})")
    p.add_argument("--max-prompt-tokens", type=int_at_least(1), default=None,
                   help="skip prompts longer than this (and count them): match your training max_length "
                        "(default: none skipped but those past the context)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=d.top_p, help="with --temperature, or for --prompts self (drawn at "
                   "temperature 1 when --temperature is 0): nucleus sampling (1, the default, is off)")
    p.add_argument("--seed", type=int, default=d.seed, help="sampling seed (also for --prompts self): each answer's "
                   "derives from it and the prompt's place in the run, so a resumed run samples what an uninterrupted "
                   "one would (default 0)")
    p.add_argument("--turns", choices=["first", "all"], default=d.turns,
                   help="answer the first user turn only (default), or every turn with the target's own earlier "
                        "answers")
    p.add_argument("--shard-size", type=int_at_least(1), default=d.shard_size,
                   help=f"conversations per resumable shard (default {d.shard_size}); shards are answered "
                        f"{BATCHES_PER_CALL} batches' worth of prompts at a time, so a kill loses up to that much work")
    p.add_argument("--chat-template", type=user_path, default=None,
                   help="a Jinja chat template file, for tokenizers without one")
    p.add_argument("--engine", choices=["transformers", "vllm"], default=d.engine,
                   help="transformers (default; continuous batching) or vllm (needs vLLM where gorgon is "
                        "installed: on a CPU, gorgon installed into the venv scripts/engines.sh builds for vLLM)")
    p.add_argument("--cpu-kernels", choices=KERNELS, default="fast",
                   help="on the CPU: fast (default: linear layers on weights prepacked for oneDNN, about 10%% faster "
                        "here) or stock (torch's default kernels); the answers are the target's either way, but "
                        "rounding differs, so a near-tie can resolve differently")
    p.add_argument("--device", default="auto", help="auto (default: cuda when there is a GPU, else cpu), cpu, cuda or "
                   "cuda:N")
    p.add_argument("--dtype", default=d.dtype,
                   help="the target's dtype: auto (default: bfloat16 on CUDA, float32 on a CPU), float32, bfloat16, "
                        "float16. bfloat16 on a CPU with AMX generated 1.77x the tokens per second of float32 at the "
                        "recipe's settings (the answers of the target in bfloat16; a resume in another dtype is "
                        "refused)")
    p.add_argument("--quantize", default=d.quantize,
                   help="the target's weights: none (default), int4, int8, w8a8 or w4a8, on the CPU "
                        "(gorgon.heads.quantize): the answers and features of the quantized target, for heads "
                        "that serve it (train with the same --quantize)")
    p.add_argument("--overwrite", action="store_true", help="regenerate a dataset gorgon data already wrote at --out")
    return p


def main(argv=None) -> int:
    args = vars(parser().parse_args(argv))
    out, overwrite = args.pop("out"), args.pop("overwrite")
    kernels, device = args.pop("cpu_kernels"), args.pop("device")
    make_dataset(DataSettings(**args), out, overwrite=overwrite, cpu_kernels=kernels, device=device)
    recipes = os.path.join(in_checkout("configs/heads"), "RECIPE.yaml")
    print(f"gorgon data: next, heads on it: accelerate launch -q --config_file "
          f"{in_checkout('configs/accelerate/cpu.yaml')} {in_checkout('train/heads.py')} --data {out} --out HEADS "
          f"(or gorgon train, one process; a recipe: --config {recipes})")
    return 0
