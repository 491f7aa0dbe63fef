"""Tiny Llama / Qwen2 checkpoints written offline, with controlled sparse task vectors.

Every agent is the base state dict plus deltas on explicit index sets ("regions"),
so each entry's status (unchanged, unique to one agent, shared) is known exactly and
the statistics of Eq. 2 can be written down in closed form from the region sizes.

Region values are chosen to be exact in bfloat16 and float32 where exactness matters:

* ``rand``: |delta| in [0.02, 0.06] on a base with |w| < 0.5, active for any
  epsilon below ~0.016 after rounding to the storage dtype;
* ``opp+`` / ``opp-``: base +-0.15625, delta +-2**-5 (exact: both agents' deltas
  cancel exactly in the mean);
* ``mid``: base +-(2**-6 + 2**-8), delta +-2**-12 ~ 2.4e-4 (active at epsilon 1e-5,
  inactive at 1e-3);
* ``sub``: base +-(2**-10 + 2**-12), delta +-2**-17 ~ 7.6e-6 (0 < |delta| <= 1e-5:
  must be dropped at the default epsilon; one bf16 ULP there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 48, 2, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS

# region -> {agent: kind}
# D changes exactly the entries unique to B (disjoint from A); E changes exactly the
# entries A changes by more than epsilon (identical support, other values).
REGIONS: Dict[str, Dict[str, str]] = {
    "A": {"A": "rand", "E": "rand"},
    "B": {"B": "rand", "D": "rand"},
    "AB": {"A": "rand", "B": "rand", "E": "rand"},
    "AC": {"A": "rand", "C": "rand", "E": "rand"},
    "BC": {"B": "rand", "C": "rand"},
    "ABC": {"A": "rand", "B": "rand", "C": "rand", "E": "rand"},
    "OPP": {"A": "opp+", "B": "opp-", "E": "rand"},
    "SUB_A": {"A": "sub"},
    "SUB_A_B": {"A": "sub", "B": "rand"},
    "MID_A": {"A": "mid", "E": "rand"},
    "MID_AB": {"A": "mid", "B": "mid", "E": "rand"},
}
FRACTIONS: Dict[str, float] = {
    "A": 0.08,
    "B": 0.02,
    "AB": 0.06,
    "AC": 0.03,
    "BC": 0.02,
    "ABC": 0.02,
    "OPP": 0.03,
    "SUB_A": 0.03,
    "SUB_A_B": 0.02,
    "MID_A": 0.03,
    "MID_AB": 0.02,
}
AGENTS = ("A", "B", "C", "D", "E")

OPP_BASE, OPP_DELTA = 0.15625, 2.0**-5
MID_BASE, MID_DELTA = 2.0**-6 + 2.0**-8, 2.0**-12
SUB_BASE, SUB_DELTA = 2.0**-10 + 2.0**-12, 2.0**-17

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def magnitude_of(kind: str) -> float:
    """The smallest |delta| an entry of this kind gets (for deciding activity)."""
    return {"rand": 0.015, "opp+": OPP_DELTA, "opp-": OPP_DELTA, "mid": MID_DELTA, "sub": SUB_DELTA}[kind]


def tensor_shapes(arch: str, tied: bool) -> Dict[str, Tuple[int, ...]]:
    """Tensor names and shapes of the tiny model, in checkpoint order."""
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "self_attn.q_proj.weight"] = (q, HIDDEN)
        if arch == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (q,)
        shapes[p + "self_attn.k_proj.weight"] = (kv, HIDDEN)
        if arch == "qwen2":
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
        shapes[p + "self_attn.v_proj.weight"] = (kv, HIDDEN)
        if arch == "qwen2":
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, q)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
        shapes[p + "mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
    shapes["model.norm.weight"] = (HIDDEN,)
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def make_config(arch: str, tied: bool, dtype: torch.dtype):
    import transformers

    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    else:
        raise ValueError(arch)
    cfg.dtype = DTYPE_NAMES[dtype]
    return cfg


#: Policy networks that are no transformers, for `mergekit-pytorch` (single files): an MLP actor-critic
#: (Stable-Baselines-like names) and a small CNN (4-D conv weights, batch-norm statistics).
MLP_SHAPES: Dict[str, Tuple[int, ...]] = {
    "pi.0.weight": (32, 12),
    "pi.0.bias": (32,),
    "pi.2.weight": (32, 32),
    "pi.2.bias": (32,),
    "pi.4.weight": (4, 32),
    "pi.4.bias": (4,),
    "v.0.weight": (32, 12),
    "v.0.bias": (32,),
    "v.2.weight": (1, 32),
    "v.2.bias": (1,),
    "log_std": (4,),
}
CNN_SHAPES: Dict[str, Tuple[int, ...]] = {
    "conv1.weight": (8, 3, 3, 3),
    "conv1.bias": (8,),
    "conv2.weight": (16, 8, 3, 3),
    "conv2.bias": (16,),
    "bn.weight": (16,),
    "bn.bias": (16,),
    "bn.running_mean": (16,),
    "bn.running_var": (16,),
    "fc.weight": (6, 64),
    "fc.bias": (6,),
}


class Family:
    """A base model and agents A..E (see REGIONS; C has no unique entry among A, B,
    C) and Z (identical to the base), all as in-memory state dicts, plus the regions.
    `shapes`: other tensors than the tiny transformer's (`MLP_SHAPES`, `CNN_SHAPES`)."""

    def __init__(
        self, arch: str, tied: bool, dtype: torch.dtype, seed: int, shapes: Optional[Mapping[str, Tuple[int, ...]]] = None
    ):
        self.arch, self.tied, self.dtype = arch, tied, dtype
        self.shapes = dict(shapes) if shapes is not None else tensor_shapes(arch, tied)
        gen = torch.Generator().manual_seed(seed)
        self.regions: Dict[str, Dict[str, torch.Tensor]] = {}
        base: Dict[str, torch.Tensor] = {}
        agents: Dict[str, Dict[str, torch.Tensor]] = {a: {} for a in AGENTS}
        for name, shape in self.shapes.items():
            numel = int(torch.Size(shape).numel())
            # base: |w| in [1/16, 1/2) with random sign, in float64 then stored dtype
            mag = torch.exp2(torch.empty(numel, dtype=torch.float64).uniform_(-4, -1, generator=gen))
            sign = torch.randint(0, 2, (numel,), generator=gen, dtype=torch.float64) * 2 - 1
            b64 = mag * sign
            perm = torch.randperm(numel, generator=gen)
            start = 0
            regions = {}
            for region, frac in FRACTIONS.items():
                size = int(frac * numel)
                regions[region] = perm[start : start + size].sort().values
                start += size
            self.regions[name] = regions
            # crafted base values where exactness matters
            for region, members in REGIONS.items():
                idx = regions[region]
                kinds = set(members.values())
                s = sign[idx]
                if kinds & {"opp+", "opp-"}:
                    b64[idx] = s * OPP_BASE
                elif "sub" in kinds:
                    b64[idx] = s * SUB_BASE
                elif "mid" in kinds:
                    b64[idx] = s * MID_BASE
            b = b64.to(dtype)
            base[name] = b.reshape(shape).contiguous()
            bstored = b.to(torch.float64)
            for agent in AGENTS:
                a64 = bstored.clone()
                for region, members in REGIONS.items():
                    kind = members.get(agent)
                    if kind is None:
                        continue
                    idx = regions[region]
                    n = idx.numel()
                    if n == 0:
                        continue
                    rs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
                    if kind == "rand":
                        delta = rs * torch.empty(n, dtype=torch.float64).uniform_(0.02, 0.06, generator=gen)
                    elif kind == "opp+":
                        delta = torch.full((n,), OPP_DELTA, dtype=torch.float64)
                    elif kind == "opp-":
                        delta = torch.full((n,), -OPP_DELTA, dtype=torch.float64)
                    elif kind == "mid":
                        delta = rs * MID_DELTA
                    elif kind == "sub":
                        delta = rs * SUB_DELTA
                    else:
                        raise ValueError(kind)
                    a64[idx] = bstored[idx] + delta
                stored = a64.to(dtype)
                # self-check: each planned delta survives rounding with the planned size
                realized = stored.to(torch.float64) - bstored
                for region, members in REGIONS.items():
                    idx = regions[region]
                    kind = members.get(agent)
                    got = realized[idx].abs()
                    if kind is None:
                        assert bool((got == 0).all()), (name, region, agent)
                    elif kind == "sub":
                        assert bool(((got > 0) & (got <= 1e-5)).all()), (name, region, agent)
                    elif kind == "mid":
                        assert bool((got == MID_DELTA).all()), (name, region, agent)
                    elif kind.startswith("opp"):
                        assert bool((got == OPP_DELTA).all()), (name, region, agent)
                    else:
                        assert bool((got >= 0.015).all()), (name, region, agent)
                untouched = torch.ones(numel, dtype=torch.bool)
                untouched[perm[:start]] = False
                assert bool((realized[untouched] == 0).all())
                agents[agent][name] = stored.reshape(shape).contiguous()
        self.base = base
        self.agents = agents
        self.agents["Z"] = {k: v.clone() for k, v in base.items()}

    def state_dict(self, who: str) -> Dict[str, torch.Tensor]:
        return self.base if who == "base" else self.agents[who]

    def expected_counts(self, merged: Sequence[str], epsilon: float = 1e-5) -> Dict[str, Tuple[int, int, int]]:
        """Closed form from the region sizes: agent -> (active, shared, unique)."""
        out = {}
        for agent in merged:
            active = shared = unique = 0
            for regions in self.regions.values():
                for region, members in REGIONS.items():
                    size = regions[region].numel()
                    if size == 0:
                        continue
                    on = [a for a in merged if a in members and magnitude_of(members[a]) > epsilon]
                    if agent not in on:
                        continue
                    active += size
                    if len(on) == 1:
                        unique += size
                    else:
                        shared += size
            out[agent] = (active, shared, unique)
        return out


