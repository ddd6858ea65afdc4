"""LoRA (Hu et al. 2021): train a low-rank update of chosen linear layers, W' = W + (alpha / r) B A, with W frozen.

The frozen weights need no gradient and no optimizer state: memory on a GPU, and on 2 CPU cores 1.15-1.4x per
SmolLM2-135M training step (all linear layers vs q_proj/v_proj, rank 8: docs/benchmarks.md).
A stage's outputs, and the weights RL sends to vLLM, are always the merged model: every later stage, vLLM and
`from_pretrained` read a plain Hugging Face directory.
"""
import math

import torch
import torch.nn.functional as F


from transformers.pytorch_utils import Conv1D

from runtime.models import DEFAULT_LORA_TARGETS

LINEAR_TYPES = (torch.nn.Linear, Conv1D)  # GPT-2's Conv1D is a linear layer with its weight stored as (in, out)


class LoRALinear(torch.nn.Linear):
    """A linear layer holding the original (frozen) weight and bias plus A (r x in) and B (out x r). B starts at
    zero, so the adapted model starts as the original. Parameter names and the weight's layout stay those of the
    original layer (nn.Linear's (out, in), or Conv1D's (in, out))."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float):
        torch.nn.Module.__init__(self)
        self.transposed = isinstance(base, Conv1D)
        # (from the layer's attributes: under ZeRO-3 its weight is a partition of any shape)
        self.in_features, self.out_features = (base.nx, base.nf) if self.transposed else (base.in_features,
                                                                                          base.out_features)
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = torch.nn.Parameter(torch.empty(rank, self.in_features, dtype=base.weight.dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(self.out_features, rank, dtype=base.weight.dtype))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear initialises its weight
        self.scale = alpha / rank

    def forward(self, x):
        weight = self.weight.T if self.transposed else self.weight
        return F.linear(x, weight, self.bias) + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def merged_weight(self) -> torch.Tensor:
        update = self.scale * self.lora_B @ self.lora_A
        return self.weight + (update.T if self.transposed else update)


def linear_layer_names(model) -> list[str]:
    """The names (last part of the module path) of the backbone's linear layers."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.base_model.named_modules() if isinstance(m, LINEAR_TYPES)})


def resolve_targets(model, targets: list[str] | str | None) -> list[str]:
    """The layer names `lora_targets` stands for: a list as given; `all-linear`, every linear layer of the
    backbone; null, the default of the model's architecture (DEFAULT_LORA_TARGETS)."""
    found = linear_layer_names(model)
    if targets == "all-linear":
        return found
    if targets is None:
        default = DEFAULT_LORA_TARGETS.get(model.config.model_type)
        if default is None:
            raise ValueError(f"lora_targets: no default for model_type {model.config.model_type!r}; name the layers "
                             f"(its linear layers are {found}) or use all-linear")
        return list(default)
    return list(targets)


def apply_lora(model, rank: int, alpha: float, targets: list[str] | str | None, train_head: bool) -> int:
    """Put adapters on the backbone's linear layers whose name (the last part of the module path) is in `targets`
    (see resolve_targets) and freeze every other parameter, except, with `train_head`, those outside the backbone (a
    reward model's or critic's freshly initialised score head). Returns the number of trainable parameters."""
    backbone = model.base_model
    targets = resolve_targets(model, targets)
    found = linear_layer_names(model)
    missing = sorted(set(targets) - set(found))
    if missing:
        raise ValueError(f"lora_targets {missing}: no linear layer of that name in the model; its linear layers "
                         f"are {found}")
    for p in model.parameters():
        p.requires_grad_(False)
    if train_head:
        in_backbone = {id(p) for p in backbone.parameters()}
        for p in model.parameters():
            if id(p) not in in_backbone:
                p.requires_grad_(True)
    for parent in list(backbone.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and type(child) in LINEAR_TYPES:
                setattr(parent, name, LoRALinear(child, rank, alpha))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter folded into its layer's weight (the adapters' own entries
    dropped): the keys and shapes of the model before `apply_lora`."""
    state = {name: t for name, t in model.state_dict().items() if not name.endswith((".lora_A", ".lora_B"))}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                state[f"{name}.weight"] = module.merged_weight()
    return state
