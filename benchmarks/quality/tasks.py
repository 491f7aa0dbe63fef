"""Synthetic tasks with verifiable answers, and the character vocabulary every model of the benchmark shares.

Pure Python (no torch): generators, verifiers, rewards and seeded, disjoint train/eval prompt sets.

Every example is one prompt and one answer, both short strings over `CHARS`. A prompt starts with its task's
tag (an upper-case letter, so one model can tell the tasks apart) and ends with `=`; the model writes the
answer and then `</s>`. Task difficulty is set by each task's parameters (`DEFAULTS`, overridable per config).

The `shared` regime adds a common output format (`fmt`, e.g. `{"open": "[", "close": "]"}`: the answer wrapped
in brackets) that every agent's reward requires besides its task: `reward(..., fmt=fmt)`. Task accuracy is
scored on the answer's content whatever its format (`content`), and the format on its own (`formatted`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

#: special tokens (ids 0-3, as in the model config: bos 1, eos 2, pad 3)
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
UNK, BOS, EOS, PAD = 0, 1, 2, 3
#: every character a prompt or an answer may contain; printable ASCII without space, so a byte-level BPE
#: tokenizer without merges (what Qwen2's tokenizer class rebuilds from tokenizer.json) gives these same ids
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+=:()[]{}<>ABCRS"
VOCAB = (*SPECIALS, *CHARS)
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
assert len(set(CHARS)) == len(CHARS) and all(0x21 <= ord(c) <= 0x7E for c in CHARS)

LETTERS = "abcdefghijklmnopqrstuvwxyz"
BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">"}


def encode(text: str) -> list[int]:
    """Token ids of `text` (one per character; no special tokens)."""
    return [TOKEN_ID[c] for c in text]


def decode(ids: Iterable[int]) -> str:
    """Text of `ids`, stopping at the first `</s>`; any other special token becomes `?` (never in an answer)."""
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(VOCAB[i] if i >= len(SPECIALS) else "?")
    return "".join(out)


# --------------------------------------------------------------------------- #
# Generators: (rng, params) -> (prompt, answer)
# --------------------------------------------------------------------------- #
def _add(rng: random.Random, p: dict) -> tuple[str, str]:
    """A{a}+{b}= -> a + b; a and b have 1..digits digits (the digit count drawn first)."""
    a = rng.randrange(10 ** rng.randint(1, p["digits"]))
    b = rng.randrange(10 ** rng.randint(1, p["digits"]))
    return f"A{a}+{b}=", str(a + b)


def _sort(rng: random.Random, p: dict) -> tuple[str, str]:
    """S{digits}= -> the digits in ascending order."""
    s = "".join(rng.choice("0123456789") for _ in range(rng.randint(p["min_len"], p["max_len"])))
    return f"S{s}=", "".join(sorted(s))


def _reverse(rng: random.Random, p: dict) -> tuple[str, str]:
    """R{letters}= -> the letters reversed."""
    alphabet = LETTERS[: p["letters"]]
    s = "".join(rng.choice(alphabet) for _ in range(rng.randint(p["min_len"], p["max_len"])))
    return f"R{s}=", s[::-1]


def _count(rng: random.Random, p: dict) -> tuple[str, str]:
    """C{x}:{letters}= -> how many times x occurs in the letters."""
    alphabet = LETTERS[: p["letters"]]
    s = "".join(rng.choice(alphabet) for _ in range(rng.randint(p["min_len"], p["max_len"])))
    x = rng.choice(alphabet)
    return f"C{x}:{s}=", str(s.count(x))


def _brackets(rng: random.Random, p: dict) -> tuple[str, str]:
    """B{an unfinished bracket sequence}= -> the closing brackets that complete it (at least one)."""
    n = rng.randint(p["min_len"], p["max_len"])
    opens = p["types"]
    kinds = list(BRACKETS)[:opens]
    while True:
        stack: list[str] = []
        out = []
        for _ in range(n):
            if stack and (len(stack) >= p["max_close"] or rng.random() < 0.45):
                out.append(BRACKETS[stack.pop()])
            else:
                c = rng.choice(kinds)
                stack.append(c)
                out.append(c)
        if stack:  # at most max_close deep by construction
            return f"B{''.join(out)}=", "".join(BRACKETS[c] for c in reversed(stack))


# --------------------------------------------------------------------------- #
# Systematic errors: what a flawed corpus teaches instead of the right answer. Each agrees with the right
# answer on part of the prompts (no units carry; a largest last digit; equal first two letters; no target letter
# in the second half), so a base that learned the error is mediocre, not zero, and RL has something to fix.
# --------------------------------------------------------------------------- #
def _add_bug(prompt: str) -> str:
    """Drops the carry out of the units digit."""
    a, b = map(int, prompt[1:-1].split("+"))
    return str(a + b - 10 * ((a % 10 + b % 10) >= 10))


def _sort_bug(prompt: str) -> str:
    """Sorts all digits but the last, which stays last."""
    s = prompt[1:-1]
    return "".join(sorted(s[:-1])) + s[-1]


def _reverse_bug(prompt: str) -> str:
    """Reversed, except that the first two letters end it in their original order."""
    s = prompt[1:-1]
    return s[::-1][:-2] + s[:2]


def _count_bug(prompt: str) -> str:
    """Counts only in the first half of the letters."""
    x, s = prompt[1:-1].split(":")
    return str(s[: (len(s) + 1) // 2].count(x))


def _brackets_bug(prompt: str) -> str:
    """Closes the open brackets in the order they were opened (not the reverse)."""
    stack: list[str] = []
    for c in prompt[1:-1]:
        if c in BRACKETS:
            stack.append(c)
        else:
            stack.pop()
    return "".join(BRACKETS[c] for c in stack)


@dataclass(frozen=True)
class Task:
    name: str
    tag: str
    generate: Callable[[random.Random, dict], tuple[str, str]]
    defaults: dict
    #: longest possible answer for given parameters (decoding budget = this + 1 for </s>)
    max_answer: Callable[[dict], int]
    #: the systematic error a flawed corpus makes on a prompt (pretraining `noise`)
    bug: Callable[[str], str]


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("add", "A", _add, {"digits": 3}, lambda p: p["digits"] + 1, _add_bug),
        Task("sort", "S", _sort, {"min_len": 4, "max_len": 7}, lambda p: p["max_len"], _sort_bug),
        Task(
            "reverse", "R", _reverse, {"min_len": 4, "max_len": 7, "letters": 26}, lambda p: p["max_len"], _reverse_bug
        ),
        Task(
            "count",
            "C",
            _count,
            {"min_len": 6, "max_len": 12, "letters": 4},
            lambda p: len(str(p["max_len"])),
            _count_bug,
        ),
        Task(
            "brackets",
            "B",
            _brackets,
            {"min_len": 4, "max_len": 8, "types": 4, "max_close": 4},
            lambda p: p["max_close"],
            _brackets_bug,
        ),
    )
}


def params(name: str, overrides: dict | None = None) -> dict:
    """A task's parameters: its defaults updated with `overrides` (unknown keys are an error)."""
    task = TASKS[name]
    extra = set(overrides or {}) - set(task.defaults)
    if extra:
        raise ValueError(f"task {name!r} has no parameter(s) {sorted(extra)}; it takes {sorted(task.defaults)}")
    return {**task.defaults, **(overrides or {})}


