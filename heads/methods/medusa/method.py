"""Medusa heads on the registry: their recipe keys, training objective, loading, drafting and export."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...errors import GorgonError
from ...files import is_model_config
from .. import Method, Recipe, register, setting, vllm_serve
from . import formats
from .card import medusa_card
from .model import ADAPTER_DIR, NODES, TREES_NAME, MedusaHeads


@dataclasses.dataclass
class MedusaRecipe(Recipe):
    """The recipe keys of `arch: medusa`."""

    mode: str = setting("medusa1", "medusa: medusa1 (the target frozen) | medusa2 (LoRA on the target too)")
    num_heads: int = setting(4, "medusa: heads; the k-th drafts the token k places after the next one")
    num_layers: int = setting(1, "medusa: residual blocks per head")
    shared_lm_head: bool = setting(True, "medusa: heads project through the target's lm_head (false: own copies)")
    loss: str = setting("ce", "medusa: ce (the data's tokens) | kl (the target's own distribution)")
    backbone_learning_rate: float = setting(5e-5, "medusa2: the LoRA adapters' peak learning rate")
    heads_warmup_steps: int = setting(0, "medusa2: steps that train the heads alone before the adapters")
    base_kl_weight: float = setting(1.0, "medusa2: weight of the KL that keeps the target's own outputs")
    lora_r: int = setting(16, "medusa2: LoRA rank")
    lora_alpha: int = setting(32, "medusa2: LoRA alpha")
    lora_dropout: float = setting(0.0, "medusa2: LoRA dropout")
    lora_target_modules: list[str] = setting(help="medusa2: the target's linear layers that get adapters",
                                             factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self):
        for key, allowed in {"mode": ("medusa1", "medusa2"), "loss": ("ce", "kl")}.items():
            if getattr(self, key) not in allowed:
                raise GorgonError(f"{key} must be one of {', '.join(allowed)}, not {getattr(self, key)!r}")
        for key in ("num_heads", "num_layers"):
            if getattr(self, key) < 1:
                raise GorgonError(f"{key} must be at least 1, not {getattr(self, key)}")
        for key in ("heads_warmup_steps", "base_kl_weight"):
            if getattr(self, key) < 0:
                raise GorgonError(f"{key} must be at least 0, not {getattr(self, key)}")

    def check_with(self, shared) -> None:
        """The checks that read the shared keys too."""
        if shared.loss_tokens == "all" and self.loss == "ce":
            raise GorgonError("loss_tokens: all trains on the prompts' positions against the target's own "
                              "distribution there: use loss: kl (or arch: eagle), or loss_tokens: answers")
        if shared.cache_features and self.trains_target:
            raise GorgonError("cache_features keeps a frozen target's outputs, but mode medusa2 trains the target "
                              "(LoRA): use mode: medusa1, or cache_features: false")

    @property
    def trains_target(self) -> bool:
        """Medusa-2 trains LoRA adapters on the target beside the heads."""
        return self.mode == "medusa2"

    @property
    def rows(self) -> int:
        return self.num_heads

    @property
    def label(self) -> str:
        return self.mode

    @property
    def find_unused_parameters(self) -> bool:
        """Medusa-2's heads-only warmup leaves the adapters out of the loss, which DDP must be told."""
        return self.trains_target and self.heads_warmup_steps > 0

    def save_adapter(self, out: Path, target, state: dict) -> None:
        from ...files import follow_umask

        target.save_pretrained(str(out / ADAPTER_DIR), state_dict=state)
        follow_umask(out / ADAPTER_DIR)


def objective(recipe: MedusaRecipe, shared, target, draft_tokens):
    """Medusa heads for the target and their loss (Medusa-2: with LoRA adapters on the target)."""
    from ...feature_cache import FeatureCache
    from .objective import MedusaObjective

    heads = MedusaHeads.for_target(target.model, recipe.num_heads, recipe.num_layers, recipe.shared_lm_head,
                                   target.name, target.fingerprint).float()
    if draft_tokens is not None:
        heads.set_draft_vocab(draft_tokens)
    model = target.model
    if recipe.trains_target:
        from peft import LoraConfig, get_peft_model

        from ...target import quiet_peft

        with quiet_peft():
            model = get_peft_model(model, LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha,
                                                     lora_dropout=recipe.lora_dropout,
                                                     target_modules=recipe.lora_target_modules,
                                                     task_type="CAUSAL_LM"))
        heads.attach(model)
    cache = FeatureCache() if shared.cache_features else None
    return MedusaObjective(model, heads, recipe.mode, recipe.loss, shared.head_decay, recipe.base_kl_weight, cache)


