"""What a RAM+ merge publishes: `ram_stats.json`, from which the model card's section is made (`card`).

Both are built from the same report dict, so the card, the JSON and `mergekit-ram inspect` never disagree.
Schema (format_version 4):

- `parameters`: epsilon, r, alpha, rho_scope, lambda_rule as planned for the
  first tensor; `per_tensor_parameters` maps each parameter that varies across
  tensors (mergekit filters or gradients) to its distinct values.
- `statistics`: "computed", "cache" or "not computed" (r = 0 / rho given).
- `versions`: mergekit, mergekit-ram, torch; `mergekit_ram_source`: where this mergekit-ram was installed from
  (`versions.source`: `installed_from` "git", "checkout", "editable", "wheel", "sdist", "archive", "index" or
  "unknown"; `url` (a network URL to install that code from), `commit`, `changes` ("uncommitted", "unknown"),
  `archive` (a file name), `sha256`, `project_url` where known; never a local path).
- `merge` (format_version 3): how the merge was run, for `mergekit-ram verify`: `entry_point`
  ("run_merge": mergekit-yaml, mergekit-multi or the Python API, whose config is the folder's
  `mergekit_config.yml`), `options` (the values of the mergekit options that change what is
  merged, `RECORDED_OPTIONS`), and what that entry point adds (mergekit-pytorch: its `config`).
- `inputs` (format_version 4): label -> `role` ("base" or "agent"), `model` (the path or hub id as the config
  names it: the one place it is written, but a mergekit-pytorch record's config) and `identity` (`revision`
  for hub snapshots; `content_id` = sha256 over each file's name, size, safetensors header (tensor names,
  dtypes, shapes, offsets) and sixteen evenly spaced 64 KiB samples of its bytes: a fingerprint, not a hash
  of every weight). A label (`labels.input_labels`) is short and names the input everywhere else.
- `base_model`: the base's label; `agents[]`: per agent its `label`, active, shared, unique, shared_with_1,
  shared_with_2plus, numel, density, unique_share, shared_with_1_share, shared_with_2plus_share,
  rho_counted, rho (used), rho_source ("counted" or "given"), lambda.
  Infinite values are written as the string "inf".
- diagnostics per agent (when counted, format_version 2): single_step (active entries one
  step of the dtype from the base) and single_step_share; magnitude_unique, magnitude_shared
  (sum of |tau| over its unique / shared entries) and magnitude_unique_share.
- `pairs[]` (format_version 2): per pair of agents, `agents` [a, b] (labels), `common` (entries both
  changed), `same_sign`, `same_sign_share` and `cosine` of the two task vectors over the
  common entries (null when they have none).
- `rho_by_group` (rho_scope layer/tensor): group -> agent label -> rho.
- `tied_counted_once`: tensor -> the tensor it is tied to (`tie_word_embeddings`; counted once).
- `tensors[]`: name, numel, epsilon, counts {label: [active, unique, pair]}
  (pair = entries exactly one other agent changed too), and `diagnostics`: single
  {label: n}, magnitude {label: [unique, shared]}, pairs [[a, b, common, same_sign,
  sum tau_a tau_b, sum tau_a^2, sum tau_b^2]].

Formats 1 to 3 named each input by its path in every place (`base_model` and `agents[]` held `model` and
`identity`); `labels.upgraded` reads them in format 4's shape.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ram.checks import output_checks
from mergekit_ram.core import statistics
from mergekit_ram.reporting import versions
from mergekit_ram.reporting.labels import input_labels
from mergekit_ram.session import Planned

FORMAT = output_checks.STATS_FORMAT
#: 2: diagnostics (per agent and `pairs`) added; 3: the `merge` record; 4: inputs named by label, one `inputs` table
FORMAT_VERSION = 4
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
    "active",
    "shared",
    "unique",
    "shared_with_1",
    "shared_with_2plus",
    "numel",
    "density",
    "unique_share",
    "shared_with_1_share",
    "shared_with_2plus_share",
)
AGENT_DIAGNOSTICS = (
    "single_step",
    "single_step_share",
    "magnitude_unique",
    "magnitude_shared",
    "magnitude_unique_share",
)


def run_record(entry_point: str, options: Any, **extra: Any) -> dict[str, Any]:
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
    labels: Mapping[str, str] | None = None,
    tied: dict[str, str] | None = None,
    record: dict[str, Any] | None = None,
) -> dict:
    """The report of one planned ramplus merge (`planned`: its counted tensors, in planning order;
    `labels`: input -> its label, where chosen already (`verify`: the recorded ones; the others are derived,
    `labels.input_labels`); `tied`: tensors counted once with the tensor they are tied to; `record`: how the
    merge was run)."""
    first = planned[0]
    params = dict(first.parameters)  # every ramplus parameter, in params.DEFAULTS order
    varying = {
        k: sorted({t.parameters[k] for t in planned}, key=str)
        for k in params
        if any(t.parameters[k] != params[k] for t in planned)
    }
    base = first.base
    named = input_labels([base, *first.agents], labels)
    totals = stats.totals() if stats is not None else {}
    inputs = {
        named[model]: {"role": role, "model": model, "identity": identities.get(model, {})}
        for model, role in [(base, "base"), *((agent, "agent") for agent in first.agents)]
    }
    rows = []
    for model in first.agents:
        given = first.given_rho.get(model)
        s = totals.get(model)
        row: dict = {"label": named[model]}
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
        "versions": installed_versions(),
        "mergekit_ram_source": installed_from(),
        "merge": dict(record or {"entry_point": "run_merge"}),
        "inputs": inputs,
        "base_model": named[base],
        "agents": rows,
    }
    if stats is not None and params["rho_scope"] != "model":
        out["rho_by_group"] = {
            g: {named.get(a, a): _number(v) for a, v in rhos.items()}
            for g, rhos in stats.rho(params["rho_scope"]).items()
        }
    out["pairs"] = [
        {
            "agents": [named.get(p.a, p.a), named.get(p.b, p.b)],
            "common": p.common,
            "same_sign": p.same_sign,
            "same_sign_share": p.same_sign_share,
            "cosine": p.cosine,
        }
        for p in (stats.pair_totals() if stats is not None else [])
    ]
    out["tied_counted_once"] = dict(tied or {})
    out["tensors"] = stats.to_json(named) if stats is not None else []
    return out


def labels_of(report: dict) -> dict[str, str]:
    """input (as the config names it) -> its label, from a report's `inputs` table."""
    return {row["model"]: label for label, row in report["inputs"].items()}


def with_lambda_for(report: dict, **chosen: Any) -> dict:
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
    return versions.source("mergekit-ram")


def installed_versions() -> dict[str, str]:
    """The installed versions a report records (`VERSIONED`): verify compares the record's with them."""
    return {name: versions.installed(name) for name in VERSIONED}


def public_identity(identity: dict) -> dict:
    """The machine-independent part of cache.folder_identity (no mtimes/inodes)."""
    files = identity.get("files", {})
    material = [[n, f["size"], f.get("header_sha256"), f.get("sample_sha256")] for n, f in sorted(files.items())]
    out = {"content_id": hashlib.sha256(json.dumps(material).encode()).hexdigest()}
    if identity.get("revision"):
        out["revision"] = identity["revision"]
    return out


def _number(value):
    if value is None:
        return None
    return "inf" if math.isinf(value) else value


def _float(value):
    """The inverse of `_number`."""
    return math.inf if value == "inf" else value
