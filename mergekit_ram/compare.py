"""The module `mergekit-ram verify`'s users import (README, CONTRIBUTING): the verdict on one folder
(`verdict`: `Outcome`, `dumps`, the `--json` schema), the bit for bit comparison of two tensors (`bitwise`:
`Difference`, `compare`, `bit_differences`, `describe`) and the checks of what a folder records
(`record_checks`: `read_report`, `plan_mismatches`, `rho_mismatches`, `check_identity`, ...; `input_copies`:
`local_copies`, `missing_hint`), under the names they had. Nothing is defined here; the package itself imports
each name from its own module.
"""

from __future__ import annotations

from mergekit_ram.bitwise import CHUNK, Difference, bit_differences, compare, describe
from mergekit_ram.errors import NotVerifiable, Unreadable
from mergekit_ram.input_copies import local_copies, missing_hint
from mergekit_ram.record_checks import (
    CONFIG_FILE,
    READABLE,
    InputCheck,
    as_recorded,
    check_identity,
    damaged_weight_file,
    forced_unsafe,
    plan_mismatches,
    read_merge_record,
    read_report,
    recorded_inputs,
    recorded_options,
    rho_mismatches,
    stray_tensors,
    version_notes,
)
from mergekit_ram.verdict import EXIT, FORMAT, FORMAT_VERSION, Outcome, dumps

__all__ = [
    "CHUNK",
    "CONFIG_FILE",
    "EXIT",
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE",
    "Difference",
    "InputCheck",
    "NotVerifiable",
    "Outcome",
    "Unreadable",
    "as_recorded",
    "bit_differences",
    "check_identity",
    "compare",
    "damaged_weight_file",
    "describe",
    "dumps",
    "forced_unsafe",
    "local_copies",
    "missing_hint",
    "plan_mismatches",
    "read_merge_record",
    "read_report",
    "recorded_inputs",
    "recorded_options",
    "rho_mismatches",
    "stray_tensors",
    "version_notes",
]
