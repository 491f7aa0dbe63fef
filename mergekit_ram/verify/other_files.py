"""`mergekit-ram verify`, first and last steps: the folder's own files, before anything opens one
(`refusal`), and the files beside the weights, once the merge has run again (`check`).

Every file a loader reads is checked, or makes the verdict "differs": `ram_stats.json`'s statistics and the card's
RAM+ section against the recomputed report (the method's own checks, `recompute.MethodChecks`); `config.json`
against the config mergekit writes for the planned merge (`_model_out_config`, as the planner holds it); the
tokenizer, chat template and generation config files against the base's when mergekit copies them byte for byte; the
weight files another loader reads when they are not those mergekit reads (a single file beside an index, pickles
beside safetensors). A file a loader reads that the merge does not write (a PEFT adapter, code, a tokenizer file the
base lacks) is a difference. "Not checked" names only the files no loader reads, and a tokenizer the merge built
(not copied), which verify does not build again. The files are read and named by `folder_checks` and `loader_files`;
the judging is `published_checks`', on plain data.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mergekit_ram.checks import input_checks, output_checks
from mergekit_ram.verify import folder_checks, loader_files, published_checks, recompute, record_checks, verdict

#: files verify reads to plan and compare (checked on their own)
RECORDS = (output_checks.STATS_FILE, record_checks.CONFIG_FILE)


def refusal(folder: str) -> str | None:
    """Why the folder's weights cannot be checked, or None: every file a loader reads must be one `checked_path`
    accepts (errors.Unreadable otherwise: no FIFO, device or link out of the folder is ever opened), and a pickle
    among them is named, without unpickling it, when it refers to more than tensors or when mergekit's loader
    would unpickle it fully."""
    choices = loader_files.loader_choices(folder)
    loader_files.check_files(folder, choices)
    pickled = loader_files.pickles(folder, choices)
    if pickled and input_checks.forced_unsafe():
        return (
            f"{pickled[0]} is a pickle and {input_checks.FORCE_UNSAFE} is set: mergekit's loader would unpickle it "
            "fully (torch.load without weights_only), which could run code; unset it to verify"
        )
    for file in pickled:
        try:
            input_checks.check_pickle(file)
        except ValueError as error:
            return str(error).replace("input file ", "", 1)
    return None


def check(
    folder: str,
    recorded: dict,
    recomputed: dict,
    outcome: verdict.Outcome,
    method: recompute.MethodChecks,
    *,
    out_config: Any = None,
    merge_config: Any = None,
    donor: str | None = None,
    code: bool = False,
) -> None:
    """The folder's files other than the weights (`recomputed`: the report of the merge run again, labelled as
    recorded; `out_config`: the config mergekit writes, None for mergekit-pytorch, which writes none (nor a
    card, nor a tokenizer); `donor`: the local folder mergekit copies the tokenizer and the config from; `code`:
    the merge ran with trust_remote_code, so its config carries the donor's code beside it)."""
    covered = set(RECORDS)
    choices = loader_files.loader_choices(folder)
    if method.checked_record is not None:
        outcome.checked.append(method.checked_record)
    what = "tensors" if outcome.sample is None else "tensors' slices (the rest whole, where named)"
    outcome.checked.append(
        f"{outcome.compared:,} {what} bit for bit (in what mergekit reads: {choices.get('mergekit')})"
    )
    for choice in choices.values():
        covered |= {choice, *loader_files.weight_files(folder, choice)}
    found, seen = published_checks.other_view_differences(folder, choices)
    outcome.files += found
    outcome.checked += [f"{line} (the same tensors)" for line in seen]
    method.check_statistics(recorded, recomputed, outcome)
    present = loader_files.beside(folder)
    covered |= set(present)
    adapter = [name for name in present if name in loader_files.ADAPTER]
    if adapter:
        outcome.files.append(
            f"{', '.join(adapter)}: a PEFT adapter, which transformers' from_pretrained applies over the weights "
            "whenever peft is installed (mergekit installs it); a merge writes none"
        )
    if out_config is not None:
        _config(folder, out_config, merge_config, outcome)
        covered.add("README.md")
        method.check_card(folder, recorded, outcome)
    elif "config.json" in present:
        outcome.files.append(f"config.json: {NOT_WRITTEN} (mergekit-pytorch writes none)")
    others = [name for name in present if name not in adapter and name != "config.json"]
    _copied(folder, others, merge_config, donor, outcome)
    rest = [name for name in folder_checks.files_under(folder) if name not in covered]
    _code(folder, [name for name in rest if loader_files.is_code(name)], donor if code else None, outcome)
    rest = [name for name in rest if not loader_files.is_code(name)]
    if rest:
        outcome.not_checked.append(f"{folder_checks.listed(rest, 10)} (no loader reads them as part of the model)")


