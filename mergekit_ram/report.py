"""What a RAM+ merge publishes: `ram_stats.json` and the model card section.

Both are built from the same report dict, so the card, the JSON and
`mergekit-ram inspect` never disagree. Schema (format_version 1):

- `parameters`: epsilon, r, alpha, rho_scope, lambda_rule as planned for the
  first tensor; `per_tensor_parameters` maps each parameter that varies across
  tensors (mergekit filters or gradients) to its distinct values.
- `statistics`: "computed", "cache" or "not computed" (r = 0 / rho given).
- `versions`: mergekit, mergekit-ram, torch; `mergekit_ram_source` (issue 31): where this mergekit-ram was
  installed from, as pip recorded it (`installed_from`: "git", "checkout", "archive" or "index"; `commit`,
  `git` (a URL), `archive` (a file name) and `sha256` where known; never a local path).
- `merge` (format_version 3): how the merge was run, for `mergekit-ram verify`: `entry_point`
  ("run_merge": mergekit-yaml, mergekit-multi or the Python API, whose config is the folder's
  `mergekit_config.yml`), `options` (the values of the mergekit options that change what is
  merged, `RECORDED_OPTIONS`), and what that entry point adds.
- `base_model`, `agents[]`: `model` and `identity` (`revision` for hub
  snapshots; `content_id` = sha256 over each file's name, size, safetensors
  header (tensor names, dtypes, shapes, offsets) and sixteen evenly spaced
  64 KiB samples of its bytes: a fingerprint, not a hash of every weight).
- per agent: active, shared, unique, shared_with_1, shared_with_2plus, numel,
  density, unique_share, shared_with_1_share, shared_with_2plus_share,
  rho_counted, rho (used), rho_source ("counted" or "given"), lambda.
  Infinite values are written as the string "inf".
- diagnostics per agent (when counted, format_version 2): single_step (active entries one
  step of the dtype from the base) and single_step_share; magnitude_unique, magnitude_shared
  (sum of |tau| over its unique / shared entries) and magnitude_unique_share.
- `pairs[]` (format_version 2): per pair of agents, `agents` [a, b], `common` (entries both
  changed), `same_sign`, `same_sign_share` and `cosine` of the two task vectors over the
  common entries (null when they have none).
- `rho_by_group` (rho_scope layer/tensor): group -> agent -> rho.
- `tied_counted_once`: tensor -> the tensor it is tied to (`tie_word_embeddings`; counted once).
- `tensors[]`: name, numel, epsilon, counts {agent: [active, unique, pair]}
  (pair = entries exactly one other agent changed too), and `diagnostics`: single
  {agent: n}, magnitude {agent: [unique, shared]}, pairs [[a, b, common, same_sign,
  sum tau_a tau_b, sum tau_a^2, sum tau_b^2]].
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

from mergekit_ram import output_checks, statistics, tables, versions
from mergekit_ram.session import Planned

FORMAT = output_checks.STATS_FORMAT
FORMAT_VERSION = 3  # 2: diagnostics (per agent and `pairs`) added; 3: the `merge` record
#: The method's paper, linked from the card.
PAPER_URL = "https://arxiv.org/abs/2601.13572"
#: the packages whose versions a report records
VERSIONED = ("mergekit", "mergekit-ram", "torch")
#: mergekit's `MergeOptions` fields that change the merged values, recorded in the `merge` record so `verify`
#: merges with them: what is planned (`allow_crimes`: mixed architectures; `trust_remote_code`: a custom
#: architecture's config), the vocabulary (`unsafe_truncate_embeddings`) and what is loaded (`lazy_unpickle`:
#: how a `.bin` is read; `lora_merge_dtype`: a LoRA input merged into its model). The others change where and
#: how files are written (shards, serialisation, card, tokenizer), the devices and threads (the kernel's
#: result is the same bits on each), or nothing `ramplus` reads (`random_seed`).
RECORDED_OPTIONS = (
    "allow_crimes",
    "trust_remote_code",
    "unsafe_truncate_embeddings",
    "lazy_unpickle",
    "lora_merge_dtype",
)


#: The per-agent numbers of `ram_stats.json`, each `statistics.AgentStats`' attribute of the same name.
AGENT_NUMBERS = (
    "active", "shared", "unique", "shared_with_1", "shared_with_2plus", "numel", "density",
    "unique_share", "shared_with_1_share", "shared_with_2plus_share",
)  # fmt: skip
AGENT_DIAGNOSTICS = (
    "single_step", "single_step_share", "magnitude_unique", "magnitude_shared", "magnitude_unique_share",
)  # fmt: skip


def merge_record(entry_point: str, options: Any, **extra: Any) -> dict[str, Any]:
    """The `merge` record of a merge run through `entry_point` with mergekit's `options` (`extra`: what the entry
    point adds, e.g. mergekit-pytorch's config)."""
    recorded = {name: getattr(options, name) for name in RECORDED_OPTIONS if hasattr(options, name)}
    return {"entry_point": entry_point, "options": recorded, **extra}


