"""One `ramplus` merge (or `inspect`) as one object, current per thread and task.

mergekit calls our hooks at several points of one merge (plan, plan to disk,
write the card, finish); what they share travels in a `MergeSession`, made
current with `active()` for the duration of the merge. It lives in a
`ContextVar`, so two merges on two threads (or two asyncio tasks) each see
their own, and nothing is stamped on mergekit's objects or kept in globals.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from mergekit_ram.core import statistics


@dataclass(frozen=True)
class Planned:
    """One planned `ramplus` tensor as plain data: what the report and the checks need of it."""

    name: str
    base: str
    agents: tuple[str, ...]
    #: epsilon, r, alpha, rho_scope, lambda_rule as planned for this tensor
    parameters: Mapping[str, Any]
    #: agent -> rho given in the config (None: counted)
    given_rho: Mapping[str, float | None]


class Mode(enum.Enum):
    """What a session runs: each mode is written once, over a door (`_mergekit/door.py`)."""

    #: a merge through one of mergekit's doors: rho injected, the table printed, ram_stats.json written
    MERGE = "merge"
    #: `mergekit-ram inspect`: count only, always; nothing injected or written
    INSPECT = "inspect"
    #: `mergekit-ram verify`: a finished merge run again, rho injected, nothing printed or written
    VERIFY = "verify"

    @property
    def injects(self) -> bool:
        """Whether rho goes into the merge tasks (a merge, or verify running one again)."""
        return self is not Mode.INSPECT


@dataclass
class MergeSession:
    """The state of one merge: what was asked, what the statistics pass found, what is left to write.

    Each door chooses the flags of its sessions in one place (`session()` of `_mergekit/door_yaml.py`,
    `door_pytorch.py`). `check_parameters`: False when `inspect` plans another method's config as ramplus
    (its own parameters are not ours to judge).
    """

    config: Any
    mode: Mode = Mode.MERGE
    check_parameters: bool = True
    config_checked: bool = False
    #: the planned ramplus tensors, as plain data
    planned: list[Planned] = field(default_factory=list)
    stats: statistics.Statistics | None = None
    source: str = "not computed"
    #: the report (`report.build`) of this merge, for its card, ram_stats.json and inspect
    report: dict | None = None
    #: input -> its label where chosen before the report (`verify`: the recorded ones); the others are derived
    labels: Mapping[str, str] = field(default_factory=dict)
    #: (folder, JSON text) of ram_stats.json, written when the merge has finished
    pending: list[tuple[str, str]] = field(default_factory=list)
    #: True inside `run_merge`: the statistics are written after everything else
    in_run_merge: bool = False
    #: load tensors through `_mergekit.loading`'s linear-time paths (run_merge and inspect)
    fast_loading: bool = False
    #: how the merge was run, as `ram_stats.json`'s `merge` record: what `mergekit-ram verify` needs to
    #: run it again from the output folder alone (`entry_point`, and what else the entry point adds)
    record: dict[str, Any] = field(default_factory=lambda: {"entry_point": "run_merge"})
    #: (hub id, revision) -> its snapshot folder in the Hub cache, for the hub ids the Hub could not be asked
    #: about (offline, unreachable): mergekit reads them there (`checks/hub_cache.py`)
    from_cache: dict[tuple[str, str | None], str] = field(default_factory=dict)
    #: `verify` of a merge by another method: token -> id in the published tokenizer. mergekit numbers a union's
    #: added tokens in a hash map's order (another in each process): the merge is run again in the order it wrote
    #: (`tokenizer_order`). None: ramplus's own order, by id
    vocabulary: Mapping[str, int] | None = None

    def owns(self, config: Any) -> bool:
        """Whether `config` is this session's (mergekit passes the same object along)."""
        return config is self.config


_current: ContextVar[MergeSession | None] = ContextVar("mergekit_ram_session", default=None)
#: the dtype mergekit will write the tensor being merged in (its task's out_dtype), for one rounding
_out_dtype: ContextVar[Any] = ContextVar("mergekit_ram_out_dtype", default=None)


def current() -> MergeSession | None:
    """The merge being run in this thread or task, if any."""
    return _current.get()


@contextlib.contextmanager
def active(session: MergeSession) -> Iterator[MergeSession]:
    """Make `session` current while inside."""
    token = _current.set(session)
    try:
        yield session
    finally:
        _current.reset(token)


def out_dtype() -> Any:
    """The torch dtype the tensor being merged is written in, when mergekit says so (else None)."""
    return _out_dtype.get()


@contextlib.contextmanager
def writing(dtype: Any) -> Iterator[None]:
    """While inside, `out_dtype()` is `dtype`: the kernel rounds once, to what is written."""
    token = _out_dtype.set(dtype)
    try:
        yield
    finally:
        _out_dtype.reset(token)