def write_checkpoint(
    path: Path,
    config,
    state_dict: Mapping[str, torch.Tensor],
    *,
    shards: int = 1,
) -> Path:
    """config.json + model.safetensors (or N shards + model.safetensors.index.json)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    with open(path / "model.safetensors.index.json", "w") as fp:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fp, indent=2)
    return path


def write_family(
    root: Path,
    family: Family,
    who: Iterable[str] = ("base", "A", "B", "C", "D", "E", "Z"),
    *,
    shards: Optional[Mapping[str, int]] = None,
) -> Dict[str, Path]:
    """Write the chosen members under root/<name>; returns name -> absolute path."""
    config = make_config(family.arch, family.tied, family.dtype)
    paths = {}
    for name in who:
        n = (shards or {}).get(name, 1)
        paths[name] = write_checkpoint(Path(root) / name, config, family.state_dict(name), shards=n).resolve()
    return paths


def write_flat(
    root: Path,
    family: Family,
    who: Iterable[str] = ("base", "A", "B", "C"),
    *,
    fmt: str = "safetensors",
    extra: Optional[Mapping[str, torch.Tensor]] = None,
) -> Dict[str, Path]:
    """One file per member, as `mergekit-pytorch` takes them: root/<name>.safetensors, or a weights-only
    PyTorch pickle root/<name>.pt (`torch.save(state_dict)`); `extra` tensors (buffers) in every file."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in who:
        tensors = {**{k: v.contiguous() for k, v in family.state_dict(name).items()}, **dict(extra or {})}
        path = root / f"{name}.{'safetensors' if fmt == 'safetensors' else 'pt'}"
        if fmt == "safetensors":
            save_file(tensors, str(path))
        else:
            torch.save(tensors, str(path))
        paths[name] = path.resolve()
    return paths