def build(
    stats: statistics.Statistics | None,
    planned: Sequence[Planned],
    *,
    source: str,
    identities: dict[str, dict],
    tied: dict[str, str] | None = None,
    record: dict[str, Any] | None = None,
) -> dict:
    """The report of one planned ramplus merge (`planned`: its counted tensors, in planning order;
    `tied`: tensors counted once with the tensor they are tied to; `record`: how the merge was run)."""
    first = planned[0]
    params = dict(first.parameters)  # every ramplus parameter, in params.DEFAULTS order
    varying = {
        k: sorted({t.parameters[k] for t in planned}, key=str)
        for k in params
        if any(t.parameters[k] != params[k] for t in planned)
    }
    base = first.base
    totals = stats.totals() if stats is not None else {}
    rows = []
    for label in first.agents:
        given = first.given_rho.get(label)
        s = totals.get(label)
        row: dict = {"model": label, "identity": identities.get(label, {})}
        if s is not None:
            row.update({name: getattr(s, name) for name in AGENT_NUMBERS}, rho_counted=_number(s.rho))
            if s.single is not None:
                row.update({name: getattr(s, name) for name in AGENT_DIAGNOSTICS})
        rho = given if given is not None else (s.rho if s is not None else None)
        row["rho"] = _number(rho)
        row["rho_source"] = "given" if given is not None else ("counted" if s is not None else None)
        row["lambda"] = statistics.lambda_shown(rho, params["r"], params["alpha"], params["lambda_rule"])
        rows.append(row)
    out = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": "ramplus",
        "parameters": params,
        "per_tensor_parameters": varying,
        "statistics": source,
        "versions": _versions(),
        "mergekit_ram_source": installed_from(),
        "merge": dict(record or {"entry_point": "run_merge"}),
        "base_model": {"model": base, "identity": identities.get(base, {})},
        "agents": rows,
    }
    if stats is not None and params["rho_scope"] != "model":
        out["rho_by_group"] = {
            g: {a: _number(v) for a, v in rhos.items()} for g, rhos in stats.rho(params["rho_scope"]).items()
        }
    out["pairs"] = [
        {
            "agents": [p.a, p.b],
            "common": p.common,
            "same_sign": p.same_sign,
            "same_sign_share": p.same_sign_share,
            "cosine": p.cosine,
        }
        for p in (stats.pair_totals() if stats is not None else [])
    ]
    out["tied_counted_once"] = dict(tied or {})
    out["tensors"] = stats.to_json() if stats is not None else []
    return out


def relabel(report: dict, **chosen: Any) -> dict:
    """A copy of `report` whose lambda is for other parameters (`r`, `alpha`, `lambda_rule`; None keeps the
    report's), from each agent's counted rho (the rho it used where none was counted). `report` is unchanged."""
    parameters = {**report["parameters"], **{k: v for k, v in chosen.items() if v is not None}}
    rows = []
    for row in report["agents"]:
        rho = _float(row.get("rho_counted", row["rho"]))
        lam = statistics.lambda_shown(rho, parameters["r"], parameters["alpha"], parameters["lambda_rule"])
        rows.append({**row, "lambda": lam})
    return {**report, "parameters": parameters, "agents": rows}


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2, allow_nan=False) + "\n"


def installed_from() -> dict[str, str]:
    """Where this mergekit-ram came from (`versions.source`), without a machine's local path."""
    found = versions.source("mergekit-ram")
    kind = next((k for k in ("git", "checkout", "archive") if k in found), "index")
    return {"installed_from": kind, **{k: v for k, v in found.items() if k != "checkout"}}


