"""LoRA adapters on the native transformer, in peft's conventions (`lora:` in the config).

A targeted `nn.Linear` becomes a `LoraLinear`: the same frozen weight (and bias), plus `lora_A`
(r, in) and `lora_B` (out, r) in fp32, and `y = W x + b + scaling * B A dropout(x)` with
`scaling = alpha / r` (`alpha / sqrt(r)` with rsLoRA), computed in fp32 and rounded once, as peft
does. A starts as peft's Kaiming-uniform draw and B as zeros, so a new adapter changes nothing.
Only the adapters train (AdamW steps the fp32 tensors directly: no masters are needed).

The reference model of a LoRA run is the same model with its adapters switched off
(`adapters_off`): no second copy in memory. The rollout engine samples from a merged copy
(`lora_merged.MergedWeights`), which the trainer's forward computes with too.

On disk an adapter is peft's format: `adapter_config.json` and `adapter_model.safetensors`, keys
`base_model.model.<module>.lora_A.weight`, which `peft.PeftModel.from_pretrained` loads onto the
base model, and which `load_adapters` reads back (a run's checkpoint, or any peft LoRA adapter).
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastgrpo.file_modes import make_readable
from fastgrpo.models.lora_train import lora_linear, takes
from fastgrpo.models.packed import packed_linear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"
MERGE_BLOCK = 1 << 24  # fp32 values of W + s B A computed at once (64 MiB) while merging


class LoraError(ValueError):
    """A LoRA setting or adapter file that cannot be used; the message says what to change."""


@dataclass
class LoraSettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    use_rslora: bool = False
    modules_to_save: list[str] = field(default_factory=list)  # trained whole (embeddings, head)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def peft_config(self, base_model: str, modules: list[str]) -> dict:
        """adapter_config.json: what peft's LoraConfig reads (`modules`: the names adapted)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted({m.split(".")[-1] for m in modules}),
            "use_rslora": self.use_rslora,
            "bias": "none",
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "modules_to_save": list(self.modules_to_save) or None,
            "inference_mode": True,
        }

    @classmethod
    def from_peft_config(cls, data: dict) -> LoraSettings:
        if data.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"the adapter is {data.get('peft_type')}, not LoRA")
        unsupported = {
            key: data.get(key)
            for key in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                        "layers_to_transform")
            if data.get(key)
        }  # fmt: skip
        if data.get("bias", "none") != "none":
            unsupported["bias"] = data["bias"]
        if unsupported:
            raise LoraError(
                f"the adapter uses {', '.join(f'{k}={v}' for k, v in unsupported.items())}, "
                "which fastgrpo's LoRA does not support"
            )
        targets = data.get("target_modules") or [ALL_LINEAR]
        return cls(
            rank=int(data["r"]),
            alpha=float(data.get("lora_alpha", 8)),
            dropout=float(data.get("lora_dropout", 0.0)),
            target_modules=[targets] if isinstance(targets, str) else list(targets),
            use_rslora=bool(data.get("use_rslora", False)),
            modules_to_save=list(data.get("modules_to_save") or []),
        )