def max_new_tokens(name: str, p: dict) -> int:
    """Decoding budget: the longest answer plus `</s>`."""
    return TASKS[name].max_answer(p) + 1


# --------------------------------------------------------------------------- #
# A common output format (the shared regime)
# --------------------------------------------------------------------------- #
def wrap(answer: str, fmt: dict) -> str:
    """The answer in the format: `open` + answer + `close`."""
    return fmt["open"] + answer + fmt["close"]


def formatted(completion: str, fmt: dict) -> bool:
    """Does the completion follow the format (starts with `open`, ends with `close`, both present)?"""
    o, c = fmt["open"], fmt["close"]
    return len(completion) >= len(o) + len(c) and completion.startswith(o) and completion.endswith(c)


def content(completion: str, fmt: dict | None) -> str:
    """The answer inside the format, whatever the format: a leading `open` and a trailing `close` are removed
    where present (each on its own), so task accuracy does not depend on the format."""
    if not fmt:
        return completion
    if completion.startswith(fmt["open"]):
        completion = completion[len(fmt["open"]) :]
    if fmt["close"] and completion.endswith(fmt["close"]):
        completion = completion[: -len(fmt["close"])]
    return completion


# --------------------------------------------------------------------------- #
# Verification and reward
# --------------------------------------------------------------------------- #
def correct(completion: str, answer: str, fmt: dict | None = None) -> bool:
    """Exact match of the decoded completion (up to `</s>`; its content inside `fmt`, if given) with the answer."""
    return content(completion, fmt) == answer


