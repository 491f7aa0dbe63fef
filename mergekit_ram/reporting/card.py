"""The model card's "RAM+ statistics" section and front matter, built from a report (`report.build`) alone.

The section names each input by its label (`labels.input_labels`) and its path or hub id once, in the inputs
table; how to reproduce the merge is said from what the report records of where mergekit-ram came from
(`versions.source`), never with a local path; `mergekit-ram verify` rebuilds the section from
`ram_stats.json` and compares it with the card.
"""

from __future__ import annotations

from mergekit_ram.reporting import tables

#: The method's paper, linked from the card.
PAPER_URL = "https://arxiv.org/abs/2601.13572"


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
        *("| " + " | ".join(map(tables.cell, row)) + " |" for row in tables.agent_rows(report)),
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
        "Inputs (the tables above name each by its label):",
        "",
        "| label | role | input | identity |",
        "|---|---|---|---|",
        *(
            f"| {tables.cell(label)} | {row['role']} | {tables.cell(row['model'])} | {_identity(row['identity'])} |"
            for label, row in report["inputs"].items()
        ),
        "",
        f"Per-tensor counts: `ram_stats.json`. To reproduce: {reproduce_sentence(report)}",
        "",
        f"To check it: {verify_sentence()}",
        "",
    ]
    return "\n".join(lines)


def _rho_sentence(scope: str) -> str:
    if scope == "model":
        return "one ρ per agent, counted over the whole model"
    return f"one ρ per agent and {'transformer block' if scope == 'layer' else 'tensor'} (`rho_scope: {scope}`)"


def reproduce_sentence(report: dict) -> str:
    """How a hub reader gets this mergekit-ram (`install_sentence`) and merges again."""
    v = report["versions"]
    entry = (report.get("merge") or {}).get("entry_point", "run_merge")
    command = (
        "`mergekit-pytorch` with the config in `ram_stats.json`'s `merge` record"
        if entry == "mergekit-pytorch"
        else "`mergekit-yaml mergekit_config.yml OUTPUT`"
    )
    return (
        f"{install_sentence(report)} With `mergekit=={v['mergekit']}` (torch {v['torch']} was used), run {command} "
        "with the inputs above."
    )


def install_sentence(report: dict) -> str:
    """Where a reader gets the mergekit-ram that merged, from what `ram_stats.json` records
    (`versions.source`): a pip command where one installs that code, else what is missing."""
    v = report["versions"]["mergekit-ram"]
    found = report.get("mergekit_ram_source") or {}
    kind, url, commit = found.get("installed_from"), found.get("url"), found.get("commit")
    if kind == "index":
        return f'`pip install "mergekit-ram=={v}"` installs the mergekit-ram that merged (from a package index).'
    absent = f"mergekit-ram {v} is not on PyPI"
    if kind in ("git", "checkout", "editable"):
        if not commit:
            return (
                f"{absent}; it was installed from a folder that is not a git checkout, so no commit or repository "
                "is recorded: no command can install it from this card."
            )
        if url:
            spec, sep, sub = url.partition("#")  # a #subdirectory= comes after the commit
            text = f'{absent}: `pip install "git+{spec}@{commit}{sep}{sub}"` installs the commit that merged.'
        else:
            where = {"git": "a git clone", "checkout": "a checkout", "editable": "a checkout (editable)"}[kind]
            text = (
                f"{absent}; it was installed from {where} at commit `{commit}`, which names no public repository "
                "(no network `origin` remote, and the project declares no Source URL): no command can install it "
                "from this card."
            )
        if found.get("changes") == "uncommitted":
            text += " The merge ran that commit plus uncommitted changes, which no commit holds."
        elif found.get("changes") == "unknown":
            text += (
                " That is the checkout's commit when the merge ran: pip records neither the commit nor the "
                "uncommitted changes of a folder installed without -e."
            )
        return text
    if kind in ("wheel", "sdist", "archive"):
        digest = f" (sha256 `{found['sha256']}`)" if found.get("sha256") else ""
        if url:
            return f'{absent}: `pip install "{url}"` installs the {kind} that merged{digest}.'
        declared = found.get("project_url")
        return f"{absent}; it was installed from the {kind} `{found.get('archive', 'mergekit_ram')}`{digest}, a " + (
            f"local file; its project names its source, {declared}, but not the commit the {kind} was built from."
            if declared
            else "local file that names no public place to get it from."
        )
    return f"{absent}; where it came from is not recorded."


def verify_sentence() -> str:
    """The command a reader runs to check the merge: by its Hub repository's id once the folder is pushed, else the
    folder (inputs held as local copies named by label)."""
    return (
        "`mergekit-ram verify ORG/NAME`, with this repository's id on the Hub (`ORG/NAME@REVISION` for one commit), "
        "or `mergekit-ram verify FOLDER` for a copy of this folder, recomputes every tensor from the inputs and "
        "compares the bits, writing nothing; inputs held as local copies: `--input-dir DIR` (a folder of copies "
        "named by label) or `--input LABEL=COPY`."
    )


#: the front matter's tags: mergekit's own, then the method
TAGS = ("mergekit", "merge", "ramplus")


def lineage(report: dict) -> list[str]:
    """The hub ids of a report's inputs (a hub id as given, without its revision, or a hub cache snapshot's), in
    the inputs table's order: what the card's `base_model` lists and `verify` expects there. A local folder is
    none: its identity records no revision."""
    from mergekit_ram.reporting.labels import hub_id

    ids = []
    for row in (report.get("inputs") or {}).values():
        model, identity = str(row.get("model")), row.get("identity") or {}
        if identity.get("revision"):
            ids.append(hub_id(model) or model.split("@", 1)[0])
    return list(dict.fromkeys(ids))


def front_matter(report: dict) -> dict:
    """What a merge of `report` writes in its card's front matter, of the keys `verify` checks: `base_model` and
    `base_model_relation` (absent when no input is a hub id) and `tags`."""
    ids = lineage(report)
    return {**({"base_model": ids, "base_model_relation": "merge"} if ids else {}), "tags": list(TAGS)}


def card_front_matter(card: str, report: dict) -> str:
    """mergekit's card with front matter a hub accepts (https://huggingface.co/docs/hub/model-cards):
    `base_model` the inputs' hub ids (`lineage`, in the inputs' order; a local path is none, and an empty list is
    left out), `base_model_relation: merge`, the tags (`TAGS`), and the `license` field named for the user to fill
    (the inputs' licenses apply; no default is chosen for them)."""
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
    for key in ("base_model", "base_model_relation", "tags"):  # mergekit's from its set of models: ours instead
        meta.pop(key, None)
    meta = {**front_matter(report), **meta}
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
        *("| " + " | ".join(map(tables.cell, row)) + " |" for row in rows),
        "",
    ]
    pairs = tables.pair_rows(report)
    if pairs:
        lines += [
            "| agents | entries both changed | same sign | cosine over those entries |",
            "|---|---|---|---|",
            *("| " + " | ".join(map(tables.cell, row)) + " |" for row in pairs),
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