def _code(folder: str, found: list[str], donor: str | None, outcome: verdict.Outcome) -> None:
    """Python files: code transformers runs with trust_remote_code. A merge run with it writes the donor's config
    module beside its config (transformers' `save_pretrained`): a copy of the donor's (`donor`) is checked; any
    other is not the merge's."""
    same = published_checks.copied_files(folder, donor, found)[0] if donor else []
    if same:
        outcome.checked.append(f"{', '.join(same)} (copies of {donor}'s code, as the merge writes with its config)")
    other = [name for name in found if name not in same]
    if other:
        outcome.files.append(
            f"{folder_checks.listed(other, 3)}: Python code, which transformers runs with trust_remote_code (a "
            "config's auto_map, custom_generate/); the merge writes no such file"
        )


#: what verify says of a file a loader reads that the merge does not write
NOT_WRITTEN = "a loader reads it, and the merge writes none"


def _config(folder: str, out_config: Any, merge_config: Any, outcome: verdict.Outcome) -> None:
    """config.json against the config mergekit writes for this merge: as transformers reads both (a value at its
    default and the value written out are the same), and key by key as written (a key transformers ignores is
    still read by other tools)."""
    import transformers

    if not os.path.lexists(os.path.join(folder, "config.json")):
        outcome.files.append("config.json: absent; the merge writes it")
        return
    raw = folder_checks.read_json(folder, "config.json", folder_checks.TEXT_LIMIT)
    if not isinstance(raw, dict):
        outcome.files.append("config.json: not a JSON object")
        return
    try:
        found = _plain(type(out_config).from_dict(dict(raw)).to_dict())
    except Exception as error:
        name = type(out_config).__name__
        outcome.files.append(f"config.json: transformers cannot read it as a {name} ({type(error).__name__})")
        return
    expected = _plain(out_config.to_dict())
    unchecked = {"_name_or_path", "transformers_version"}
    if merge_config is not None and (merge_config.tokenizer_source or merge_config.tokenizer):
        unchecked.add("vocab_size")  # set from the tokenizer the merge builds
        outcome.not_checked.append("config.json's vocab_size (set from the tokenizer the merge builds)")
    for key in unchecked:
        found.pop(key, None)
        expected.pop(key, None)
    differ = published_checks.config_differences(found, expected)
    written = published_checks.config_differences(
        {k: v for k, v in raw.items() if k not in unchecked}, expected, only=True
    )
    said = {line.split(" is ")[0] for line in differ}
    written = [line for line in written if line.split(" is ")[0] not in said]
    by, installed = raw.get("transformers_version"), transformers.__version__
    if by == installed:
        differ += written
    else:  # another transformers writes other keys: not a difference of the folder
        outcome.notes += [f"{line} (written by transformers {by}; {installed} is installed)" for line in written]
    outcome.files += differ
    if not differ:
        outcome.checked.append("config.json (as mergekit writes it for this merge)")


def _plain(value: dict) -> dict:
    """A config's dict as JSON holds it (a dtype as its name)."""
    return json.loads(json.dumps(value, default=str))


def _copied(folder: str, present: list[str], merge_config: Any, donor: str | None, outcome: verdict.Outcome) -> None:
    """Tokenizer, chat template and generation config files (`present`): against the base's when mergekit copies
    them byte for byte (`_copy_tokenizer`: a file the base lacks, or a named chat template, is not the merge's);
    else the tokenizer the merge built is named as unchecked, and a generation config is not the merge's."""
    if not present:
        return
    if merge_config is None:
        outcome.files.append(f"{', '.join(present)}: {NOT_WRITTEN} (mergekit-pytorch writes none)")
        return
    copies = (
        donor is not None
        and not merge_config.chat_template
        and not merge_config.tokenizer_source
        and not merge_config.tokenizer
        and os.path.isfile(os.path.join(donor, "tokenizer_config.json"))
        and any(os.path.isfile(os.path.join(donor, n)) for n in ("tokenizer.json", "tokenizer.model"))
    )
    if not copies:
        generation = [name for name in present if name == "generation_config.json"]
        outcome.files += [
            f"{name}: {NOT_WRITTEN} (it copies one only with the base's tokenizer)" for name in generation
        ]
        built = [name for name in present if name not in generation]
        if built:
            outcome.not_checked.append(
                f"{', '.join(built)} (the merge builds the tokenizer; verify does not build it again)"
            )
        return
    assert donor is not None
    same, differ = published_checks.copied_files(folder, donor)
    outcome.files += [f"{name}: not the base's ({donor}), which the merge copies" for name in differ]
    if same:
        outcome.checked.append(f"{', '.join(same)} (copies of the base's)")
    for name in present:
        if name in same or name in differ:
            continue
        if name in loader_files.COPIED:
            outcome.files.append(
                f"{name}: {NOT_WRITTEN} (it copies the base's tokenizer files, and {donor} has no {name})"
            )
        else:
            outcome.files.append(f"{name}: {NOT_WRITTEN} (it copies no named chat template)")
