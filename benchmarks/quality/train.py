"""The models of the quality benchmark: a small Qwen2 decoder pretrained from scratch, and GRPO agents.

- `pretrain`: supervised training from scratch on a mix of the tasks (loss on answer tokens), stopped early
  (a probe set's greedy accuracy) so that the base is mediocre but not zero on each task.
- `grpo`: on-policy RL of one agent on one task from the base: a group of G sampled answers per prompt
  (temperature sampling), reward from the verifier, group-normalised advantages, one policy-gradient step per
  batch (on-policy, so the PPO ratio is 1 and needs no clipping), an optional k3 KL penalty to the base.
  Trained in float32 from the bf16 base; stored in bfloat16, as RL checkpoints are.
- `generate`: batched left-padded decoding with a KV cache, greedy or sampled.

Every model folder holds config.json, model.safetensors and a transformers-loadable tokenizer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import tasks as T
import torch

# --------------------------------------------------------------------------- #
# Model and tokenizer on disk
# --------------------------------------------------------------------------- #


def make_config(m: dict):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(T.VOCAB),
        hidden_size=m["hidden"],
        intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        max_position_embeddings=m.get("max_positions", 64),
        tie_word_embeddings=False,
        bos_token_id=T.BOS,
        eos_token_id=T.EOS,
        pad_token_id=T.PAD,
        architectures=["Qwen2ForCausalLM"],
    )


def new_model(m: dict, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config(m), attn_implementation="eager", dtype=torch.float32)


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def save_tokenizer(folder: Path) -> None:
    """The character vocabulary as a byte-level BPE tokenizer without merges (ids = `tasks.VOCAB`).

    AutoTokenizer loads it (also as Qwen2's tokenizer class, which rebuilds byte-level BPE), and mergekit
    copies it into every merged model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(T.VOCAB)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(folder))


def save_model(model, folder: Path) -> None:
    """Store in bfloat16 (what RL checkpoints are) with config and tokenizer; `model` is left unchanged."""
    import copy

    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(folder))
    save_tokenizer(folder)


def load_model(folder: Path | str):
    """A stored model for compute in float32 (bf16 weights upcast exactly)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    return model


# --------------------------------------------------------------------------- #
# Decoding
# --------------------------------------------------------------------------- #
@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Complete each prompt (token ids, BOS included): greedy when temperature is 0, else sampled.

    Left-padded batch with attention mask and explicit positions, KV cache. Returns each completion's ids
    up to and including `</s>` (at most max_new ids).
    """
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), T.PAD, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache, logits, last = out.past_key_values, out.logits[:, -1], pos[:, -1:]
    done = torch.zeros(n, dtype=torch.bool)
    steps = []
    for step in range(max_new):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, T.PAD), nxt)
        steps.append(nxt)
        done |= nxt == T.EOS
        if bool(done.all()) or step == max_new - 1:
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        last = last + 1
        out = model(
            input_ids=nxt[:, None], attention_mask=mask, position_ids=last, past_key_values=cache, use_cache=True
        )
        cache, logits = out.past_key_values, out.logits[:, -1]
    toks = torch.stack(steps, 1).tolist()
    result = []
    for row in toks:
        cut = row.index(T.EOS) + 1 if T.EOS in row else len(row)
        result.append(row[:cut])
    return result


