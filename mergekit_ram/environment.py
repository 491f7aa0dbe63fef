"""The environment variables mergekit-ram reads, and the one vocabulary of the on/off ones.

On/off (`flag`): unset or empty is the variable's default; `0`, `false`, `no` or `off` (any case, spaces around
ignored) is off; any other value is on (`1`, `true`, `yes`, `on`, ...).

- `MERGEKIT_RAM_DISABLE` (default off): the `.pth` start-up line does not load the plugin. That line reads it itself
  (importing this module would load the plugin it is asked not to); tests/test_environment.py checks it uses these
  words.
- `MERGEKIT_RAM_TRACEBACK` (default off): a refusal prints its traceback as well as its line (`errors`).
- `MERGEKIT_RAM_NATIVE` (default on): the C kernel is built and used where it applies (`core.native`).

Not on/off, and read where they are used: `MERGEKIT_RAM_CACHE` (the statistics cache's folder, or a word that turns
it off: `core.cachedir`), `MERGEKIT_RAM_STATS_ORDER` (`_mergekit.counting`), and torch's
`TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`, read with torch's own words (`checks.input_checks.forced_unsafe`).
"""

from __future__ import annotations

import os

#: the values that turn an on/off variable off
OFF = ("0", "false", "no", "off")
DISABLE, TRACEBACK, NATIVE = "MERGEKIT_RAM_DISABLE", "MERGEKIT_RAM_TRACEBACK", "MERGEKIT_RAM_NATIVE"


def flag(name: str, default: bool = False) -> bool:
    """Whether the on/off variable `name` is on (the module's docstring gives the words)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in OFF
