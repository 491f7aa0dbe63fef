"""verify's `history` (an unpinned Hub input: which of its commits a published merge read), against the stand-in.

tests/hub_stub.py serves, on 127.0.0.1, `org/input` with four commits: three of different weights (tiny files:
what is compared is the weight files' LFS sha256, not tensors) and, second, one that changed only its README;
`org/merged` published after the input's third commit (its second set of weights), before its fourth. The
stand-in's dates are set per commit (`set_date`); the input's history is asked through huggingface_hub's own
`HfApi`, in this process, `HF_ENDPOINT` pointing at the stand-in (huggingface_hub reads it at import, so the
module's constants are set while a test runs: `endpoint`).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hub_stub import HubStub

from mergekit_ram.errors import CANNOT_CHECK, InputUnavailable, Unreadable
from mergekit_ram.verify import history

DAY = timedelta(days=1)
START = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)


def _folder(root: Path, name: str, weights: bytes, readme: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text('{"model_type": "stub"}')
    (folder / "README.md").write_text(readme)
    return folder


@pytest.fixture
def folders(tmp_path):
    """w1; w1 with another README; w2; w3 (oldest first): commit 2 changed only the card."""
    return [
        _folder(tmp_path, "c1", b"weights one", "card"),
        _folder(tmp_path, "c2", b"weights one", "card, edited"),
        _folder(tmp_path, "c3", b"weights two", "card, edited"),
        _folder(tmp_path, "c4", b"weights three", "card, edited"),
    ]


@pytest.fixture
def served(folders, tmp_path, endpoint):
    """org/input: its four commits a day apart; org/merged: one commit, dated between the input's 3rd and 4th."""
    merged = _folder(tmp_path, "merged", b"merged weights", "a merge")
    with HubStub({"org/input": folders, "org/merged": [merged]}, lifetime=300) as stub:
        endpoint(stub.url)
        for number in range(1, 5):
            stub.set_date("org/input", number, START + number * DAY)
        stub.set_date("org/merged", 1, START + 3 * DAY + timedelta(hours=5))
        yield stub