def _versions() -> dict[str, str]:
    return {name: versions.installed(name) for name in VERSIONED}


def public_identity(identity: dict) -> dict:
    """The machine-independent part of cache.folder_identity (no mtimes/inodes)."""
    files = identity.get("files", {})
    material = [[n, f["size"], f.get("header_sha256"), f.get("sample_sha256")] for n, f in sorted(files.items())]
    out = {"content_id": hashlib.sha256(json.dumps(material).encode()).hexdigest()}
    if identity.get("revision"):
        out["revision"] = identity["revision"]
    return out


def card_section(report: dict) -> str:
    """Markdown for the model card: enough to reproduce and to understand the merge."""
    p = report["parameters"]
    v = report["versions"]
    lines = [
        "## RAM+ statistics",
        "",
        f"Merged with mergekit-ram {v['mergekit-ram']} (mergekit {v['mergekit']}, torch {v['torch']}), method "
        f"`ramplus`: RAM+ ([arXiv 2601.13572]({PAPER_URL})) with {_rho_sentence(p['rho_scope'])}.",
        "",
        f"Parameters: ε = {p['epsilon']:g}, r = {p['r']:g}, α = {p['alpha']:g}, λ rule `{p['lambda_rule']}`"
        + "".join(
            f"; {k} varies per tensor ({', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in vs)})"
            for k, vs in report["per_tensor_parameters"].items()
        )
        + (" (the table's λ uses the values above)" if report["per_tensor_parameters"] else "")
        + ".",
        "",
    ]
    if report["statistics"] == "not computed":
        lines += ["Statistics were not computed (r = 0, or ρ given for every agent).", ""]
    lines += [
        "| agent | density | unique | shared w/ 1 | shared w/ ≥2 | ρ | λ |",
        "|---|---|---|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in tables.agent_rows(report)),
        "",
        "*Density*: share of all the agent's parameters that it changed by more than ε. *Unique*, "
        "*shared w/ 1*, *shared w/ ≥2*: of the entries the agent changed, the share that no other agent, "
        "exactly one other agent, or two or more other agents also changed (they add up to 100%). "
        "ρ = shared / unique entries of the agent; λ scales its unique entries. "
        "ρ = inf means the agent has no unique entry, so its λ multiplies nothing."
        + (
            ""
            if p["rho_scope"] == "model"
            else f" ρ was counted per {p['rho_scope']}, so λ varies by group (`rho_by_group` in "
            "`ram_stats.json`); the table shows whole-model ρ and λ for reference."
        ),
        "",
        counted_sentence(report),
        "",
        *_diagnostics_section(report),
        "Inputs:",
        "",
        "| role | model | identity |",
        "|---|---|---|",
        f"| base | {report['base_model']['model']} | {_identity(report['base_model']['identity'])} |",
        *(f"| agent | {a['model']} | {_identity(a['identity'])} |" for a in report["agents"]),
        "",
        f"Per-tensor counts: `ram_stats.json`. To reproduce: {reproduce_sentence(report)}",
        "",
    ]
    return "\n".join(lines)


def _rho_sentence(scope: str) -> str:
    if scope == "model":
        return "one ρ per agent, counted over the whole model"
    return f"one ρ per agent and {'transformer block' if scope == 'layer' else 'tensor'} (`rho_scope: {scope}`)"


def reproduce_sentence(report: dict) -> str:
    """How a hub reader gets this mergekit-ram (it is not on PyPI), merges again, and checks the folder."""
    v = report["versions"]
    found = report.get("mergekit_ram_source") or {}
    commit = f" at commit `{found['commit']}`" if found.get("commit") else ""
    if found.get("git"):
        where = f'`pip install "git+{found["git"].removeprefix("git+")}{"@" + found["commit"] if commit else ""}"`'
    elif found.get("installed_from") == "archive":
        digest = f" (sha256 `{found['sha256']}`)" if found.get("sha256") else ""
        where = f"the wheel `{found.get('archive', 'mergekit_ram')}`{digest}: `pip install` it"
    else:
        where = f"its repository{commit}: `pip install .` in that checkout"
    entry = (report.get("merge") or {}).get("entry_point", "run_merge")
    command = (
        "`mergekit-pytorch` with the config in `ram_stats.json`'s `merge` record"
        if entry == "mergekit-pytorch"
        else "`mergekit-yaml mergekit_config.yml OUTPUT`"
    )
    return (
        f"mergekit-ram {v['mergekit-ram']} is not on PyPI; install it from {where}, with `mergekit=={v['mergekit']}` "
        f"(torch {v['torch']} was used), then run {command} with the inputs above; check this folder against its "
        "inputs with `mergekit-ram verify <folder>` (it recomputes every tensor and compares the bits, writing "
        "nothing)."
    )