def greedy_answers(model, prompts: Sequence[str], max_new: int, batch_size: int = 512) -> list[str]:
    """Greedy answers to text prompts, batched by prompt length (little padding; order kept)."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    answers: list[str] = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        outs = generate(model, [[T.BOS, *T.encode(prompts[i])] for i in chunk], max_new)
        for i, o in zip(chunk, outs, strict=True):
            answers[i] = T.decode(o)
    return answers


def accuracy(
    model, items: Sequence[tuple[str, str]], max_new: int, batch_size: int = 512, fmt: dict | None = None
) -> list[int]:
    """1/0 per item: exact match of the greedy answer (of its content inside `fmt`, whatever its format)."""
    return score(model, items, max_new, batch_size, fmt)[0]


def score(
    model, items: Sequence[tuple[str, str]], max_new: int, batch_size: int = 512, fmt: dict | None = None
) -> tuple[list[int], list[int] | None]:
    """(1/0 per item: the greedy answer's content is right; 1/0 per item: it follows `fmt`, None without one)."""
    got = greedy_answers(model, [p for p, _ in items], max_new, batch_size)
    right = [int(T.correct(g, a, fmt)) for g, (_, a) in zip(got, items, strict=True)]
    return right, ([int(T.formatted(g, fmt)) for g in got] if fmt else None)


# --------------------------------------------------------------------------- #
# Batches for teacher forcing
# --------------------------------------------------------------------------- #
def _right_padded(seqs: Sequence[Sequence[int]], starts: Sequence[int]):
    """ids, attention mask, and a mask of the target positions (tokens at index >= start of each sequence)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), T.PAD, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    target = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
        target[i, start : len(s)] = True
    return ids, attn, target


def token_logprobs(model, ids, attn, target):
    """log p of each target token (positions where `target` is True; 0 elsewhere), shape (B, L-1)."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp * target[:, 1:]


# --------------------------------------------------------------------------- #
# Pretraining from scratch
# --------------------------------------------------------------------------- #
def pretrain(
    cfg: dict,
    sampler: T.Sampler,
    probes: dict[str, list[tuple[str, str]]],
    max_new: dict[str, int],
    log: Callable[[str], None] = print,
):
    """Train a fresh model on the task mix until the probe sets say it is mediocre (or steps run out).

    cfg: model (dict), seed, steps, batch, lr, warmup, decay, weight_decay, probe_every, stop_mean, stop_min,
    weights (per-task sampling weights: tasks learn at very different speeds).
    Stops at the first probe where mean accuracy >= stop_mean and every task >= stop_min.
    `init` (a stored model folder): continue training that model instead of a fresh one (the shared regime's
    base: the `full` base trained on in a corpus where some answers have the common format `fmt`); with `fmt`,
    probes score the answers' content and also record the format's greedy compliance.
    Returns (model, history).
    """
    init, fmt = cfg.get("init"), cfg.get("format")
    model = load_model(init) if init else new_model(cfg["model"], cfg["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), weight_decay=cfg["weight_decay"])
    warmup = max(1, cfg["warmup"])
    total = cfg["steps"]

    def factor(s: int) -> float:
        # linear warm-up, then constant or (decay) linearly down to 0 at the last step, so that the base ends in
        # a settled state rather than wherever a high learning rate left it
        up = min(1.0, (s + 1) / warmup)
        return up * (max(0.0, (total - s) / max(1, total - warmup)) if cfg.get("decay") and s >= warmup else 1.0)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    history: list[dict] = []
    start = time.perf_counter()
    losses: list[float] = []
    for step in range(1, cfg["steps"] + 1):
        model.train()
        batch = sampler.mixed(cfg["batch"])
        seqs, starts = [], []
        for _, prompt, answer in batch:
            p = [T.BOS, *T.encode(prompt)]
            seqs.append([*p, *T.encode(answer), T.EOS])
            starts.append(len(p))
        ids, attn, target = _right_padded(seqs, starts)
        logp = token_logprobs(model, ids, attn, target)
        loss = -logp.sum() / target[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % cfg["probe_every"] == 0 or step == cfg["steps"]:
            model.eval()
            scored = {name: score(model, items, max_new[name], fmt=fmt) for name, items in probes.items()}
            acc = {name: sum(r) / len(r) for name, (r, _) in scored.items()}
            mean = sum(acc.values()) / len(acc)
            history.append(
                {
                    "step": step,
                    "loss": round(sum(losses) / len(losses), 4),
                    "probe": {k: round(v, 4) for k, v in acc.items()},
                    "probe_mean": round(mean, 4),
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            if fmt:
                history[-1]["probe_format"] = {k: round(sum(f) / len(f), 4) for k, (_, f) in scored.items()}
            losses = []
            log(
                f"pretrain step {step}: loss {history[-1]['loss']:.3f}, probe "
                + ", ".join(f"{k} {v:.2f}" for k, v in acc.items())
                + (
                    ", format " + ", ".join(f"{k} {v:.2f}" for k, v in history[-1]["probe_format"].items())
                    if fmt
                    else ""
                )
                + f" ({history[-1]['seconds']:.0f} s)"
            )
            if mean >= cfg["stop_mean"] and min(acc.values()) >= cfg["stop_min"]:
                break
    model.eval()
    return model, history


# --------------------------------------------------------------------------- #
# GRPO
# --------------------------------------------------------------------------- #
def grpo(
    base_folder: Path,
    task: str,
    cfg: dict,
    sampler: T.Sampler,
    max_new: int,
    probe: list[tuple[str, str]],
    log: Callable[[str], None] = print,
    on_probe: Callable[[object, int], None] | None = None,
):
    """One agent: GRPO on `task` from the stored base.

    cfg: seed, steps, prompts (per step), group, lr, temperature, partial (reward credit), kl (beta),
    probe_every, format (optional: the common output format the reward also requires, the shared regime).
    `on_probe(model, step)` runs at every probe (density_curve.py measures there).
    Returns (model, history).
    """
    fmt = cfg.get("format")
    torch.manual_seed(cfg["seed"])
    gen = torch.Generator().manual_seed(cfg["seed"])
    model = load_model(base_folder)
    ref = load_model(base_folder) if cfg["kl"] > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg["lr"], betas=(0.9, 0.999), eps=1e-8)
    g = cfg["group"]
    history: list[dict] = []
    start = time.perf_counter()
    window: list[tuple[float, float]] = []
    for step in range(1, cfg["steps"] + 1):
        items = sampler.task(task, cfg["prompts"])
        prompts = [[T.BOS, *T.encode(p)] for p, _ in items for _ in range(g)]
        model.eval()
        completions = generate(model, prompts, max_new, temperature=cfg["temperature"], generator=gen)
        rewards = torch.tensor(
            [T.reward(T.decode(c), items[i // g][1], cfg["partial"], fmt) for i, c in enumerate(completions)]
        ).view(-1, g)
        std = rewards.std(dim=1, keepdim=True)
        adv = ((rewards - rewards.mean(dim=1, keepdim=True)) / (std + 1e-4)).view(-1)
        signal = float((std > 0).float().mean())
        window.append((float(rewards.mean()), signal))
        if signal > 0:
            model.train()
            keep = [i for i in range(len(prompts)) if adv[i] != 0]
            seqs = [[*prompts[i], *completions[i]] for i in keep]
            ids, attn, target = _right_padded(seqs, [len(prompts[i]) for i in keep])
            tmask = target[:, 1:]
            logp = token_logprobs(model, ids, attn, target)
            lengths = tmask.sum(1).clamp(min=1)
            a = adv[keep]
            # GRPO: per-sequence mean of token terms, then mean over all G x prompts sequences
            # (zero-advantage sequences contribute nothing and are left out of the forward pass)
            loss = -(a * logp.sum(1) / lengths).sum() / len(prompts)
            if ref is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(ref, ids, attn, target)
                diff = (ref_logp - logp) * tmask
                kl = (torch.exp(diff) - diff - 1) * tmask  # k3 estimator, >= 0
                loss = loss + cfg["kl"] * (kl.sum(1) / lengths).sum() / len(prompts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        if step % cfg["probe_every"] == 0 or step == cfg["steps"]:
            model.eval()
            if on_probe is not None:
                on_probe(model, step)
            right, fmt_ok = score(model, probe, max_new, fmt=fmt) if probe else ([], None)
            acc = sum(right) / len(right) if right else math.nan
            r, s = (sum(x) / len(window) for x in zip(*window, strict=True))
            history.append(
                {
                    "step": step,
                    "reward": round(r, 4),
                    "groups_with_signal": round(s, 3),
                    "probe_greedy": round(acc, 4),
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            if fmt_ok is not None:
                history[-1]["probe_format"] = round(sum(fmt_ok) / len(fmt_ok), 4)
            window = []
            log(
                f"grpo {task} step {step}: reward {r:.3f}, groups with signal {s:.2f}, greedy probe {acc:.3f}"
                + (f", format {history[-1]['probe_format']:.3f}" if fmt_ok is not None else "")
                + f" ({history[-1]['seconds']:.0f} s)"
            )
    model.eval()
    return model, history