@pytest.fixture
def endpoint(monkeypatch, tmp_path):
    """huggingface_hub's constants as a process started with HF_ENDPOINT at the stand-in would have them (it reads
    them at import), no token, no proxy: `endpoint(url)` points them at `url`."""
    from huggingface_hub import constants

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))

    def at(url: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")

    return at


def _published(stub) -> datetime:
    return history.published_time("org/merged", stub.shas["org/merged"][0])


# ---------------------------------------------------------------- the stand-in's history endpoint


def test_the_stand_in_serves_a_history_as_huggingface_hub_reads_it(served):
    """`list_repo_commits`: newest first, each commit's id and date as set; from a commit, that commit back; a long
    history in pages (followed through `Link`), the same commits; the commits a squash removed are gone."""
    from huggingface_hub import HfApi

    shas = served.shas["org/input"]
    listed = HfApi().list_repo_commits("org/input")
    assert [c.commit_id for c in listed] == shas[::-1]
    assert [c.created_at for c in listed] == [START + n * DAY for n in (4, 3, 2, 1)]
    assert [c.title for c in listed] == ["commit 4", "commit 3", "commit 2", "commit 1"]
    assert [c.commit_id for c in HfApi().list_repo_commits("org/input", revision=shas[1])] == shas[1::-1]
    served.commits_page = 3
    paged = HfApi().list_repo_commits("org/input")
    assert [c.commit_id for c in paged] == shas[::-1]
    pages = [path for method, path, _ in served.requests if "/commits/" in path]
    assert pages[-2:] == ["/api/models/org/input/commits/main", "/api/models/org/input/commits/main?p=1"]
    served.squash("org/input", 3)
    assert [c.commit_id for c in HfApi().list_repo_commits("org/input")] == shas[:1:-1]
    tree = HfApi().list_repo_tree("org/input", revision=shas[2])
    lfs = {entry.path: entry.lfs for entry in tree}
    blob = served.repos["org/input"].commits[shas[2]]["model.safetensors"]
    assert lfs["README.md"] is None and lfs["model.safetensors"].sha256 == blob.sha256


def test_default_dates_increase_in_the_order_the_commits_were_given(folders):
    with HubStub({"org/a": folders[:2], "org/b": folders[2:3]}, lifetime=60) as stub:
        dates = [stub.date(repo, sha) for repo in ("org/a", "org/b") for sha in stub.shas[repo]]
    assert dates == sorted(dates) and len(set(dates)) == 3


# ---------------------------------------------------------------- T and the candidates


def test_the_merge_is_published_at_its_commits_date(served):
    assert _published(served) == START + 3 * DAY + timedelta(hours=5)


def test_candidates_are_the_commits_up_to_T_newest_first_one_per_set_of_weights(served):
    """Published after commit 3 (w2): candidates [3, 2]; commit 1 (w1) is commit 2's twin (only the card changed),
    the newest of the two kept; commit 4 (after T) is no candidate."""
    at = _published(served)
    found = history.candidates("org/input", "main", at)
    shas = served.shas["org/input"]
    assert [c.commit for c in found] == [shas[2], shas[1]]
    assert [c.date for c in found] == [START + 3 * DAY, START + 2 * DAY]
    assert all(c.how == history.inferred(at) == "inferred from its history at 2025-03-04T17:00:00Z" for c in found)
    assert found[0].weights_hash != found[1].weights_hash
    assert [c.commit for c in history.candidates("org/input", "main", at, limit=1)] == [shas[2]]
    with pytest.raises(ValueError, match="limit"):
        history.candidates("org/input", "main", at, limit=0)
    with pytest.raises(ValueError, match="time zone"):
        history.candidates("org/input", "main", at.replace(tzinfo=None))
    at_4 = history.candidates("org/input", "main", START + 4 * DAY)  # T at commit 4's own date: it counts
    assert [c.commit for c in at_4] == [shas[3], shas[2], shas[1]]


def test_the_chooser_takes_the_commit_that_reproduces_the_merge(served):
    """The merge was made from commit 2's weights: the newest candidate (3) is tried first, then 2 is taken."""
    shas = served.shas["org/input"]
    found = history.candidates("org/input", "main", _published(served))
    asked = []

    def reproduces(pins):
        asked.append(dict(pins))
        return pins["org/input"] == shas[1]

    choice = history.choose({"org/input": found}, reproduces)
    assert choice.pins == {"org/input": shas[1]} and choice.tried == 2 and choice.reason is None
    assert choice.chosen["org/input"].date == START + 2 * DAY
    assert asked == [{"org/input": shas[2]}, {"org/input": shas[1]}]


# ---------------------------------------------------------------- the chooser, on its own


def _made(name: str, n: int) -> list[history.Candidate]:
    when = START
    how = history.inferred(when)
    return [history.Candidate(f"{name}{i}".ljust(40, "0"), when - i * DAY, f"h{i}", how) for i in range(n)]


@pytest.mark.quick
def test_combinations_go_newest_first_by_the_sum_of_the_indices():
    assert list(history.combinations([2, 3])) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    assert list(history.combinations([3, 3]))[3:6] == [(1, 1), (0, 2), (2, 0)]  # each a little back, before one far
    assert list(history.combinations([4])) == [(0,), (1,), (2,), (3,)]
    assert list(history.combinations([2, 0])) == []
    many = history.combinations([1000] * 30)  # lazily: a product of 1000**30 is never built
    assert next(many) == (0,) * 30 and len(next(many)) == 30


def test_the_chooser_is_bounded_and_says_why_nothing_was_taken():
    options = {"org/a": _made("a", 3), "org/b": _made("b", 3)}
    calls = []
    choice = history.choose(options, lambda pins: calls.append(pins) or False, attempts=4)
    assert choice.pins is None and choice.tried == 4 == len(calls)
    assert choice.reason == (
        "none of the first 4 of 9 combinations of the inputs' candidate commits (org/a: 3, org/b: 3), newest first, "
        "reproduces the merge (at most 4 are tried)"
    )
    whole = history.choose(options, lambda pins: False, attempts=100)
    assert whole.tried == 9 and whole.reason is not None and whole.reason.startswith("none of the 9 combinations")
    both_back = {"org/a": options["org/a"][1].commit, "org/b": options["org/b"][1].commit}
    two = history.choose(options, lambda pins: pins == both_back)  # (0,0), (0,1), (1,0), then (1,1)
    assert two.tried == 4 and two.pins is not None
    assert history.choose({"org/a": [], "org/b": _made("b", 1)}, lambda pins: True).reason == (
        "no candidate commit for org/a"
    )
    with pytest.raises(ValueError, match="attempts"):
        history.choose(options, lambda pins: True, attempts=0)


# ---------------------------------------------------------------- an input that cannot be looked back at


def _unavailable(reason: str, *call) -> InputUnavailable:
    with pytest.raises(InputUnavailable) as caught:
        history.candidates(*call)
    error = caught.value
    assert error.reason == reason and error.input == call[0] and f"input {call[0]}" in str(error)
    assert isinstance(error, Unreadable) and isinstance(error, CANNOT_CHECK)  # verify's "cannot check", exit 3
    return error


def test_a_history_squashed_before_T_is_named_not_guessed(served):
    """Commits 1 to 3 squashed away: the input's earliest commit (4) is after T: cannot check, naming it."""
    at = _published(served)
    served.squash("org/input", 4)
    error = _unavailable("squashed", "org/input", "main", at)
    assert "no commit on main at or before 2025-03-04T17:00:00Z" in str(error)
    assert "its earliest is of 2025-03-05T12:00:00Z" in str(error) and "squashed away" in str(error)


def test_a_history_squashed_to_a_point_before_T_still_gives_what_is_left(served):
    served.squash("org/input", 3)  # commit 3 (w2) stays: the merge's, and the only one up to T
    assert [c.commit for c in history.candidates("org/input", "main", _published(served))] == [
        served.shas["org/input"][2]
    ]


def test_a_deleted_repository(served):
    error = _unavailable("missing", "org/gone", "main", _published(served))
    assert "no such model repository" in str(error) and "deleted, or private" in str(error)


def test_a_private_repository(served):
    at = _published(served)
    served.make_private("org/input")
    error = _unavailable("missing", "org/input", "main", at)
    assert "deleted, or private" in str(error)


def test_a_gated_repository(served):
    at = _published(served)
    served.gate("org/input")
    error = _unavailable("gated", "org/input", "main", at)
    assert "gated repository" in str(error) and "ask for access" in str(error)
    assert any(method == "HEAD" and status == 401 for method, _, status in served.requests)


def test_a_renamed_repository_is_reported_with_its_new_id(served):
    at = _published(served)
    served.rename("org/input", "org/moved")
    error = _unavailable("renamed", "org/input", "main", at)
    assert error.renamed_to == "org/moved" and "org/moved" in str(error)
    assert any(status == 307 for _, _, status in served.requests)


def test_a_branch_that_is_gone(served):
    _unavailable("no-revision", "org/input", "v2", _published(served))


def test_the_hub_offline(served, monkeypatch):
    from huggingface_hub import constants

    at = _published(served)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    error = _unavailable("unreachable", "org/input", "main", at)
    assert "HF_HUB_OFFLINE" in str(error)


def test_the_merged_repositorys_history_unreadable_is_unreadable(served):
    with pytest.raises(Unreadable, match="org/nothing@") as caught:
        history.published_time("org/nothing", "0" * 40)
    assert not isinstance(caught.value, InputUnavailable)
    with pytest.raises(ValueError, match="not a commit id"):
        history.published_time("org/merged", "main")


@pytest.mark.quick
def test_how_strings():
    assert (history.PINNED, history.GIVEN, history.HEAD) == (
        "pinned in the config",
        "given (--input)",
        "head of its branch today",
    )
    assert history.inferred(datetime(2025, 1, 2, 3, 4, 5, 600000, tzinfo=timezone(timedelta(hours=2)))) == (
        "inferred from its history at 2025-01-02T01:04:05Z"
    )