def hub_id(path: str) -> str | None:
    """The hub id of a hub cache snapshot folder (`.../models--org--name/snapshots/<commit>`), else None."""
    parts = path.replace("\\", "/").rstrip("/").split("/")
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


def card_front_matter(card: str, hub_ids: Sequence[str]) -> str:
    """mergekit's card with front matter a hub accepts (https://huggingface.co/docs/hub/model-cards):
    `base_model` the inputs' hub ids (`hub_ids`, where known; a local path is none, and an empty list is left
    out), `base_model_relation: merge`, the method as a tag (`ramplus`), and the `license` field named for the
    user to fill (the inputs' licenses apply; no default is chosen for them)."""
    import yaml

    if not card.startswith("---\n") or "\n---\n" not in card[4:]:
        return card
    head, body = card[4:].split("\n---\n", 1)
    try:
        meta = yaml.safe_load(head) or {}
    except yaml.YAMLError:
        return card
    if not isinstance(meta, dict):
        return card
    ids = list(dict.fromkeys([*(meta.get("base_model") or []), *hub_ids]))
    meta.pop("base_model", None)
    if ids:
        meta["base_model"] = ids
        meta["base_model_relation"] = "merge"
    meta["tags"] = [*(meta.get("tags") or []), *([] if "ramplus" in (meta.get("tags") or []) else ["ramplus"])]
    text = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip("\n")
    if "license" not in meta:
        text += (
            "\n# license: the merged model's license, for you to set (the inputs' licenses apply); "
            "see https://huggingface.co/docs/hub/repositories-licenses"
        )
    return f"---\n{text}\n---\n{body}"


def counted_sentence(report: dict) -> str:
    """What the statistics counted: the tensors, and tied pairs counted once."""
    tensors = report.get("tensors") or []
    text = (
        f"Counted: {len(tensors)} tensors, {sum(t['numel'] for t in tensors):,} parameters per agent."
        if tensors
        else "Counted: nothing (no statistics pass)."
    )
    tied = report.get("tied_counted_once") or {}
    if tied:
        pairs = ", ".join(f"`{copy}` (tied to `{target}`)" for copy, target in sorted(tied.items()))
        text += (
            f" Tied to another tensor by `tie_word_embeddings`, and so counted once with it (the output stores "
            f"both; transformers loads one): {pairs}."
        )
    return text


def _diagnostics_section(report: dict) -> list[str]:
    rows = tables.diagnostic_rows(report)
    if not rows:
        return []
    lines = [
        "Diagnostics (which regime the agents are in):",
        "",
        "| agent | share of its update (Σ\\|τ\\|) in unique entries | changes of one dtype step |",
        "|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]
    pairs = tables.pair_rows(report)
    if pairs:
        lines += [
            "| agents | entries both changed | same sign | cosine over those entries |",
            "|---|---|---|---|",
            *("| " + " | ".join(row) + " |" for row in pairs),
            "",
        ]
    lines += [
        "At an entry two or more agents changed, RAM takes the mean of their updates and task arithmetic "
        "(weight 1) their sum. Where the updates agree (same sign, cosine near 1) the sum counts a common "
        "update once per agent and the mean once; where they are one-step changes of either sign (cosine "
        "near 0), the mean shrinks them. These numbers describe the agents; they do not by themselves say "
        "which method keeps more of their skills.",
        "",
    ]
    return lines


def _identity(identity: dict) -> str:
    if not identity:
        return "—"
    parts = []
    if identity.get("revision"):
        parts.append(f"revision `{identity['revision']}`")
    if identity.get("content_id"):
        parts.append(f"content id `{identity['content_id'][:16]}`")
    return ", ".join(parts)


def _number(value):
    if value is None:
        return None
    return "inf" if math.isinf(value) else value


def _float(value):
    """The inverse of `_number`."""
    return math.inf if value == "inf" else value