def holds(folder: Path, config: dict) -> bool:
    """gorgon's own Medusa heads (a heads config without another method's `arch`), or vLLM's or FasterDecoding's."""
    if not isinstance(config, dict):
        return False
    if formats.foreign_format(folder, config) is not None:
        return True
    return not is_model_config(config) and config.get("arch", "medusa") == "medusa"


def drafter(heads, tree, depth, topk):
    from .drafter import MedusaDrafter

    check_options(None, depth, topk)
    return MedusaDrafter(heads, tree)


def chain(heads, length=None):
    from .drafter import MedusaDrafter

    return MedusaDrafter(heads, [[0] * n for n in range(1, (length or heads.config.num_heads) + 1)])


def check_options(name, depth=None, topk=None, draft_dtype="auto", level_cost=None) -> None:
    """Medusa heads draft every level in one forward from a fixed tree, in the target's dtype."""
    if depth is not None or topk is not None:
        raise GorgonError("--draft-depth and --draft-topk shape an EAGLE head's search; Medusa heads "
                          "draft one level per head: choose their tree with --tree")
    if draft_dtype != "auto":
        raise GorgonError(f"the heads in {name} keep the target's dtype (they read its hidden states): drop "
                          "--draft-dtype, which sets an EAGLE head's or a --draft model's")
    if level_cost not in (None, "auto"):
        raise GorgonError(f"the heads in {name} draft every level in one forward: --draft-level-cost has nothing "
                          "to stop (it applies to --draft and EAGLE heads)")


def adapter(folder: Path) -> Path | None:
    """A Medusa-2 folder's LoRA adapter, which changes the target the heads were trained on."""
    return folder / ADAPTER_DIR if (folder / ADAPTER_DIR).is_dir() else None


def serve(fmt: str, out: Path, base_model: str, heads, schedule=None) -> str:
    """The engine's command for an export, drafting one token a head (the commands of vLLM's and TGI's docs; TGI
    takes no draft length per batch size)."""
    if fmt == "medusa":
        return f"text-generation-launcher --model-id {out} (TGI; its config names the target)"
    spec = {"method": "medusa", "model": str(out), "num_speculative_tokens": heads.config.num_heads}
    return vllm_serve(base_model, spec, schedule)


def export_notes(folder: Path) -> list[str]:
    """Medusa-2: the export holds the heads, not the target's adapter."""
    lora = adapter(folder)
    if lora is None:
        return []
    return [f"these Medusa-2 heads were trained on the target with the LoRA adapter in {lora}: serve "
            "them on the target with it merged (peft's merge_and_unload), or they draft from hidden states they "
            "were not trained on (the output stays the target's; fewer drafts are accepted)"]


METHOD = register(Method(
    name="medusa", title="Medusa heads", holds=holds,
    load=lambda folder, target: MedusaHeads.from_pretrained(folder, target=target), module=MedusaHeads,
    drafter=drafter, chain=chain, check_options=check_options, adapter=adapter,
    files=(TREES_NAME, f"{ADAPTER_DIR}/", formats.MEDUSA_LEGACY),
    export=lambda heads, fmt, out, base_model, dtype: formats.export_heads(heads, fmt, out, base_model),
    export_formats=formats.FORMATS,
    export_help="'vllm' (vLLM's Medusa model) or 'medusa' (FasterDecoding Medusa, which TGI and TensorRT-LLM read)",
    serve=serve, export_notes=export_notes,
    card=lambda folder, ref, recipe, metrics, hub: medusa_card(ref, recipe, metrics, hub),
    rows=lambda k: f"head {k}",
    recipe=MedusaRecipe, objective=objective, nodes=NODES,
))
