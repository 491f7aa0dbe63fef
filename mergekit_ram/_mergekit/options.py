"""mergekit's merge options, declared for `inspect` and `verify` without importing mergekit.

mergekit builds its merge options (`mergekit.options.add_merge_options`) from the fields of `MergeOptions`,
whose module imports torch and transformers: 4 s on a quiet machine, 40 s on a busy one, before
`mergekit-ram inspect --help` could print. `FIELDS` is mergekit 0.1.5's list, in its order, with its help;
`declare` makes each the option `add_merge_options` makes (`-q` added to `--quiet`), and `merge_options` builds
the `MergeOptions` once the command runs. tests/test_cli.py checks each declaration against mergekit's own, so a
mergekit that adds, drops or changes an option fails there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

#: name -> (type, default, help) of each `MergeOptions` field that `inspect` takes (`verify` less those its
#: folder's record fixes), in mergekit's order, with mergekit's `OPTION_HELP`
FIELDS: dict[str, tuple[type, Any, str]] = {
    "allow_crimes": (bool, False, "Allow mixing architectures"),
    "unsafe_truncate_embeddings": (
        bool,
        False,
        "UNSAFE: discard trailing embedding rows to match the smallest vocabulary. Assumes identical token IDs; "
        "use tokenizer configuration instead.",
    ),
    "transformers_cache": (str, None, "Override storage path for downloaded models"),
    "lora_merge_cache": (str, None, "Path to store merged LORA models"),
    "lora_merge_dtype": (str, None, "Override dtype when applying LoRAs"),
    "cuda": (bool, False, "Perform matrix arithmetic on GPU"),
    "device": (str, None, "Perform matrix arithmetic on specified device"),
    "low_cpu_memory": (bool, False, "Store results and intermediate values on accelerator. Useful if VRAM > RAM"),
    "trust_remote_code": (bool, False, "Trust remote code from huggingface repos (danger)"),
    "lazy_unpickle": (bool, False, "Experimental lazy unpickler for lower memory usage"),
    "verbosity": (int, 0, "Verbose logging (repeat for more verbosity)"),
    "quiet": (bool, False, "Suppress progress bars and other non-essential output"),
    "read_to_gpu": (bool, False, "Read model weights directly to accelerator"),
    "multi_gpu": (bool, False, "Use multi-gpu parallel graph execution engine"),
    "num_threads": (int, None, "Number of threads to use for parallel CPU operations"),
    "gpu_rich": (bool, False, "Alias for --cuda --low-cpu-memory --read-to-gpu --multi-gpu"),
}
#: the other `MergeOptions` fields: how a merge writes its folder (and the seed of a method that draws random
#: numbers); `inspect` and `verify` write no model and run no such method, so neither offers them
WRITES = (
    "out_shard_size",
    "copy_tokenizer",
    "clone_tensors",
    "random_seed",
    "write_model_card",
    "safe_serialization",
    "async_write",
    "write_threads",
)


#: what a merge option does in a command that reads models and writes none (verify), where mergekit's help says
#: otherwise
READING_HELP = {
    "transformers_cache": "the Hub cache hub ids are read from (ORG/NAME is fetched into it) [default: HF_HUB_CACHE]"
}

#: the merge options that take a path: `~` expanded, as in every path option of ours (no shell expands `--x=~/y`)
PATHS = frozenset({"transformers_cache", "lora_merge_cache"})


def _home(_context: Any, _option: Any, value: Any) -> Any:
    return os.path.expanduser(value) if isinstance(value, str) else value


def _declarations(name: str, kind: type) -> tuple[list[str], dict[str, Any]]:
    """The names and settings `add_merge_options` gives field `name` (and `-q` for `--quiet`; `~` expanded in a
    path, `PATHS`)."""
    flag = name.replace("_", "-")
    if name in PATHS:
        return [f"--{flag}"], {"callback": _home}
    if name == "verbosity":
        return ["-v", "verbosity"], {"count": True}
    if name == "num_threads":
        return ["--num-threads", "-j"], {}
    if name == "gpu_rich":
        return ["--gpu-rich"], {"is_flag": True}
    if kind is bool:
        return (["-q"] if name == "quiet" else []) + [f"--{flag}/--no-{flag}"], {}
    return [f"--{flag}"], {}


def declare(
    left_out: Collection[str] = (), hidden: Collection[str] = (), helps: dict[str, str] | None = None
) -> Callable[[F], F]:
    """Add mergekit's merge options in `FIELDS` but `left_out` to a click command, as `add_merge_options` does;
    the command gets each as a keyword argument (`merge_options` gathers them). Those in `hidden` are accepted but not
    shown in --help; `helps`: another help text than mergekit's, for what the option does in this command."""

    def decorate(function: F) -> F:
        for name, (kind, default, text) in reversed(FIELDS.items()):
            if name in left_out:
                continue
            names, settings = _declarations(name, kind)
            function = click.option(
                *names,
                type=kind,
                default=default,
                help=(helps or {}).get(name, text),
                hidden=name in hidden,
                show_default=name != "verbosity",
                **settings,
            )(function)
        return function

    return decorate


def merge_options(given: dict[str, Any]) -> Any:
    """The `MergeOptions` of the merge options among `given` (removed from it); mergekit's defaults for the rest."""
    from mergekit.options import MergeOptions

    return MergeOptions(**{name: given.pop(name) for name in FIELDS if name in given})
