"""What verify checks beyond the weights of a merge by one of mergekit's own methods (`task_arithmetic`, `ties`,
`slerp`, ...: any method but ramplus), which records nothing but its `mergekit_config.yml` and its card.

mergekit writes the config's text twice: as `mergekit_config.yml` and as the card's YAML block; and the card's
front matter names the inputs that are hub ids (`base_model`, the model tree the Hub shows). Both are checked
(`check_card`); the rest of the card is the publisher's to edit. Nothing is counted or recorded beyond the
weights, so there are no statistics to check. On plain data: the seam's `config_record` names the inputs.
"""

from __future__ import annotations

import os
from typing import Any

from mergekit_ram.verify import folder_checks, recompute, record_checks, verdict

#: the line mergekit's card puts before the config's YAML block (mergekit.card.CARD_TEMPLATE)
YAML_INTRO = "The following YAML configuration was used to produce this model:"
FENCE = "```yaml\n"


def published_vocabulary(folder: str) -> dict[str, int] | None:
    """token -> id in the folder's tokenizer.json (its vocabulary and added tokens), None without one: mergekit
    numbers the tokens a union tokenizer adds in a hash map's order, so the merge is run again in this one."""
    if not os.path.lexists(os.path.join(folder, "tokenizer.json")):
        return None
    found = folder_checks.read_json(folder, "tokenizer.json")
    model = found.get("model") if isinstance(found, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    out: dict[str, int] = {}
    if isinstance(vocab, dict):
        out.update({str(t): i for t, i in vocab.items() if isinstance(i, int)})
    elif isinstance(vocab, list):  # a Unigram model: [token, score] by id
        out.update({str(entry[0]): i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry})
    for added in found.get("added_tokens") or [] if isinstance(found, dict) else []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            out[str(added.get("content"))] = added["id"]
    return out


def yaml_block(text: str) -> str | None:
    """The config's text as the card `text` quotes it (what mergekit put between its fences), or None when the
    card has no such block (a publisher rewrote it)."""
    start = text.find(YAML_INTRO)
    if start < 0:
        return None
    start = text.find(FENCE, start)
    if start < 0:
        return None
    start += len(FENCE)
    end = text.find("\n```", start)
    return None if end < 0 else text[start:end]


def base_model_problem(text: str, certain: set[str], maybe: set[str]) -> str | None:
    """Where the card's front matter names other inputs than the merge's hub ids (`certain`; `maybe`: names shaped
    like a hub id that are also folders here, which mergekit listed only if the Hub had them when it merged)."""
    import yaml

    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        return None  # no front matter: nothing said about the inputs (the publisher rewrote the card)
    try:
        meta = yaml.safe_load(text[4:].split("\n---\n", 1)[0])
    except yaml.YAMLError:
        return "its front matter is not YAML"
    named = meta.get("base_model") if isinstance(meta, dict) else None
    names = named if isinstance(named, list) else ([] if named is None else [named])
    if not all(isinstance(name, str) for name in names):
        return "its front matter's base_model is not a list of names"
    found = set(names)
    if certain <= found <= certain | maybe:
        return None
    shown = ", ".join(sorted(certain)) or "none"
    return (
        f"its front matter's base_model is [{', '.join(sorted(found))}]; the merge's inputs on the Hub are "
        f"[{shown}] (the model tree the Hub shows)"
    )


def check_card(folder: str, recorded: dict, outcome: verdict.Outcome) -> None:
    """The card's YAML block is `mergekit_config.yml`, byte for byte, and its front matter's `base_model` names
    the merge's inputs on the Hub (as a set)."""
    if not os.path.lexists(os.path.join(folder, "README.md")):
        outcome.not_checked.append("the model card (no README.md)")
        return
    text = folder_checks.read_bytes(folder, "README.md").decode("utf-8", errors="replace")
    config = folder_checks.read_bytes(folder, record_checks.CONFIG_FILE).decode("utf-8", errors="replace")
    quoted = yaml_block(text)
    if quoted is None:
        outcome.not_checked.append("the card's configuration (it quotes no YAML block: rewritten by its publisher)")
    elif quoted != config:
        outcome.files.append(
            f"README.md: its YAML configuration is not {record_checks.CONFIG_FILE}, which mergekit writes with "
            f"it (first difference at line {_first_line(quoted, config)})"
        )
    else:
        outcome.checked.append(f"the card's YAML configuration (the same as {record_checks.CONFIG_FILE})")
    hub_ids = recorded.get("hub_ids") or {}
    problem = base_model_problem(text, set(hub_ids.get("certain") or ()), set(hub_ids.get("maybe") or ()))
    if problem is not None:
        outcome.files.append(f"README.md: {problem}")
    elif text.startswith("---\n"):
        outcome.checked.append("the card's front matter's base_model (the inputs on the Hub)")


def _first_line(a: str, b: str) -> int:
    for number, (x, y) in enumerate(zip(a.splitlines(), b.splitlines(), strict=False), start=1):
        if x != y:
            return number
    return min(len(a.splitlines()), len(b.splitlines())) + 1


class MergekitChecks:
    """`recompute.MethodChecks` of a merge by one of mergekit's own methods: no statistics, the card."""

    checked_record: str | None = None

    def prepare(
        self, merge: recompute.Merge, recorded: dict, seen: dict[str, dict], sampled: bool, outcome: verdict.Outcome
    ) -> tuple[dict, Any] | None:
        outcome.statistics = None
        return {}, None

    def against_slices(
        self, merge: recompute.Merge, stats: Any, counted: dict, recorded: dict, outcome: verdict.Outcome
    ) -> None:
        return None

    def check_statistics(self, recorded: dict, recomputed: dict, outcome: verdict.Outcome) -> None:
        return None  # the method records nothing beyond the weights

    def check_card(self, folder: str, recorded: dict, outcome: verdict.Outcome) -> None:
        check_card(folder, recorded, outcome)


CHECKS = MergekitChecks()
