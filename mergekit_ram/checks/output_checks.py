"""Where a `ramplus` merge writes: never into an input model (for `mergekit-pytorch`, whose inputs
are files: never into the folder holding an input file), a config mergekit can write into
the model card, and an output folder that ends up holding this merge's weights alone.

Output folder policy: when a `ramplus` merge finishes, the weight files and indexes that an
earlier merge left in the output folder and this merge did not write are removed, each named
in the log (a loader would read them: transformers prefers `model.safetensors` over an index,
an index loader reads the shards it names). Only files directly in the output folder whose
name is a weight file's, unchanged since before the merge, are removed; a symlink is removed
itself, never followed. Another method merging into a folder that held a `ramplus` merge has
that merge's `ram_stats.json` removed (it would describe other weights); nothing else of what
mergekit's own methods write is touched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from typing import Any

from mergekit_ram.checks.config_checks import models_in_order
from mergekit_ram.errors import RamError

LOG = logging.getLogger("mergekit_ram")
STATS_FILE = "ram_stats.json"
#: the `format` of a ram_stats.json this package writes (report.FORMAT)
STATS_FORMAT = "mergekit-ram/ram_stats"


def check_output(config: Any, out_path: str, hub_cache: str | None = None) -> None:
    """Refuse an output folder that is, or is inside, an input model's folder (a hub id's snapshot included: the
    Hub cache, `check_place`), a path that is a file, or one that cannot be written."""
    check_not_a_file(out_path)
    out = os.path.realpath(out_path)
    for model in models_in_order(config):
        path = model.model.path
        if os.path.isdir(path):
            real = os.path.realpath(path)
            if out == real or out.startswith(real + os.sep):
                raise RamError(
                    f"output folder {out_path} is inside the input model {model}; "
                    "the merge would overwrite it. Choose another output folder."
                )
    check_place(out_path, hub_cache)


def check_place(out_path: str, hub_cache: str | None = None) -> None:
    """Refuse an output folder anywhere inside the Hugging Face Hub cache (huggingface_hub's `HF_HUB_CACHE`, from
    `HF_HOME`, and the `cache_dir` a merge gives it, `hub_cache`): its snapshots' files are links into blobs
    shared by every revision of a repository, a hub id input's among them. Then one that cannot be written
    (a read-only file system, a folder not the user's to write), said before the merge runs."""
    from huggingface_hub import constants

    out = os.path.realpath(out_path)
    for cache in {constants.HF_HUB_CACHE, *([hub_cache] if hub_cache else [])}:
        root = os.path.realpath(os.path.expanduser(cache))
        if out == root or out.startswith(root + os.sep):
            parts = os.path.relpath(out, root).split(os.sep)
            repo = parts[0].split("--", 1)[-1].replace("--", "/") if parts[0].startswith("models--") else None
            at = parts[2] if repo and len(parts) > 2 and parts[1] == "snapshots" else None
            snapshot = f" (the snapshot of {repo} at {at})" if at else ""
            raise RamError(
                f"output folder {out_path} resolves to {out}, inside the Hugging Face Hub cache {root}{snapshot}: "
                "its files are links shared by every revision of a repository. Choose another output folder."
            )
    existing = out
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(existing).f_flag & getattr(os, "ST_RDONLY", 1))
        why = "on a read-only file system" if read_only else "not writable by you"
        raise RamError(f"output folder {out_path} cannot be written: {existing} is {why}. Choose another output folder")


def check_not_a_file(out_path: str) -> None:
    """An output path that is a file (mergekit would fail creating the folder, naming neither)."""
    if os.path.exists(out_path) and not os.path.isdir(out_path):
        raise RamError(f"output folder {out_path} is a file, not a folder. Choose another output folder.")


def check_output_files(inputs: list[str], out_path: str, hub_cache: str | None = None) -> None:
    """`mergekit-pytorch`, whose inputs are files: refuse an output folder that is an input file, or the folder
    holding one (the merge writes `model.safetensors` and `ram_stats.json` there, could overwrite an input of
    that name, and would remove an earlier merge's weight files there). A new folder inside it, or one that
    holds input folders further down, is allowed: nothing is written beside an input."""
    out = os.path.realpath(out_path)
    for path in inputs:
        if not os.path.exists(path):
            continue  # the input checks name it
        beside = {os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.dirname(os.path.realpath(path))}
        if out == os.path.realpath(path):
            raise RamError(f"output folder {out_path} is the input file {path}. Choose another output folder.")
        if out in beside:
            raise RamError(
                f"output folder {out_path} is the folder of the input file {path}; the merge would write its "
                "weight files beside the inputs (and over one named like them). Choose another output folder, "
                "for example a new folder inside it."
            )
    check_not_a_file(out_path)
    check_place(out_path, hub_cache)


