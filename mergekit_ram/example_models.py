"""Deterministic synthetic "RL-like" workloads: a base model plus sparse agents.

RL-trained agents differ from their base in a sparse, bf16-quantised set of
weights with heterogeneous densities and above-chance overlapping supports
(see the RAM paper, section 5).  This module writes such a base and agents as
ordinary Hugging Face folders, so the RAM/RAM+ merge method can be exercised,
tested and benchmarked end to end without downloading anything.

Everything is generated chunk by chunk and streamed straight into
safetensors files, so a ~1B-parameter workload needs only a few times the
memory of its largest tensor.  The same arguments always give byte-identical
files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "EXAMPLE_DENSITIES",
    "Workload",
    "build_workload",
    "write_example",
]

#: Agents of the README demo (name -> density), after the paper's Code/Tool/Memory.
EXAMPLE_DENSITIES: Mapping[str, float] = {"code": 0.03, "tool": 0.46, "memory": 0.54}

# Random numbers are drawn per chunk of this many (flattened) elements, each
# chunk with its own seed, so results do not depend on how work is batched.
_CHUNK = 1 << 22
# Tensors up to this size get an exact support size (the score is held in full
# to find its k-th value); bigger ones are thresholded chunk by chunk at the
# closed-form quantile of the score distribution (density exact in expectation).
_EXACT_LIMIT = 1 << 24

_BASE_STD = 0.02
_BIAS_STD = 0.01

# dtype -> (integer view, magnitude mask, smallest normal, largest finite,
#           bit steps per move, safetensors name)
_GRID = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x0080, 0x7F7F, 1, "BF16"),
    torch.float16: (torch.int16, 0x7FFF, 0x0400, 0x7BFF, 1, "F16"),
    # 2**13 float32 ULPs = a relative step of about 1e-3 (1/8 of a bf16 ULP).
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x00800000, 0x7F7FFFFF, 1 << 13, "F32"),
}
_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True)
class Workload:
    """Where a generated workload lives; the paths are model folders."""

    base: Path
    agents: dict[str, Path]
    num_parameters: int


# --------------------------------------------------------------------------- #
# Deterministic randomness
# --------------------------------------------------------------------------- #
def _generator(seed: int, *key: object) -> torch.Generator:
    """A generator whose seed depends on (seed, key) only, stable across runs."""
    text = "|".join(str(k) for k in (seed, *key)).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


def _chunks(numel: int) -> Iterator[tuple[int, int, int]]:
    """(chunk index, start, stop) over a flattened tensor."""
    for c, start in enumerate(range(0, numel, _CHUNK)):
        yield c, start, min(start + _CHUNK, numel)


def _uniform(seed: int, name: str, purpose: str, c: int, n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float32).uniform_(generator=_generator(seed, name, purpose, c))


def _base_chunk(seed: int, name: str, kind: str, c: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    if kind == "norm":
        return torch.ones(n, dtype=dtype)
    std = _BIAS_STD if kind == "bias" else _BASE_STD
    x = torch.empty(n, dtype=torch.float32).normal_(0.0, std, generator=_generator(seed, name, "base", c))
    return x.to(dtype)


def _score_chunk(seed: int, name: str, t: int, c: int, n: int, u: torch.Tensor, overlap: float) -> torch.Tensor:
    """overlap*u + (1-overlap)*v_t: low scores are updated; u is shared by all agents."""
    v = _uniform(seed, name, f"v{t}", c, n)
    return v.mul_(1.0 - overlap).add_(u, alpha=overlap)


def _score_quantile(density: float, overlap: float) -> float:
    """Closed-form density-quantile of a*U + b*V (U, V ~ U(0,1)), a trapezoid law."""
    p, q = sorted((overlap, 1.0 - overlap))
    if p < 1e-12:
        return q * density
    if density <= p / (2 * q):
        return math.sqrt(2 * p * q * density)
    if density <= 1 - p / (2 * q):
        return q * density + p / 2
    return p + q - math.sqrt(2 * p * q * (1 - density))


def _exact_mask(score: torch.Tensor, k: int, overlap: float) -> torch.Tensor:
    """Boolean mask of exactly the k lowest scores (ties broken by position).

    The k-th value is searched only in a narrow band around its closed-form
    estimate, which is much cheaper than kthvalue over the whole tensor.
    """
    n = score.numel()
    if k <= 0:
        return torch.zeros(n, dtype=torch.bool)
    if k >= n:
        return torch.ones(n, dtype=torch.bool)
    slack = 8.0 * math.sqrt(k * (1.0 - k / n)) + 64.0
    lo = _score_quantile(max(0.0, (k - slack) / n), overlap)
    hi = _score_quantile(min(1.0, (k + slack) / n), overlap)
    j = k - int((score <= lo).sum())
    band = score[(score > lo) & (score <= hi)]
    # where the estimate missed (tiny tensors), search everything
    thr = band.kthvalue(j).values if 0 < j <= band.numel() else score.kthvalue(k).values
    mask = score <= thr
    excess = int(mask.sum()) - k
    if excess > 0:  # ties at the threshold: keep the first ones
        ties = (score == thr).nonzero().squeeze(1)
        mask[ties[ties.numel() - excess :]] = False
    return mask


def _perturb(base: torch.Tensor, mask: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Move masked entries by 1..3 grid steps in a random direction, in bit space.

    Integer arithmetic on the sign-magnitude bit pattern guarantees every
    changed entry really changes, stays on the storage grid, keeps its sign
    and stays finite (moves that would leave the normal range are reflected).
    """
    int_dtype, mag_mask, min_normal, max_finite, step, _ = _GRID[base.dtype]
    bits = base.view(int_dtype)
    r = torch.randint(0, 6, bits.shape, generator=g, dtype=int_dtype)
    delta = (r >> 1).add_(1)  # 1..3 steps
    delta.mul_((r & 1).mul_(-2).add_(1))  # random direction
    if step != 1:
        delta.mul_(step)
    delta.mul_(mask)
    new = (bits & mag_mask).add_(delta)
    low = new < min_normal
    if bool(low.any()):  # would shrink into denormals/zero/sign flip: grow instead
        new.add_(torch.where(low, delta.abs() - delta, 0))
    high = new > max_finite
    if bool(high.any()):  # would overflow to inf/nan: shrink instead
        new.sub_(torch.where(high, delta.abs() + delta, 0))
    return new.bitwise_or_(bits & -(mag_mask + 1)).view(base.dtype)