class LoraLinear(nn.Linear):
    """An nn.Linear (its weight and bias frozen) with a LoRA adapter: lora_A (r, in) and lora_B
    (out, r), fp32, trained. `enabled` False gives the base linear alone."""

    def __init__(self, base: nn.Linear, settings: LoraSettings, generator=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same tensors: nothing is copied
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, settings.rank, bias=False, device=device)
        self.lora_B = nn.Linear(settings.rank, self.out_features, bias=False, device=device)
        with torch.no_grad():  # peft's init: A Kaiming-uniform (a = sqrt 5), B zeros
            bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) for fan_in
            self.lora_A.weight.uniform_(-bound, bound, generator=generator)
            self.lora_B.weight.zero_()
        self.scaling = settings.scaling
        self.dropout = settings.dropout
        self.enabled = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * B A dropout(x) in fp32, (..., out): the plain path, where the in-GEMM one
        (`lora_train`) does not serve (dropout while training, a base weight that trains)."""
        x = x.to(self.lora_A.weight.dtype)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        return self.lora_B(self.lora_A(x)) * self.scaling

    def delta_of_swiglu(self, gate_up: torch.Tensor, inner: int) -> torch.Tensor:
        """`delta(silu(gate) * up)` for down_proj, whose input the fused MLP does not keep."""
        gate, up = gate_up.split(inner, dim=-1)
        return self.delta(F.silu(gate.float()) * up.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes([self]):  # the adapter inside the GEMM's Function (`lora_train`)
            return lora_linear(x, [self])
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return (out.float() + self.delta(x)).to(out.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B A, rounded once to the weight's dtype."""
        merged = torch.empty_like(self.weight)
        self.merge_into(merged)
        return merged

    @torch.no_grad()
    def merge_into(self, out: torch.Tensor, stochastic: bool = False) -> None:
        """out <- W + scaling * B A, computed in fp32 (one GEMM adding to W) and rounded once
        to out's dtype, in blocks of rows whose fp32 copy holds at most MERGE_BLOCK values.
        `stochastic` (bf16 out): each value rounds up with probability equal to its distance
        from the bf16 below, so the merged weights equal W + s B A in expectation and a small
        adapter change is not rounded away (as the trainer's bf16 refresh from its masters)."""
        rows = max(1, MERGE_BLOCK // self.in_features)
        for start in range(0, self.out_features, rows):
            end = min(start + rows, self.out_features)
            block = self.weight[start:end].to(torch.float32, copy=True)
            block.addmm_(self.lora_B.weight[start:end], self.lora_A.weight, alpha=self.scaling)
            if stochastic and out.dtype == torch.bfloat16:  # add 16 random low bits, cut them
                bits = block.view(torch.int32)
                bits.add_(torch.empty_like(bits).random_(0, 1 << 16)).bitwise_and_(-(1 << 16))
            out[start:end].copy_(block)


def lora_delta(x: torch.Tensor, linears: list[nn.Linear]) -> torch.Tensor | None:
    """The adapters' part (T, sum out) of several linears of one input x (a packed q/k/v or
    gate/up GEMM gives the rest), fp32; None when none of them has an enabled adapter."""
    if not any(isinstance(m, LoraLinear) and m.enabled for m in linears):
        return None
    parts = [
        m.delta(x)
        if isinstance(m, LoraLinear) and m.enabled
        else x.new_zeros(x.shape[0], m.out_features, dtype=torch.float32)
        for m in linears
    ]
    return torch.cat(parts, dim=-1)


def project(x: torch.Tensor, linears: list[nn.Linear], packed) -> torch.Tensor:
    """The packed GEMM of `linears` (`packed_linear`) with their adapters' parts: inside the
    GEMM's Function where `lora_train` serves them, else added in fp32 (`add_lora`)."""
    if takes(linears):
        return lora_linear(x, linears, packed)
    return add_lora(packed_linear(x, linears, packed), x, linears)


def add_lora(out: torch.Tensor, x: torch.Tensor, linears: list[nn.Linear]) -> torch.Tensor:
    """`out` (T, sum out), the base GEMM of `linears` on x, plus their adapters' part (fp32, one
    rounding), or `out` itself when none is enabled."""
    delta = lora_delta(x, linears)
    return out if delta is None else (out.float() + delta).to(out.dtype)


def target_names(model: nn.Module, targets: list[str]) -> list[str]:
    """The names of the nn.Linear modules `targets` selects, as peft matches them: a module whose
    name is a target or ends with "." + a target; "all-linear": every linear but the LM head."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise LoraError(f"lora.target_modules: '{ALL_LINEAR}' stands alone, not in a list")
        return [n for n in linears if n.split(".")[-1] != "lm_head"]
    chosen = [n for n in linears if any(n == t or n.endswith("." + t) for t in targets)]
    if not chosen:
        names = sorted({n.split(".")[-1] for n in linears})
        raise LoraError(
            f"lora.target_modules {targets} matches no linear layer of this model; its linears "
            f"are {', '.join(names)} (or use {ALL_LINEAR})"
        )
    return chosen


def add_adapters(model: nn.Module, settings: LoraSettings, seed: int = 0) -> list[str]:
    """Freeze `model` and give each targeted linear an adapter (in place); their names. The
    modules of `settings.modules_to_save` train whole; their original tensors are kept aside
    for the reference (`adapters_off`)."""
    if settings.rank < 1:
        raise LoraError(f"lora.rank is {settings.rank}; give a rank >= 1 (0 means no LoRA)")
    model.requires_grad_(False)
    names = target_names(model, settings.target_modules)
    device = next(model.parameters()).device  # a meta model (shapes only) draws nothing
    generator = torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)
    for name in names:
        _replace(model, name, LoraLinear(model.get_submodule(name), settings, generator))
    originals = {}
    for name in saved_module_names(model, settings.modules_to_save, exclude=names):
        for param in model.get_submodule(name).parameters():
            if id(param) not in originals:  # tied embeddings: one tensor, kept once
                originals[id(param)] = (param, param.detach().clone())
            param.requires_grad_(True)
    model.__dict__[SAVED_ORIGINALS] = list(originals.values())
    model.__dict__[_ADAPTED] = list(lora_modules(model).values())
    return names


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where the submodule `name` (dotted) is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


# (trained parameter, its base value) of modules_to_save
SAVED_ORIGINALS = "_fastgrpo_lora_originals"
_ADAPTED = "_fastgrpo_lora_adapted"  # the LoraLinear modules, listed once for `adapters_off`


def saved_module_names(model: nn.Module, targets: list[str], exclude=()) -> list[str]:
    """The modules `lora.modules_to_save` names (matched as peft matches them)."""
    if not targets:
        return []
    named = [n for n, m in model.named_modules() if n and list(m.parameters(recurse=False))]
    chosen = [n for n in named if any(n == t or n.endswith("." + t) for t in targets)]
    clash = sorted(set(chosen) & set(exclude))
    if clash:
        raise LoraError(f"{clash[0]} is both adapted and in lora.modules_to_save; choose one")
    if not chosen:
        raise LoraError(
            f"lora.modules_to_save {targets} matches no module of this model with its own "
            "weights (e.g. embed_tokens, lm_head)"
        )
    return chosen


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


@contextmanager
def adapters_off(model: nn.Module):
    """The base model inside the block (the LoRA reference): every adapter switched off, and the
    modules trained whole (`modules_to_save`) holding their original tensors. Called before
    every reference pass: the adapted modules are listed once (`add_adapters`), not found by a
    walk of the whole model each time, and `enabled` is set as the plain attribute it is."""
    modules = model.__dict__.get(_ADAPTED)
    if modules is None:
        modules = list(lora_modules(model).values())
    swapped = model.__dict__.get(SAVED_ORIGINALS, [])
    for m in modules:
        m.__dict__["enabled"] = False
    trained = [param.data for param, _ in swapped]
    for param, original in swapped:
        param.data = original
    try:
        yield model
    finally:
        for m in modules:
            m.__dict__["enabled"] = True
        for (param, _), data in zip(swapped, trained):
            param.data = data


# ----------------------------------------------------------------------------- files


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors (and those of the modules trained whole) under peft's saved names:
    the model's own, not copies."""
    out = {}
    for name, m in lora_modules(model).items():
        for part in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{name}.{part}.weight"] = getattr(m, part).weight.detach()
    for name, tensor in _saved_tensors(model).items():
        out[f"{PEFT_PREFIX}{name}"] = tensor.detach()
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`adapter_tensors` copied to the CPU, contiguous: what the adapter file holds."""
    return {k: t.to("cpu", copy=True).contiguous() for k, t in adapter_tensors(model).items()}


def _saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of the modules trained whole, by name (a tied tensor under each name
    peft would save it under: the embedding's, and the LM head's when it is listed too)."""
    trained = {id(param) for param, _ in model.__dict__.get(SAVED_ORIGINALS, [])}
    return {
        n: p
        for n, p in model.named_parameters(remove_duplicate=False)
        if id(p) in trained and ".lora_" not in n
    }


def save_adapters(model: nn.Module, settings: LoraSettings, folder, base_model: str) -> None:
    """Write the adapters in peft's format into `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = settings.peft_config(base_model, list(lora_modules(model)))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(adapter_state_dict(model), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    make_readable(folder / ADAPTER_WEIGHTS)


def is_adapter_folder(path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_settings(folder) -> LoraSettings:
    path = Path(folder) / ADAPTER_CONFIG
    try:
        return LoraSettings.from_peft_config(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        if isinstance(error, LoraError):
            raise LoraError(f"{path}: {error}") from None
        raise LoraError(f"{path} is not a readable peft LoRA config ({error})") from None


@torch.no_grad()
def load_adapters(model: nn.Module, folder) -> None:
    """Read an adapter folder's tensors into `model`'s adapters (added with its settings)."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise LoraError(f"{folder} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    saved = {_strip_adapter_name(k): v for k, v in load_file(str(path)).items()}
    targets = adapter_tensors(model)
    names_of: dict[int, list[str]] = {}  # a tied tensor may be saved under any of its names
    for key, tensor in targets.items():
        names_of.setdefault(tensor.data_ptr(), []).append(key)
    expected = set()
    for names in names_of.values():
        expected |= {n for n in names if n in saved} or {names[0]}
    missing, extra = sorted(expected - saved.keys()), sorted(saved.keys() - expected)
    if missing or extra:
        first = (missing or extra)[0]
        raise LoraError(
            f"{path} does not fit this model: {len(missing)} adapter tensor(s) missing and "
            f"{len(extra)} unexpected (e.g. {first}); load it onto the base model it was "
            "trained on"
        )
    for key, target in targets.items():
        tensor = saved.get(key)  # a tied tensor is read under the one name it was saved with
        if tensor is None:
            continue
        if tensor.shape != target.shape:
            raise LoraError(
                f"{path}: {key.removeprefix(PEFT_PREFIX)} is {tuple(tensor.shape)}, the "
                f"model's {tuple(target.shape)}; the rank or the base model differs"
            )
        target.copy_(tensor)


def _strip_adapter_name(key: str) -> str:
    """peft writes `...lora_A.weight`; some tools keep the adapter's name (`lora_A.default.`)."""
    for part in ("lora_A", "lora_B", "modules_to_save"):
        key = key.replace(f".{part}.default.", f".{part}.")
    return key.replace(".modules_to_save.", ".")


# ----------------------------------------------------------------------------- merging


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """`model` with every LoraLinear replaced by a plain linear holding its merged weight (in
    place; for export and evaluation)."""
    for name, m in list(lora_modules(model).items()):
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight = nn.Parameter(m.merged_weight(), requires_grad=False)
        if m.bias is not None:
            plain.bias = nn.Parameter(m.bias.detach(), requires_grad=False)
        _replace(model, name, plain)
    model.__dict__.pop(SAVED_ORIGINALS, None)  # the base values of modules_to_save: no use now
    model.__dict__.pop(_ADAPTED, None)
    return model