def load_flat(path: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of a single weight file (safetensors or a PyTorch pickle)."""
    if str(path).endswith(".safetensors"):
        return load_file(str(path))
    return torch.load(str(path), weights_only=True)


def load_checkpoint(path: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (single file or shards)."""
    out: Dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def stored_dtypes(path: Path) -> Dict[str, torch.dtype]:
    return {k: v.dtype for k, v in load_checkpoint(path).items()}


def snapshot(paths: Iterable[Path]) -> Dict[str, Tuple[int, int]]:
    """Every file under the given folders, with size and mtime (ns)."""
    out = {}
    for p in paths:
        for root, _dirs, files in os.walk(p):
            for f in files:
                full = os.path.join(root, f)
                st = os.stat(full)
                out[full] = (st.st_size, st.st_mtime_ns)
    return out


def perturb(
    state_dict: Mapping[str, torch.Tensor], changes: Mapping[str, Mapping[int, float]]
) -> Dict[str, torch.Tensor]:
    """A copy of state_dict with flat entries set to base + delta (in float64, then
    rounded to the tensor's dtype)."""
    out = {k: v.clone() for k, v in state_dict.items()}
    for name, entries in changes.items():
        flat = out[name].view(-1)
        for index, delta in entries.items():
            flat[index] = (flat[index].double() + delta).to(flat.dtype)
    return out


def names_of(state_dict: Mapping[str, torch.Tensor]) -> List[str]:
    return [k for k, v in state_dict.items() if v.is_floating_point()]