# --------------------------------------------------------------------------- #
# Streaming safetensors writer
# --------------------------------------------------------------------------- #
class _Stream:
    """Tensor bytes written one after another from the file's current position, counted."""

    def __init__(self, f):
        self._f, self.written = f, 0

    def write(self, t: torch.Tensor) -> None:
        data = t.contiguous().view(torch.uint8).numpy()
        self._f.write(data.data)  # the array's own buffer, no copy
        self.written += data.nbytes


class _SafetensorsWriter(_Stream):
    """Writes a safetensors file whose header is known up front, tensor data streamed."""

    def __init__(
        self, path: Path, specs: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype, sized: bool = False
    ):
        itemsize = torch.empty((), dtype=dtype).element_size()
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        spans: dict[str, tuple[int, int]] = {}
        for name, shape in specs:
            nbytes = math.prod(shape) * itemsize
            header[name] = {"dtype": _GRID[dtype][5], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            spans[name] = (offset, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        #: name -> (where its bytes start in the file, how many): a parallel build writes them there
        self.spans = {name: (8 + len(raw) + start, nbytes) for name, (start, nbytes) in spans.items()}
        self.expected = offset
        self.path = path
        super().__init__(open(path, "wb"))  # noqa: SIM115  (the writer owns the handle; close() closes it)
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)
        if sized:  # the data is written in place by worker threads (`_write_in_parallel`)
            self._f.truncate(8 + len(raw) + offset)

    def close(self) -> None:
        self._f.close()

    def check(self) -> None:
        if self.written != self.expected:
            raise RuntimeError(f"{self.path}: wrote {self.written} bytes, expected {self.expected}")


# --------------------------------------------------------------------------- #
# Model description
# --------------------------------------------------------------------------- #
def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        dtype = _DTYPE_NAMES[dtype.removeprefix("torch.")]
    if dtype not in _GRID:
        raise ValueError(f"unsupported dtype {dtype}; use bfloat16, float16 or float32")
    return dtype


#: Mixture-of-experts architectures: (config class, architecture name, checkpoint prefix of the MoE block,
#: checkpoint names of one expert's gate / up / down projections).  Checkpoints on the hub store one tensor
#: per expert; transformers 5 (and mergekit) fuse them on load.
_MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", ".mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", ".block_sparse_moe.", ("w1", "w3", "w2")),
}