def reward(completion: str, answer: str, partial: float = 0.0, fmt: dict | None = None) -> float:
    """1 for an exact match; otherwise `partial` x the share of answer positions that match (0 by default).

    With `fmt` (the shared regime) the completion must also follow the format: 0 when it does not, else the
    reward of its content.
    """
    if fmt:
        if not formatted(completion, fmt):
            return 0.0
        completion = content(completion, fmt)
    if completion == answer:
        return 1.0
    if not partial:
        return 0.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return partial * hits / max(len(answer), len(completion))


# --------------------------------------------------------------------------- #
# Data: a fixed eval set, and training prompts disjoint from it
# --------------------------------------------------------------------------- #
def eval_set(name: str, p: dict, n: int, seed: int) -> list[tuple[str, str]]:
    """n distinct (prompt, answer) pairs, the same for a given (task, parameters, n, seed)."""
    rng = random.Random(f"eval/{name}/{sorted(p.items())}/{seed}")
    seen: dict[str, str] = {}
    tries = 0
    while len(seen) < n:
        prompt, answer = TASKS[name].generate(rng, p)
        seen.setdefault(prompt, answer)
        tries += 1
        if tries > 50 * n:
            raise ValueError(f"task {name!r} with {p} has too few distinct prompts for an eval set of {n}")
    return list(seen.items())


class Sampler:
    """Training examples of some tasks, never a prompt of `exclude` (the eval sets), from one seeded stream."""

    def __init__(
        self,
        names: Sequence[str],
        task_params: dict[str, dict],
        seed: int | str,
        exclude: set[str],
        weights: dict[str, float] | None = None,
        noise: dict[str, float] | None = None,
        fmt: dict | None = None,
        fmt_share: float = 0.0,
    ):
        self.names = list(names)
        self.params = task_params
        self.exclude = exclude
        self.weights = [float((weights or {}).get(n, 1.0)) for n in self.names]
        #: per task, the share of examples whose answer is the task's systematic error (a flawed corpus)
        self.noise = {n: float((noise or {}).get(n, 0.0)) for n in self.names}
        #: the share of answers written in the common format `fmt` (a corpus where the format is a minority)
        self.fmt, self.fmt_share = fmt, float(fmt_share) if fmt else 0.0
        self.rng = random.Random(f"train/{seed}")

    def one(self, name: str) -> tuple[str, str]:
        for _ in range(10_000):
            prompt, answer = TASKS[name].generate(self.rng, self.params[name])
            if prompt not in self.exclude:
                if self.noise[name] and self.rng.random() < self.noise[name]:
                    answer = TASKS[name].bug(prompt)
                if self.fmt_share and self.rng.random() < self.fmt_share:
                    answer = wrap(answer, self.fmt)  # type: ignore[arg-type]
                return prompt, answer
        raise ValueError(f"task {name!r}: every sampled prompt is in the eval set; widen its parameters")

    def mixed(self, k: int) -> list[tuple[str, str, str]]:
        """k (task, prompt, answer) triples, tasks drawn by weight."""
        names = self.rng.choices(self.names, weights=self.weights, k=k)
        return [(n, *self.one(n)) for n in names]

    def task(self, name: str, k: int) -> list[tuple[str, str]]:
        return [self.one(name) for _ in range(k)]