def check_config_serialisable(config: Any) -> None:
    """mergekit writes `config.to_yaml()` into the card, after the weights, when it was given no YAML text.

    mergekit 0.1.5's `ModelReference` serialiser returns itself for a path holding a space or
    a double quote, which pydantic reports as "Circular reference detected" once the whole
    model is written (plain mergekit methods too). Say so before any weight is read.
    """
    try:
        config.to_yaml()
    except ValueError as error:
        odd = [str(m) for m in config.referenced_models() if " " in str(m) or '"' in str(m)]
        where = f"model path(s) {' and '.join(sorted(odd))}" if odd else "this configuration"
        raise RamError(
            f"mergekit cannot write {where} into the model card ({error}; mergekit 0.1.5 fails on paths "
            "with a space or a double quote). Pass the YAML text as run_merge(..., config_source=TEXT) "
            "(mergekit-yaml does), turn the card off, or use a path without them."
        ) from error


# what a model's weights are stored as: mergekit's names (single file, shards, a killed merge's
# numbered shards) and transformers' indexes
_WEIGHTS = re.compile(r"(model|pytorch_model)(-\d+(-of-\d+)?)?\.(safetensors|bin)(\.index\.json)?")


def weight_files(out_path: str | None) -> dict[str, tuple[int, int, int, int]]:
    """Weight files and indexes directly in the output folder (regular files and symlinks, not
    followed), with what tells a rewrite: inode, size, mtime, ctime."""
    found: dict[str, tuple[int, int, int, int]] = {}
    if not out_path or not os.path.isdir(out_path):
        return found
    for name in os.listdir(out_path):
        if _WEIGHTS.fullmatch(name):
            st = os.lstat(os.path.join(out_path, name))
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):  # a link itself, never its target
                found[name] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return found


def remove_stale_weights(out_path: str | None, before: dict[str, tuple[int, int, int, int]]) -> list[str]:
    """After a `ramplus` merge: remove the weight files and indexes an earlier merge left that this
    merge did not write (unchanged since `before`), naming each."""
    removed = []
    for name, seen in sorted(weight_files(out_path).items()):
        if before.get(name) == seen:  # untouched by this merge
            path = os.path.join(str(out_path), name)
            LOG.warning("ramplus: removing %s, left by an earlier merge (this merge did not write it)", path)
            os.unlink(path)
            removed.append(name)
    return removed


def remove_stale_statistics(out_path: str) -> None:
    """Before a `ramplus` merge writes: an older merge's ram_stats.json would mark the new, unfinished
    merge as complete, so it goes first, and the merge it describes is named in a warning (in an `r` sweep into one
    folder that was the easiest way to lose a result); weight files already there are named (removed at the end).

    A warning, not a refusal: mergekit overwrites an output folder without a word and its commands have no flag to
    consent with, and `merge_method: ramplus` must change nothing else about running them."""
    path = os.path.join(out_path, STATS_FILE)
    if os.path.isfile(path) and not os.path.islink(path):
        earlier = earlier_merge(path)
        if earlier:
            LOG.warning("ramplus: this merge replaces the earlier ramplus merge in %s (%s)", out_path, earlier)
        LOG.info("ramplus: removing %s of an earlier merge (it is written again when this merge finishes)", path)
        os.unlink(path)
    weights = sorted(weight_files(out_path))
    if weights:  # a prediction: a rerun writes them all again; each one removed is named then (a warning)
        LOG.info(
            "ramplus: the output folder %s already holds %s; the weight files this merge does not write again "
            "are removed when it finishes",
            out_path,
            ", ".join(weights),
        )


def remove_foreign_statistics(out_path: str | None) -> None:
    """Another method merging into a folder that held a `ramplus` merge: its ram_stats.json would
    describe weights it no longer sits beside. Never raises (mergekit's methods must run)."""
    try:
        path = os.path.join(str(out_path), STATS_FILE)
        if not out_path or os.path.islink(path) or not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            if json.load(f).get("format") != STATS_FORMAT:
                return  # not ours
        LOG.warning(
            "mergekit-ram: removing %s of an earlier ramplus merge (%s): it does not describe this merge",
            path,
            earlier_merge(path),
        )
        os.unlink(path)
    except Exception as error:
        LOG.warning("mergekit-ram: could not check %s for a stale %s: %s", out_path, STATS_FILE, error)


def earlier_merge(path: str) -> str | None:
    """What the ram_stats.json at `path` records, on one line (its r, alpha, base and agents), or None when
    this package did not write it or it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
        if found.get("format") != STATS_FORMAT:
            return None
        chosen = found.get("parameters", {})
        inputs = found.get("inputs")  # format 4: label -> role, model; before, base_model and agents held models
        if isinstance(inputs, dict):
            base = next((row.get("model") for row in inputs.values() if row.get("role") == "base"), None)
            agents = ", ".join(str(row.get("model")) for row in inputs.values() if row.get("role") == "agent")
        else:
            agents = ", ".join(str(agent.get("model")) for agent in found.get("agents", []))
            base = found.get("base_model", {}).get("model")
        return f"r={chosen.get('r')}, alpha={chosen.get('alpha')}, base {base}, agents {agents}"
    except (OSError, ValueError, AttributeError, TypeError):
        return None