def _make_config(
    arch,
    hidden_size,
    num_layers,
    vocab_size,
    intermediate_size,
    num_heads,
    num_kv_heads,
    tie_word_embeddings,
    dtype,
    num_experts=None,
):
    import transformers

    classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}
    classes.update({k: v[:2] for k, v in _MOE.items()})
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    if vocab_size < 8:
        raise ValueError("vocab_size must be at least 8")
    extra: dict = {}
    if arch in _MOE:
        if not num_experts or num_experts < 1:
            raise ValueError(f"arch {arch!r} needs num_experts >= 1")
        per_token = min(2, num_experts)
        if arch == "qwen3_moe":
            extra = {
                "num_experts": num_experts,
                "num_experts_per_tok": per_token,
                "moe_intermediate_size": intermediate_size,
                "head_dim": hidden_size // num_heads,
            }
        else:
            extra = {"num_local_experts": num_experts, "num_experts_per_tok": per_token}
    elif num_experts:
        raise ValueError(f"num_experts is only for {sorted(_MOE)}, not {arch!r}")
    cls_name, arch_name = classes[arch]
    return getattr(transformers, cls_name)(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype=dtype,
        architectures=[arch_name],
        **extra,
    )


def _tensor_specs(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint tensor names/shapes from a meta-device model (tied weights listed once).

    Fused expert parameters (transformers 5's `experts.gate_up_proj` and
    `experts.down_proj`) are written the way hub checkpoints store them: one
    gate, up and down matrix per expert.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    moe = _MOE.get(cfg.model_type)
    specs: list[tuple[str, tuple[int, ...]]] = []
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if moe is None or ".mlp." not in name:
            specs.append((name, shape))
            continue
        prefix, _, rest = name.replace(".mlp.", moe[2], 1).partition(moe[2])
        block = prefix + moe[2]
        gate, up, down = moe[3]
        if rest == "experts.gate_up_proj":  # (experts, 2 * intermediate, hidden): gate rows, then up rows
            half = (shape[1] // 2, shape[2])
            for e in range(shape[0]):
                specs += [(f"{block}experts.{e}.{gate}.weight", half), (f"{block}experts.{e}.{up}.weight", half)]
        elif rest == "experts.down_proj":
            for e in range(shape[0]):
                specs.append((f"{block}experts.{e}.{down}.weight", shape[1:]))
        else:
            specs.append((block + rest, shape))
    return specs


def _kind(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) == 1 and "norm" in name:
        return "norm"
    if name.endswith(".bias"):
        return "bias"
    return "weight"


def _byte_symbols() -> list[str]:
    """Byte-level symbols, printable ASCII first and bytes that never occur in UTF-8 last."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # GPT-2 byte-to-unicode table: printable bytes map to themselves, the rest to U+0100...
    table, n = {}, 0
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    assert sorted(table.values()) == alphabet
    never_utf8 = {0xC0, 0xC1, *range(0xF5, 0x100)}
    order = [
        *range(0x20, 0x7F),
        *(b for b in range(256) if not 0x20 <= b < 0x7F and b not in never_utf8),
        *sorted(never_utf8),
    ]
    return [table[b] for b in order]


def _save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tiny offline byte-level BPE tokenizer, so merges can copy and users can load one.

    Byte-level BPE is what Qwen2's tokenizer class rebuilds from tokenizer.json,
    so AutoTokenizer gives working ids for both architectures.  Special tokens
    take ids 0-3 (matching the config); leftover ids are unused filler tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tokens = specials + _byte_symbols()
    tokens = tokens[:vocab_size] + [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(folder))


def _shard(specs, itemsize: int, shard_size: int | None) -> list[list[tuple[str, tuple[int, ...]]]]:
    if not shard_size:
        return [list(specs)]
    shards: list[list] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _clear_weights(folder: Path) -> None:
    """Drop weight files of an earlier build, which could mix with the new ones."""
    for p in folder.glob("model*.safetensors"):
        p.unlink()
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #
def build_workload(
    out_dir: str | os.PathLike,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 256,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    tie_word_embeddings: bool = False,
    densities: Sequence[float] = (0.03, 0.46, 0.54),
    agent_names: Sequence[str] | None = None,
    overlap: float = 0.35,
    seed: int = 0,
    dtype: torch.dtype | str = torch.bfloat16,
    shard_size: int | None = None,
    tokenizer: bool = True,
    num_experts: int | None = None,
    jobs: int = 1,
) -> Workload:
    """Write a base model and RL-like sparse agents to out_dir/base and out_dir/agents/<name>.

    Agent t changes the fraction densities[t] of every non-norm tensor (the
    coordinates with the lowest overlap*u + (1-overlap)*v_t, u shared by all
    agents, so supports overlap above chance), each by 1..3 steps of the
    storage grid (bf16/fp16 ULPs; about 1e-3 relative for float32).  Norm
    weights and everything outside the support keep the base's exact bits.
    `arch` "qwen3_moe" or "mixtral" with `num_experts` writes a mixture of
    experts (intermediate_size is then each expert's width), one tensor per
    expert as hub checkpoints store them.
    The default overlap of 0.35 matches the paper's measured structure for
    densities (0.03, 0.46, 0.54): the sparse agent ~8% unique and ~50% shared
    with both others, the dense agents close to independent (Fig. 2).
    `jobs` > 1 generates the tensors on that many threads, each
    writing in place: the same bytes as one job (every tensor is seeded by its
    name), in a fraction of the time for multi-GB workloads.
    """
    dtype = _resolve_dtype(dtype)
    densities = [float(d) for d in densities]
    if not all(0.0 <= d <= 1.0 for d in densities):
        raise ValueError(f"densities must lie in [0, 1], got {densities}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must lie in [0, 1], got {overlap}")
    names = list(agent_names) if agent_names is not None else [f"agent{i}" for i in range(len(densities))]
    if len(names) != len(densities):
        raise ValueError(f"{len(names)} agent names for {len(densities)} densities")
    if len(set(names)) != len(names) or not all(n and Path(n).name == n and n not in (".", "..") for n in names):
        raise ValueError(f"agent names must be distinct plain folder names, got {names}")
    if shard_size is not None and shard_size <= 0:
        raise ValueError("shard_size must be positive")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if num_kv_heads is None:
        num_kv_heads = num_heads
    if intermediate_size is None:
        intermediate_size = -(-int(hidden_size * 2.75) // 16) * 16

    cfg = _make_config(
        arch,
        hidden_size,
        num_layers,
        vocab_size,
        intermediate_size,
        num_heads,
        num_kv_heads,
        tie_word_embeddings,
        dtype,
        num_experts,
    )
    specs = _tensor_specs(cfg)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _shard(specs, itemsize, shard_size)

    out = Path(out_dir).resolve()
    base_dir = out / "base"
    agent_dirs = {n: out / "agents" / n for n in names}
    folders = [base_dir, *agent_dirs.values()]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        _clear_weights(folder)
        cfg.save_pretrained(str(folder))
        if tokenizer:
            _save_tokenizer(folder, vocab_size)

    weight_map: dict[str, str] = {}
    in_place: list[tuple] = []  # (paths, start, nbytes, name, shape) for the worker threads
    for s, shard_specs in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        writers: list[_SafetensorsWriter] = []
        try:
            for folder in folders:
                writers.append(_SafetensorsWriter(folder / fname, shard_specs, dtype, sized=jobs > 1))
            for name, shape in shard_specs:
                weight_map[name] = fname
                if jobs > 1:
                    in_place.append(([w.path for w in writers], *writers[0].spans[name], name, shape))
                else:
                    _write_tensor(writers, name, shape, dtype, densities, overlap, seed)
        finally:
            for w in writers:
                w.close()
        if jobs == 1:
            for w in writers:
                w.check()
    if in_place:
        _write_in_parallel(in_place, jobs, (dtype, densities, overlap, seed))

    if len(shards) > 1:
        total = sum(math.prod(shape) for _, shape in specs) * itemsize
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        for folder in folders:
            (folder / "model.safetensors.index.json").write_text(index)

    return Workload(base=base_dir, agents=agent_dirs, num_parameters=sum(math.prod(shape) for _, shape in specs))


def _write_in_place(job: tuple, common: tuple) -> None:
    paths, start, nbytes, name, shape = job
    files = [open(p, "r+b") for p in paths]  # noqa: SIM115  (closed below)
    try:
        for f in files:
            f.seek(start)
        writers = [_Stream(f) for f in files]
        _write_tensor(writers, name, shape, *common)
    finally:
        for f in files:
            f.close()
    if any(w.written != nbytes for w in writers):
        raise RuntimeError(f"tensor {name}: wrote {[w.written for w in writers]} bytes, expected {nbytes} each")


def _write_in_parallel(jobs_list: list[tuple], jobs: int, common: tuple) -> None:
    """Every tensor on `jobs` threads: torch and file writes release the GIL, and threads
    need none of a process pool's care (no re-imported `__main__`, no fork of torch's thread pools)."""
    from concurrent.futures import ThreadPoolExecutor

    order = sorted(jobs_list, key=lambda j: -j[2])  # largest first
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per job
    try:
        with ThreadPoolExecutor(jobs) as pool:
            for done in [pool.submit(_write_in_place, job, common) for job in order]:
                done.result()
    finally:
        torch.set_num_threads(threads)


def _write_tensor(writers, name, shape, dtype, densities, overlap, seed) -> None:
    """Generate one tensor for the base and every agent, streaming it chunk by chunk."""
    numel = math.prod(shape)
    kind = _kind(name, shape)
    exact = numel <= _EXACT_LIMIT
    masks: list[torch.Tensor] = []  # one per agent, for exact (small) non-norm tensors
    if kind != "norm" and exact:
        uniform = torch.cat([_uniform(seed, name, "u", c, b - a) for c, a, b in _chunks(numel)])
        for t, d in enumerate(densities):
            score = torch.cat(
                [_score_chunk(seed, name, t, c, b - a, uniform[a:b], overlap) for c, a, b in _chunks(numel)]
            )
            masks.append(_exact_mask(score, math.floor(d * numel + 0.5), overlap))
            del score
        del uniform
    thresholds = [_score_quantile(d, overlap) for d in densities]

    for c, a, b in _chunks(numel):
        n = b - a
        base = _base_chunk(seed, name, kind, c, n, dtype)
        writers[0].write(base)
        if kind == "norm":
            for w in writers[1:]:
                w.write(base)
            continue
        u = torch.empty(0) if exact else _uniform(seed, name, "u", c, n)  # exact tensors use their masks
        for t, w in enumerate(writers[1:]):
            if exact:
                mask = masks[t][a:b]
            elif densities[t] >= 1.0:
                mask = torch.ones(n, dtype=torch.bool)
            elif densities[t] <= 0.0:
                mask = torch.zeros(n, dtype=torch.bool)
            else:
                mask = _score_chunk(seed, name, t, c, n, u, overlap) <= thresholds[t]
            w.write(_perturb(base, mask, _generator(seed, name, f"step{t}", c)))


def write_example(out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the README demo: a tiny bf16 Qwen2 base, agents code/tool/memory, RAM+ and RAM configs.

    Returns the path of ``ramplus.yaml``; all paths inside the YAMLs are absolute
    so the configs work from any directory.
    """
    import yaml

    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pick an empty folder or pass overwrite=True")
    wl = build_workload(
        out,
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        vocab_size=256,
        densities=tuple(EXAMPLE_DENSITIES.values()),
        agent_names=tuple(EXAMPLE_DENSITIES),
        dtype=torch.bfloat16,
        seed=0,
    )

    def config(r: float) -> dict:
        return {
            "merge_method": "ramplus",
            "base_model": str(wl.base),
            "models": [{"model": str(wl.agents[n])} for n in EXAMPLE_DENSITIES],
            "parameters": {"epsilon": 1e-5, "r": r, "alpha": 2.0},
            "dtype": "bfloat16",
        }

    header = "# RL-like demo written by `mergekit-ram example`; run with mergekit-yaml.\n"
    (out / "ram.yaml").write_text(header + yaml.safe_dump(config(0.0), sort_keys=False))
    ramplus = out / "ramplus.yaml"
    ramplus.write_text(header + yaml.safe_dump(config(0.1), sort_keys=False))
    return ramplus


def written_densities(out_dir: str | os.PathLike, names: Iterable[str], epsilon: float = 1e-5) -> dict[str, float]:
    """Each written agent's density (share of its weights changed by more than `epsilon`), counted over every
    tensor as a merge's statistics table counts the example (not the target densities it was built for)."""
    from safetensors.torch import load_file

    from mergekit_ram.api import agent_statistics

    out = Path(out_dir)
    base = load_file(out / "base" / "model.safetensors")
    agents: dict[Hashable, Mapping[str, torch.Tensor]] = {
        n: load_file(out / "agents" / n / "model.safetensors") for n in names
    }
    return {str(n): s.density for n, s in agent_statistics(base, agents, epsilon=epsilon).items()}
