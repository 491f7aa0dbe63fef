"""Hub ids (`org/name`, `org/name@<commit>`) through huggingface_hub, against a stand-in hub.

tests/hub_stub.py serves three model repositories on 127.0.0.1 (nothing leaves the
machine): `org/base` (the base), `org/agent-a` with two commits (the older one holds agent
A's weights, `main` holds agent C's) and `org/agent-b` (B). `mergekit-yaml` runs as a
subprocess with `HF_ENDPOINT` pointing at the stub and a fresh `HF_HOME` / `HF_HUB_CACHE`
(huggingface_hub reads them at import). One merge names `org/agent-a@<older commit>`,
`org/agent-a` and `org/agent-b`:

* the merged tensors equal the float64 reference of the weights each revision holds;
* `ram_stats.json` and the card give each input's revision (the commit hash: the snapshot
  folder's name) and a content id equal to that of the folder the stub served;
* offline (`HF_HUB_OFFLINE=1`) or with the Hub unreachable, that cache warm, the same hub ids merge from the
  cache through every door (mergekit 0.1.5 asks `list_repo_files` first: a ramplus merge reads the snapshot),
  to the same bits and record; what the cache lacks is one line. The snapshot folders, given as paths, merge
  offline to the same bits.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import models
import pytest
import reference as R
import torch
from helpers import BF16, closed_form, read_stats, rows_by_model, strict_json, validate_schema
from hub_stub import HubStub, hub_env, unreachable_url

REPOS = {"org/base": ("base",), "org/agent-a": ("A", "C"), "org/agent-b": ("B",)}


def _exe(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if not exe.exists():
        pytest.skip(f"the {name} console script is not installed next to this interpreter")
    return str(exe)


def merge(config_text: str, root: Path, name: str, env: dict) -> subprocess.CompletedProcess:
    config = root / f"{name}.yml"
    config.write_text(config_text, encoding="utf-8")
    cwd = root / "cwd"  # nothing there is named like a hub id
    cwd.mkdir(exist_ok=True)
    return subprocess.run(
        [_exe("mergekit-yaml"), str(config), str(root / name), "--no-copy-tokenizer", "--quiet"],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(cwd),
    )


def config_of(base: str, agents: list[str]) -> str:
    lines = ["merge_method: ramplus", f"base_model: {base}", "models:", *(f"  - model: {a}" for a in agents)]
    return "\n".join([*lines, "dtype: bfloat16", ""])


@pytest.fixture(scope="module")
def hub(qwen_bf16, tmp_path_factory):
    """The stub serving REPOS, and one online merge of hub ids into a fresh cache."""
    root = tmp_path_factory.mktemp("hub")
    home = root / "hf_home"
    served = {repo: [qwen_bf16.paths[who] for who in members] for repo, members in REPOS.items()}
    with HubStub(served, lifetime=1800) as stub:  # a bound against a stray server: the module's tests use it
        old, new = stub.shas["org/agent-a"]
        labels = {f"org/agent-a@{old}": "A", "org/agent-a": "C", "org/agent-b": "B"}  # model -> its weights
        done = merge(config_of("org/base", list(labels)), root, "online", hub_env(stub.url, home))
        assert done.returncode == 0, done.stderr[-4000:]
        yield SimpleNamespace(
            stub=stub, root=root, home=home, old=old, new=new, labels=labels, out=root / "online",
            requests=list(stub.requests), sha={repo: stub.shas[repo][-1] for repo in REPOS},
            stub_folders=qwen_bf16.paths,
        )


def snapshot_folder(hub, repo: str, sha: str) -> Path:
    return hub.home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / sha


def public_identity(folder) -> dict:
    from mergekit_ram.core import cache
    from mergekit_ram.reporting import report

    return report.public_identity(cache.folder_identity(str(folder)))


# ---------------------------------------------------------------- online


@pytest.mark.quick
def test_hub_ids_merge_the_weights_of_each_revision(hub, qwen_bf16):
    out = models.load_checkpoint(hub.out)
    base = qwen_bf16.stored("base")
    agents = {model: qwen_bf16.stored(who) for model, who in hub.labels.items()}
    ref = R.reference_merge(base, agents, names=list(base))
    assert set(out) == set(base)
    assert all(t.dtype == BF16 for t in out.values())
    R.assert_state_dict_matches(out, ref, R.reference_magnitudes(base, agents, list(base)))
    # had the pin been ignored (agent-a twice at main), some tensor would differ
    unpinned = {**agents, f"org/agent-a@{hub.old}": qwen_bf16.stored("C")}
    wrong = R.reference_merge(base, unpinned, names=list(base))
    assert any(not torch.equal(out[n], wrong[n].to(BF16)) for n in base)
    # the statistics are those of agents A, C, B (closed form of the planted index sets)
    _, totals = closed_form(qwen_bf16.family, "ACB")
    rows = rows_by_model(read_stats(hub.out))
    assert list(rows) == list(hub.labels)
    for model, who in hub.labels.items():
        want = totals[who]
        assert (rows[model]["active"], rows[model]["shared"], rows[model]["unique"]) == (
            want["active"], want["shared"], want["unique"],
        ), model


def test_each_inputs_revision_and_content_id_are_reported(hub, qwen_bf16):
    report = read_stats(hub.out)
    validate_schema(report)
    revision = {"org/base": hub.sha["org/base"], f"org/agent-a@{hub.old}": hub.old, "org/agent-a": hub.new,
                "org/agent-b": hub.sha["org/agent-b"]}
    weights = {"org/base": "base", **hub.labels}
    identities = {row["model"]: row["identity"] for row in report["inputs"].values()}
    labels = {row["model"]: label for label, row in report["inputs"].items()}
    assert labels == {"org/base": "base", f"org/agent-a@{hub.old}": "agent-a", "org/agent-a": "agent-a-2",
                      "org/agent-b": "agent-b"}  # one repository at two revisions: numbered  # fmt: skip
    assert set(identities) == set(revision)
    assert hub.old != hub.new and re.fullmatch(r"[0-9a-f]{40}", hub.old)
    for model, identity in identities.items():
        # the revision is the commit hash; the content id is the served folder's, wherever it lies
        served = public_identity(qwen_bf16.paths[weights[model]])
        assert identity == {"content_id": served["content_id"], "revision": revision[model]}, model
    card = (hub.out / "README.md").read_text(encoding="utf-8")
    section = card[card.index("## RAM+ statistics") :]
    for model, identity in identities.items():
        role = "base" if model == "org/base" else "agent"
        row = (f"| {labels[model]} | {role} | {model} | revision `{identity['revision']}`, "
               f"content id `{identity['content_id'][:16]}` |")  # fmt: skip
        assert row in section, row


RESOLVE = re.compile(r"^/org/[a-z-]+/resolve/([0-9a-f]{40}|main)/(config\.json|model\.safetensors)$")
API = re.compile(r"^/api/models/org/[a-z-]+(/revision/(main|[0-9a-f]{40})|/tree/(main|[0-9a-f]{40}))?$")


@pytest.mark.quick
def test_the_stub_served_the_documented_endpoints_only(hub):
    """What mergekit 0.1.5 + huggingface_hub asked for (see tests/hub_stub.py's docstring).

    Two requests differ by version, and each way is accepted. transformers' `AutoConfig` asks an unpinned
    repository's config.json by branch name (`HEAD /{repo}/resolve/main/config.json`: transformers 5.1.0 and 5.17.0)
    or by the commit `GET /api/models/{repo}` names (5.24.0). huggingface_hub's `snapshot_download` resolves a commit
    hash too (`GET /api/models/{repo}/revision/{commit}`: huggingface_hub 1.16.1) or not (1.33.0, 2.4.0). The
    weights are fetched by commit hash whatever the versions."""
    asked = [(method, path.split("?")[0], status) for method, path, status in hub.requests]
    assert all(status == 200 for *_, status in asked), [a for a in asked if a[2] != 200]
    for method, path, _ in asked:
        assert (method == "GET" and API.match(path)) or (method in ("HEAD", "GET") and RESOLVE.match(path)), path
    # list_repo_files at the pinned commit, then its files by commit hash, never by branch name
    assert ("GET", f"/api/models/org/agent-a/tree/{hub.old}", 200) in asked
    assert ("GET", "/api/models/org/agent-a/revision/main", 200) in asked  # snapshot_download resolves main
    assert ("HEAD", f"/org/agent-a/resolve/{hub.old}/config.json", 200) in asked  # the pinned config, by commit
    for sha in (hub.old, hub.new):
        for method in ("HEAD", "GET"):  # the weights differ: both downloaded
            assert (method, f"/org/agent-a/resolve/{sha}/model.safetensors", 200) in asked
    for repo, sha in hub.sha.items():  # an unpinned config: by main's commit (5.24) or by branch name (5.17)
        by_commit = {("GET", f"/api/models/{repo}", 200), ("HEAD", f"/{repo}/resolve/{sha}/config.json", 200)}
        assert by_commit <= set(asked) or ("HEAD", f"/{repo}/resolve/main/config.json", 200) in asked, repo
    # both commits' config.json are the same bytes: one GET, the other revision links the cached blob
    configs = [path for m, path, _ in asked if m == "GET" and re.match(r"^/org/agent-a/.*/config\.json$", path)]
    assert len(configs) == 1, configs
    at_main = [(method, path) for method, path, _ in asked if "/resolve/main/" in path and "config.json" not in path]
    assert not at_main, at_main


# ---------------------------------------------------------------- offline, cache warm


def network(hub, how: str) -> dict:
    """The environment of a merge whose Hub is `offline` (HF_HUB_OFFLINE=1) or `unreachable`, its cache warm."""
    if how == "offline":
        return hub_env(hub.stub.url, hub.home, offline=True)
    return hub_env(unreachable_url(), hub.home)


def same_as_online(hub, out: Path, card: bool = True) -> None:
    """`out` holds the online merge's bits, records the same inputs (labels, hub ids, revisions, content ids), and
    its card is the online card but for its title (the output folder's name): `card`, a merge of the same config
    file (`run_merge` called by a script writes the config as mergekit dumps it)."""
    merged, online = models.load_checkpoint(out), models.load_checkpoint(hub.out)
    assert set(merged) == set(online)
    for name, tensor in online.items():
        assert torch.equal(merged[name], tensor), name
    assert read_stats(out)["inputs"] == read_stats(hub.out)["inputs"]
    if card:
        text, online = ((folder / "README.md").read_text(encoding="utf-8") for folder in (out, hub.out))
        assert f"\n# {out.name}\n" in text
        assert text.replace(f"\n# {out.name}\n", f"\n# {hub.out.name}\n") == online


@pytest.mark.quick
@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_hub_ids_merge_offline_from_the_warm_cache(hub, how):
    """Issue 61: mergekit 0.1.5 lists a hub id's files on the Hub before it looks in its cache, so offline a hub id
    stopped in an 81-line traceback (OfflineModeIsEnabled) even cached. A ramplus merge reads each from its snapshot
    (refs/main's commit, or the commit given) and records what the online merge recorded; the Hub is asked nothing."""
    for repo, sha in (("org/base", hub.sha["org/base"]), ("org/agent-a", hub.old), ("org/agent-a", hub.new)):
        assert (snapshot_folder(hub, repo, sha) / "model.safetensors").is_file()  # the cache is warm
    assert (hub.home / "hub" / "models--org--agent-a" / "refs" / "main").read_text() == hub.new
    before = len(hub.stub.requests)
    done = merge(config_of("org/base", list(hub.labels)), hub.root, f"cached-{how}", network(hub, how))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    assert len(hub.stub.requests) == before  # nothing asked
    same_as_online(hub, hub.root / f"cached-{how}")


def test_hub_ids_offline_through_mergekit_multi_and_run_merge(hub):
    """The other doors of hub ids: `mergekit-multi`, and `run_merge` called by a script (both in a process started
    with HF_HUB_OFFLINE=1, which huggingface_hub and transformers read when they load)."""
    before = len(hub.stub.requests)
    (hub.root / "multi.yml").write_text("name: ram\n" + config_of("org/base", list(hub.labels)), encoding="utf-8")
    done = subprocess.run(
        [_exe("mergekit-multi"), str(hub.root / "multi.yml"), "--intermediate-dir", str(hub.root / "multi")],
        capture_output=True, text=True, timeout=300, env=network(hub, "offline"), cwd=str(hub.root / "cwd"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert read_stats(hub.root / "multi" / "ram")["inputs"] == read_stats(hub.out)["inputs"]
    script = (
        "import sys, yaml\n"
        "from mergekit.config import MergeConfiguration\n"
        "from mergekit.merge import run_merge\n"
        "from mergekit.options import MergeOptions\n"
        "config = MergeConfiguration.model_validate(yaml.safe_load(open(sys.argv[1])))\n"
        "run_merge(config, sys.argv[2], MergeOptions(quiet=True, copy_tokenizer=False))\n"
    )
    (hub.root / "script.yml").write_text(config_of("org/base", list(hub.labels)), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", script, str(hub.root / "script.yml"), str(hub.root / "script")],
        capture_output=True, text=True, timeout=300, env=network(hub, "offline"), cwd=str(hub.root / "cwd"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    same_as_online(hub, hub.root / "script", card=False)
    assert len(hub.stub.requests) == before


def test_inspect_reads_hub_ids_offline_from_the_cache(hub):
    """`mergekit-ram inspect` plans as a merge does: offline, the same hub ids from the cache, the same inputs."""
    (hub.root / "inspect.yml").write_text(config_of("org/base", list(hub.labels)), encoding="utf-8")
    before = len(hub.stub.requests)
    done = subprocess.run(
        [_exe("mergekit-ram"), "inspect", str(hub.root / "inspect.yml"), "--json", str(hub.root / "inspect.json")],
        capture_output=True, text=True, timeout=300, env=network(hub, "offline"), cwd=str(hub.root / "cwd"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    found = strict_json((hub.root / "inspect.json").read_text(encoding="utf-8"))
    assert found["inputs"] == read_stats(hub.out)["inputs"]
    assert len(hub.stub.requests) == before


def test_another_method_keeps_mergekits_behaviour_offline(hub):
    """Only ramplus reads hub ids from the cache: task_arithmetic offline is mergekit's own failure, as before."""
    config = config_of("org/base", ["org/agent-b"]).replace("ramplus", "task_arithmetic")
    done = merge(config, hub.root, "other-method", network(hub, "offline"))
    assert done.returncode != 0
    assert "OfflineModeIsEnabled" in done.stderr and "list_repo_files" in done.stderr, done.stderr[-3000:]
    assert not (hub.root / "other-method" / "model.safetensors").exists()


@pytest.fixture
def cache_copy(hub, tmp_path):
    """A private copy of the warm Hub cache (links kept), to damage."""
    home = tmp_path / "hf_home"
    shutil.copytree(hub.home / "hub", home / "hub", symlinks=True)
    return home


def _offline_run_merge(monkeypatch, home: Path, config_text: str, out: Path):
    """`run_merge` in this process, offline, with `home` as HF_HOME: what the input check says."""
    import yaml
    from huggingface_hub import constants
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    config = MergeConfiguration.model_validate(yaml.safe_load(config_text))
    run_merge(config, str(out), MergeOptions(quiet=True, copy_tokenizer=False))


def _damage(home: Path, hub, how: str) -> str:
    """Damage org/agent-b's snapshot at main in the cache copy `home`; what the line must say."""
    folder = home / "hub" / "models--org--agent-b"
    snapshot = folder / "snapshots" / hub.sha["org/agent-b"]
    if how == "no snapshot":
        shutil.rmtree(snapshot)
        return f"refs/main in the Hub cache {folder} names commit {hub.sha['org/agent-b']}, whose snapshot folder is " + (
            "missing"
        )
    if how == "no weights":
        (snapshot / "model.safetensors").unlink()
        return f"the Hub cache's snapshot {snapshot} (main) is incomplete: no weight file"
    blob = (snapshot / "config.json").resolve()
    blob.unlink()  # an interrupted download: the link is there, its blob is not
    return f"the Hub cache's snapshot {snapshot} (main) is incomplete: config.json link(s) to a blob that is not there"


@pytest.mark.quick
@pytest.mark.parametrize("how", ["no snapshot", "no weights", "blob gone"])
def test_a_damaged_snapshot_is_one_line(hub, cache_copy, tmp_path, monkeypatch, how):
    from mergekit_ram.errors import RamError

    said = _damage(cache_copy, hub, how)
    with pytest.raises(RamError) as info:
        _offline_run_merge(monkeypatch, cache_copy, config_of("org/base", ["org/agent-b"]), tmp_path / "out")
    line = str(info.value)
    assert line.startswith("input model org/agent-b: ") and said in line and "HF_HUB_OFFLINE is set" in line, line
    assert "\n" not in line and not (tmp_path / "out").exists()


def test_a_commit_the_cache_does_not_hold_is_one_line_naming_both(hub, tmp_path, monkeypatch):
    """Never another commit's weights: the cache holds org/agent-b at main's commit only."""
    from hub_stub import commit_sha

    from mergekit_ram.errors import RamError

    asked, held = commit_sha("org/agent-b", 9), hub.sha["org/agent-b"]
    with pytest.raises(RamError) as info:
        _offline_run_merge(monkeypatch, hub.home, config_of("org/base", [f"org/agent-b@{asked}"]), tmp_path / "out")
    folder = hub.home / "hub" / "models--org--agent-b"
    assert str(info.value) == (
        f"input model org/agent-b@{asked}: the Hub cache {folder} holds commit {held} (refs/main), not commit "
        f"{asked}; another commit's weights are not read (HF_HUB_OFFLINE is set)"
    )
    assert not (tmp_path / "out").exists()


def test_a_branch_or_repository_the_cache_lacks_is_one_line(hub, tmp_path, monkeypatch):
    from mergekit_ram.errors import RamError

    with pytest.raises(RamError) as info:
        _offline_run_merge(monkeypatch, hub.home, config_of("org/base", ["org/agent-b@dev"]), tmp_path / "out")
    folder = hub.home / "hub" / "models--org--agent-b"
    assert str(info.value) == (
        f"input model org/agent-b@dev: the Hub cache {folder} has no refs/dev; it holds commit "
        f"{hub.sha['org/agent-b']} (refs/main) (HF_HUB_OFFLINE is set)"
    )
    with pytest.raises(RamError) as info:
        _offline_run_merge(monkeypatch, hub.home, config_of("org/base", ["org/absent"]), tmp_path / "out")
    assert str(info.value).startswith("input model org/absent is neither a folder in ")
    assert str(info.value).endswith(
        f" nor in the hub cache at revision main ({hub.home / 'hub' / 'models--org--absent'}; HF_HUB_OFFLINE is set)"
    )


def test_offline_snapshot_folders_merge_to_the_same_bits(hub):
    before = len(hub.stub.requests)
    folders = {
        "org/base": snapshot_folder(hub, "org/base", hub.sha["org/base"]),
        f"org/agent-a@{hub.old}": snapshot_folder(hub, "org/agent-a", hub.old),
        "org/agent-a": snapshot_folder(hub, "org/agent-a", hub.new),
        "org/agent-b": snapshot_folder(hub, "org/agent-b", hub.sha["org/agent-b"]),
    }
    assert all(f.is_dir() for f in folders.values())
    agents = [str(folders[m]) for m in hub.labels]
    done = merge(config_of(str(folders["org/base"]), agents), hub.root, "offline-folders",
                 hub_env(hub.stub.url, hub.home, offline=True))
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(hub.stub.requests) == before
    out, online = models.load_checkpoint(hub.root / "offline-folders"), models.load_checkpoint(hub.out)
    assert set(out) == set(online)
    for name, tensor in online.items():
        assert torch.equal(out[name], tensor), name
    # the same revisions and content ids, now under the folders' paths
    report, first = read_stats(hub.root / "offline-folders"), read_stats(hub.out)
    assert [(row["model"], row["identity"]) for row in report["inputs"].values()] == [
        (str(folders[row["model"]]), row["identity"]) for row in first["inputs"].values()
    ]


# ---------------------------------------------------------------- verify, after a branch moved


def test_verify_reads_each_hub_id_at_its_recorded_revision(hub, qwen_bf16):
    """After the merge, org/agent-a's main moves on to a third commit (B's weights). `mergekit-ram verify` reads
    `org/agent-a` at the commit the merge read (its recorded revision), not at main, and finds the folder
    bit-identical; the new commit is never asked for."""
    served = {**{repo: [qwen_bf16.paths[who] for who in members] for repo, members in REPOS.items()}}
    served["org/agent-a"] = [*served["org/agent-a"], qwen_bf16.paths["B"]]
    with HubStub(served, lifetime=1800) as moved:
        assert moved.shas["org/agent-a"][:2] == [hub.old, hub.new]  # the same commits, and a newer main
        newest = moved.shas["org/agent-a"][2]
        done = subprocess.run(
            [_exe("mergekit-ram"), "verify", str(hub.out), "-q"],
            capture_output=True, text=True, timeout=300, env=hub_env(moved.url, hub.home), cwd=str(hub.root / "cwd"),
        )
        asked = [path.split("?")[0] for _, path, _ in moved.requests]
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.splitlines()[0] == f"{hub.out}: bit-identical, {len(models.load_checkpoint(hub.out))} tensors (rho counted again)"
    assert f"/api/models/org/agent-a/tree/{hub.new}" in asked  # pinned to the recorded commit
    assert not [path for path in asked if newest in path or path.endswith("/revision/main")], asked


# ---------------------------------------------------------------- verify ORG/NAME: a merge published on the hub


#: what verify fetches of a published merge: the files it reads (weights, JSON, YAML, the card, tokenizer files)
FETCHED = {"README.md", "config.json", "mergekit_config.yml", "model.safetensors", "ram_stats.json"}


@pytest.fixture(scope="module")
def published(hub, tmp_path_factory):
    """The online merge of hub ids published as `org/merged` beside its inputs; `org/tampered`, the same folder
    with one element of one tensor moved; `org/extras`, the same with code and a file no loader reads."""
    import json as _json

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("published")
    tampered = Path(shutil.copytree(hub.out, root / "tampered"))
    tensors = load_file(str(tampered / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1).view(torch.int16)[0] += 1  # bfloat16: one step
    save_file(tensors, str(tampered / "model.safetensors"), metadata={"format": "pt"})
    extras = Path(shutil.copytree(hub.out, root / "extras"))
    (extras / "modeling_custom.py").write_text("raise SystemExit('verify ran code from the hub')\n")
    (extras / "notes.txt").write_text("not read by any loader\n")
    served = {repo: [hub.stub_folders[who] for who in members] for repo, members in REPOS.items()}
    served.update({"org/merged": [hub.out], "org/tampered": [tampered], "org/extras": [extras]})
    with HubStub(served, lifetime=1800) as stub:
        assert stub.shas["org/agent-a"][:2] == [hub.old, hub.new]  # the inputs' commits, as the merge read them
        yield SimpleNamespace(stub=stub, tensor=name, json=_json)


def verify_hub(published, hub, *args, offline=False):
    before = len(published.stub.requests)
    done = subprocess.run(
        [_exe("mergekit-ram"), "verify", *args], capture_output=True, text=True, timeout=600,
        env=hub_env(published.stub.url, hub.home, offline=offline), cwd=str(hub.root / "cwd"),
    )
    asked = [(method, path.split("?")[0]) for method, path, _ in published.stub.requests[before:]]
    return done, asked


def fetched(asked, repo: str) -> set:
    """The files of `repo` the stub was asked for (HEAD or GET)."""
    return {path.rsplit("/", 1)[1] for _, path in asked if path.startswith(f"/{repo}/resolve/")}


@pytest.mark.quick
def test_what_verify_fetches_and_how_it_names_the_rest(tmp_path, monkeypatch):
    from mergekit_ram.verify import hub as hubs

    monkeypatch.chdir(tmp_path)
    assert hubs.parse("org/name") == ("org/name", "main") and hubs.parse("org/name@v1.0") == ("org/name", "v1.0")
    for folder in ("/abs/path", "./org/name", "a/b/c", "org/name@", "org/na--me", "name"):
        assert hubs.parse(folder) is None, folder
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hubs.parse("org/name") is None  # a folder of that name wins, as mergekit resolves inputs
    read = ["ram_stats.json", "mergekit_config.yml", "README.md", "config.json", "model.safetensors",
            "model.safetensors.index.json", "pytorch_model.bin", "tokenizer.json", "adapter_config.json",
            "generation_config.json", "additional_chat_templates/tool.jinja"]  # fmt: skip
    unread = ["modeling_x.py", "sub/model.safetensors", "notes.txt", ".gitattributes", "model.fp16.safetensors"]
    assert [name for name in read + unread if hubs.wanted(name)] == read  # a shard an index names: fetched later
    found = hubs.Published("org/x", "main", "0" * 40, str(tmp_path), ("a.py", "notes.txt"))
    files, blocked, unchecked = found.unfetched(trusted=False)
    assert files == ["a.py: Python code on the Hub (not fetched), which transformers runs with trust_remote_code; "
                     "the merge writes no such file"] and blocked == []  # fmt: skip
    assert unchecked == ["notes.txt (on the Hub, not fetched: no loader reads them)"]
    files, blocked, _ = found.unfetched(trusted=True)  # the merge wrote its donor's code: only bytes would tell
    assert files == [] and blocked[0].startswith("a.py: Python code on the Hub (not fetched)")


def test_verify_a_merge_on_the_hub_fetches_only_what_it_reads(hub, published):
    """`mergekit-ram verify ORG/NAME`: the files verify reads, fetched into the hub cache at the commit main names
    (recorded in the verdict), then checked as a folder, the inputs read at their recorded revisions."""
    done, asked = verify_hub(published, hub, "org/merged", "--json", "-q")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = strict_json(done.stdout)
    sha = published.stub.shas["org/merged"][-1]
    assert found["hub"] == {"repository": "org/merged", "requested": "main", "revision": sha}
    assert found["result"] == "identical" and found["headline"].startswith(f"org/merged@{sha}: bit-identical, ")
    assert found["folder"] == str(hub.home / "hub" / "models--org--merged" / "snapshots" / sha)
    assert {row["label"]: row["status"] for row in found["inputs"]} == dict.fromkeys(
        ["base", "agent-a", "agent-a-2", "agent-b"], "same"
    )
    assert "the card's RAM+ section" in found["checked"]
    assert fetched(asked, "org/merged") == FETCHED  # tokenizer files too, where the merge copied them
    assert not [path for _, path in asked if path.endswith(".py")]
    # a pinned revision: the same commit, asked for by its hash
    done, _ = verify_hub(published, hub, f"org/merged@{sha}", "-q")
    assert done.returncode == 0 and done.stdout.startswith(f"org/merged@{sha}: bit-identical, "), done.stdout


def test_a_tampered_file_on_the_hub_is_named(hub, published):
    done, _ = verify_hub(published, hub, "org/tampered", "--json", "-q")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    found = strict_json(done.stdout)
    assert found["result"] == "differs" and [row["name"] for row in found["tensors"]] == [published.tensor]
    assert found["tensors"][0]["differing"] == 1 and found["hub"]["repository"] == "org/tampered"


def test_code_on_the_hub_is_named_never_fetched(hub, published):
    """A `.py` file in the repository is code transformers runs with trust_remote_code: named from the listing,
    never downloaded; a file no loader reads is named as not checked, not downloaded either."""
    done, asked = verify_hub(published, hub, "org/extras", "-q")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "  modeling_custom.py: Python code on the Hub (not fetched), which transformers runs" in done.stdout
    assert "not checked:\n  notes.txt (on the Hub, not fetched" in done.stdout
    assert fetched(asked, "org/extras") == FETCHED
    assert "verify ran code" not in done.stdout + done.stderr


@pytest.mark.parametrize("args, offline, said", [
    (["org/nothing"], False, "org/nothing@main: no such model repository on http://127.0.0.1:"),
    (["org/merged@" + "0" * 40], False, f"org/merged@{'0' * 40}: the repository on http://127.0.0.1:"),
    (["org/merged"], True, "org/merged@main: HF_HUB_OFFLINE is set, so the Hub is not asked for its files"),
], ids=["no-repository", "no-revision", "offline"])  # fmt: skip
def test_a_repository_the_hub_cannot_give_is_one_line_exit_3(hub, published, args, offline, said):
    done, asked = verify_hub(published, hub, *args, offline=offline)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert done.stdout == "" and done.stderr.splitlines()[-1].startswith(f"mergekit-ram verify: cannot check: {said}")
    assert len([line for line in done.stderr.splitlines() if line.strip()]) == 1, done.stderr
    assert (asked == []) == offline  # offline: nothing asked
    done, _ = verify_hub(published, hub, *args, "--json", offline=offline)
    found = strict_json(done.stdout)
    assert done.returncode == 3 and found["result"] == "cannot check" and found["error"].startswith(said)
    assert found["hub"] == {"repository": args[0].split("@")[0], "requested": args[0].partition("@")[2] or "main",
                            "revision": None}  # fmt: skip


def test_a_repository_that_holds_no_merge_record_cannot_be_checked(hub, published):
    """As a folder without ram_stats.json or mergekit_config.yml: exit 3, one line, nothing but the listing asked."""
    done, asked = verify_hub(published, hub, "org/base")
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("mergekit-ram verify: cannot check: org/base@main (commit ")
    assert "holds neither ram_stats.json nor mergekit_config.yml" in line
    assert asked == [("GET", "/api/models/org/base/revision/main")]


def test_an_unreachable_hub_is_one_line_exit_3_before_torch_loads(hub, tmp_path):
    """No server at HF_ENDPOINT: one line, exit 3, and neither torch nor mergekit imported to say it."""
    url = unreachable_url()
    code = (
        "import json, sys\n"
        "from mergekit_ram import cli\n"
        "code = cli.main(['verify', 'org/merged'])\n"
        "print('LOADED', json.dumps([m for m in ('torch', 'mergekit') if m in sys.modules]), code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=hub_env(url, tmp_path / "home"), cwd=str(tmp_path))  # fmt: skip
    assert done.stdout.strip() == "LOADED [] 3", done.stdout + done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"mergekit-ram verify: cannot check: org/merged@main: the Hub at {url} could not be asked (")


# ---------------------------------------------------------------- the stub itself


def _ask(url: str, method: str, path: str):
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)  # direct: no proxy consulted
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_stub_serves_only_what_it_was_given_and_stops_by_itself(qwen_bf16):
    import time

    with HubStub({"org/base": [qwen_bf16.paths["base"]]}, lifetime=5.0) as stub:  # long enough for 7 asks when busy
        assert stub.url.startswith("http://127.0.0.1:")
        sha = stub.shas["org/base"][0]
        data = (qwen_bf16.paths["base"] / "model.safetensors").read_bytes()
        status, headers, body = _ask(stub.url, "GET", "/org/base/resolve/main/model.safetensors")
        assert (status, body, headers["X-Repo-Commit"], int(headers["Content-Length"])) == (200, data, sha, len(data))
        assert headers["ETag"] == headers["X-Linked-Etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
        status, headers, body = _ask(stub.url, "HEAD", f"/org/base/resolve/{sha}/config.json")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
        for path, code in (
            ("/org/base/resolve/main/tokenizer.json", "EntryNotFound"),  # a file it was not given
            ("/org/base/resolve/" + "0" * 40 + "/config.json", "RevisionNotFound"),
            ("/org/other/resolve/main/config.json", "RepoNotFound"),
            ("/api/models/org/base/tree/main/sub", "EntryNotFound"),
            ("/api/whoami-v2", "RepoNotFound"),
        ):
            status, headers, _ = _ask(stub.url, "GET", path)
            assert (status, headers["X-Error-Code"]) == (404, code), path
        assert [s for *_, s in stub.requests] == [200, 200, 404, 404, 404, 404, 404]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the lifetime (5 s) runs out: connections are refused
            try:
                _ask(stub.url, "GET", "/api/models/org/base")
            except ConnectionError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the stub still answers after its lifetime")
