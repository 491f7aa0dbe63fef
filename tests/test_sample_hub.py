"""`mergekit-ram verify ORG/NAME --sample P` against the suite's stand-in Hub (tests/hub_stub.py), which serves
ranges as the Hub does (HTTP 206), with or without redirecting weight files to another origin as the Hub does, or,
on request, ignores ranges, answers other bytes than asked, or stalls.

* the stand-in through huggingface_hub's own client (`get_hf_file_metadata`, `hf_hub_download`, its session): the
  302's commit, etag, size and place on another origin, the bytes there without a commit header, ranges; and
  `verify/ranged.py`'s reader on top: the bytes asked, the file's size, what came; a server that ignores ranges
  gives the whole file, noted; one that sends fewer bytes than it says is `Unreadable`, naming the file;
* a merge of hub ids, a full verify and a sampled one, all through the redirects; `-q` keeps huggingface_hub's
  progress bars off, without it they are shown;
* a published merge sampled from the Hub: exit 0 with the slices' headline, every weight file read by ranges only
  (none in the Hub cache), fewer bytes than the files hold; a tampered element in a slice is exit 1, named;
* a merge published with --no-safe-serialization (`pytorch_model.bin`) sampled from the Hub: read whole, every
  tensor checked whole and said, exit 0 (it was exit 3, a safetensors header looked for in a pickle);
* a server that ignores ranges: still exit 0, each file read once and said once; one that answers other bytes
  (short, or shifted): exit 3 or 1, naming the file, never 0; one that stalls on some ranges: exit 3 naming the
  file, within the bound `HF_HUB_DOWNLOAD_TIMEOUT` sets.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from hub_stub import HubStub, hub_env
from safetensors import safe_open
from test_hub import REPOS, _exe, hub, published  # noqa: F401  (module fixtures, built again here)

from mergekit_ram.errors import Unreadable
from mergekit_ram.verify import ranged, sample


@pytest.mark.quick
@pytest.mark.parametrize("redirect", [False, True])
def test_the_stand_ins_ranges_through_huggingface_hubs_client(qwen_bf16, tmp_path, redirect):
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import get_session

    data = (qwen_bf16.paths["base"] / "model.safetensors").read_bytes()
    with HubStub({"org/base": [qwen_bf16.paths["base"]]}, lifetime=300, redirect=redirect) as stub:
        sha = stub.shas["org/base"][0]
        url = hf_hub_url("org/base", "model.safetensors", revision=sha, endpoint=stub.url)
        found = get_hf_file_metadata(url)  # as the Hub: the commit, etag and size on the answer that redirects
        assert (found.commit_hash, found.size) == (sha, len(data))
        assert found.etag == __import__("hashlib").sha256(data).hexdigest()
        assert found.location.startswith(stub.cdn_url if redirect else stub.url)
        if redirect:
            moved = get_session().get(url, follow_redirects=False)
            assert moved.status_code == 302 and moved.headers["X-Linked-Size"] == str(len(data))
            assert "X-Repo-Commit" not in get_session().get(moved.headers["Location"]).headers  # the other origin
        got = hf_hub_download("org/base", "model.safetensors", revision=sha, cache_dir=str(tmp_path / "hf"),
                              endpoint=stub.url)  # fmt: skip
        assert Path(got).read_bytes() == data
        answer = get_session().get(url, headers={"Range": "bytes=3-10"}, follow_redirects=True)
        assert (answer.status_code, answer.content) == (206, data[3:11])
        assert answer.headers["Content-Range"] == f"bytes 3-10/{len(data)}"
        answer = get_session().get(url, headers={"Range": "bytes=5-"}, follow_redirects=True)
        assert (answer.status_code, answer.content) == (206, data[5:])
        past = get_session().get(url, headers={"Range": f"bytes={len(data)}-"}, follow_redirects=True)
        assert past.status_code == 416
        reader = ranged.Reader(endpoint=stub.url)
        assert reader.read("org/base", sha, "model.safetensors", 100, 200) == (data[100:200], len(data))
        assert reader.received == 100 and reader.more_than_needed == []
        assert stub.sent[-1] == ("/org/base/model.safetensors", "bytes=100-199", 100)
    with HubStub({"org/base": [qwen_bf16.paths["base"]]}, lifetime=300, ranges="ignore", redirect=redirect) as stub:
        reader = ranged.Reader(endpoint=stub.url)  # the whole file, kept: it is not asked for again
        assert reader.read("org/base", sha, "model.safetensors", 100, 200) == (data, len(data))
        assert reader.more_than_needed == [f"org/base@{sha}/model.safetensors: the server ignored a range and sent "
                                           "the whole file"]  # fmt: skip
    with HubStub({"org/base": [qwen_bf16.paths["base"]]}, lifetime=300, ranges="short", redirect=redirect) as stub:
        with pytest.raises(Unreadable, match=f"org/base@{sha}/model.safetensors: asked for bytes 100-199, the server"):
            ranged.Reader(endpoint=stub.url).read("org/base", sha, "model.safetensors", 100, 200)


def _verify(url: str, home, cwd, *args: str, quiet: bool = True, env: dict | None = None):
    done = subprocess.run(
        [_exe("mergekit-ram"), "verify", *args, *(["-q"] if quiet else [])], capture_output=True, text=True,
        timeout=600, env={**hub_env(url, home), **(env or {})}, cwd=str(cwd),
    )  # fmt: skip
    try:
        return done, json.loads(done.stdout)
    except ValueError:
        return done, None


def _served(hub, more: dict) -> dict:
    served = {repo: [hub.stub_folders[who] for who in members] for repo, members in REPOS.items()}
    return {**served, "org/merged": [hub.out], **more}


def _seed(hub, tensor: str, share: float, element: int = 0) -> int:
    """A seed whose slice of `tensor` holds `element`, as verify cuts it (its shape from the merge's header)."""
    with safe_open(str(hub.out / "model.safetensors"), framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # every tensor: its runs depend on all
    sizes = {name: (math.prod(shape), math.prod(shape[1:])) for name, shape in shapes.items()}
    for seed in range(1000):
        cut = next(s for s in sample.draw(sizes, share, seed).slices if s.name == tensor)
        if any(a <= element < b for a, b in cut.spans()):
            return seed
    raise AssertionError(f"no seed slices element {element} of {tensor}")


def test_a_sample_from_the_hub_reads_ranges_only(hub, published, tmp_path):  # noqa: F811
    home = tmp_path / "hf"  # a fresh cache: what this verify fetches is all there is
    done, found = _verify(published.stub.url, home, hub.root / "cwd", "org/merged", "--sample", "0.05",
                          "--sample-seed", "4", "--json")  # fmt: skip
    before = len(published.stub.sent)
    assert done.returncode == 0 and found is not None, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no difference in a slice of every tensor" in found["headline"]
    assert found["hub"]["repository"] == "org/merged"
    weights = [row for row in published.stub.sent[:before] if row[0].endswith(".safetensors")]
    assert weights and all(asked is not None for _, asked, _ in weights), weights  # ranges only
    whole = sum((hub.stub_folders[w] / "model.safetensors").stat().st_size for w in ("base", "A", "B", "C"))
    whole += (hub.out / "model.safetensors").stat().st_size
    sent = sum(size for *_, size in weights)
    assert found["sample"]["bytes_read"] == sent < whole
    assert not list(home.rglob("*.safetensors"))  # no weight file in the Hub cache
    assert {row["status"] for row in found["inputs"]} == {"same"}


def test_a_drawn_tampered_tensor_on_the_hub_is_named(hub, published, tmp_path):  # noqa: F811
    seed = _seed(hub, published.tensor, 0.3)
    done, found = _verify(published.stub.url, tmp_path / "hf", hub.root / "cwd", "org/tampered", "--sample", "0.3",
                          "--sample-seed", str(seed), "--json")  # fmt: skip
    assert done.returncode == 1 and found is not None, done.stdout[-3000:] + done.stderr[-3000:]
    assert [row["name"] for row in found["tensors"]] == [published.tensor]


@pytest.mark.parametrize("ranges", ["ignore", "short", "shifted"])
def test_a_server_that_does_not_honour_ranges(hub, tmp_path, ranges):  # noqa: F811
    with HubStub(_served(hub, {}), lifetime=900, ranges=ranges, redirect=True) as stub:
        done, _ = _verify(stub.url, tmp_path / "hf", hub.root / "cwd", "org/merged", "--sample", "0.3",
                          "--sample-seed", "4")  # fmt: skip
    said = done.stdout + done.stderr
    if ranges == "ignore":  # still correct, each file read once, and said once per file
        assert done.returncode == 0, said[-3000:]
        notes = [line for line in done.stdout.splitlines() if "the server ignored a range" in line]
        files = [path for path, _, _ in stub.sent if path.endswith(".safetensors")]
        assert len(files) == 5, files  # base, agent-a at two commits, agent-b, the merge: each file read once
        assert len(notes) == 5 and len({line.split(": the server")[0] for line in notes}) == 5, notes
    else:
        assert done.returncode in (1, 3), said[-3000:]
        assert ".safetensors" in said and ("org/" in said), said[-3000:]


def test_a_server_that_stalls_on_some_ranges_is_exit_3_naming_the_file(hub, tmp_path):  # noqa: F811
    """Ranges reaching into a file's second half never answered: each read waits at most HF_HUB_DOWNLOAD_TIMEOUT (and
    huggingface_hub's connection bound), then verify stops naming the file."""
    import time

    with HubStub(_served(hub, {}), lifetime=900, ranges="stall", redirect=True) as stub:
        start = time.monotonic()
        done, _ = _verify(stub.url, tmp_path / "hf", hub.root / "cwd", "org/merged", "--sample", "0.3",
                          "--sample-seed", "4", env={"HF_HUB_DOWNLOAD_TIMEOUT": "2"})  # fmt: skip
        took = time.monotonic() - start
    said = done.stdout + done.stderr
    assert done.returncode == 3, said[-3000:]
    assert "model.safetensors: cannot be read from the Hub (ReadTimeout" in said and "org/" in said, said[-3000:]
    assert took < 120, took


def test_merge_full_and_sampled_verify_through_redirects(qwen_bf16, tmp_path):
    """As the Hub serves weight files: a 302 to another origin. A merge of hub ids, a full verify and a sampled one
    all work through it; -q keeps huggingface_hub's progress bars off, without it they are shown."""
    from test_hub import config_of, merge

    served = {repo: [qwen_bf16.paths[who] for who in members] for repo, members in REPOS.items()}
    with HubStub(served, lifetime=900, redirect=True) as stub:
        done = merge(config_of("org/base", ["org/agent-a", "org/agent-b"]), tmp_path, "out",
                     hub_env(stub.url, tmp_path / "hf-merge"))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert any(status == 302 for *_, status in stub.requests)
    with HubStub({**served, "org/merged": [tmp_path / "out"]}, lifetime=900, redirect=True) as stub:
        done, found = _verify(stub.url, tmp_path / "hf-full", tmp_path / "cwd", "org/merged", "--json")
        assert done.returncode == 0 and "bit-identical" in found["headline"], done.stdout[-3000:] + done.stderr[-3000:]
        before = len(stub.sent)
        done, found = _verify(stub.url, tmp_path / "hf-sample", tmp_path / "cwd", "org/merged", "--sample", "0.3",
                              "--sample-seed", "2", "--json")  # fmt: skip
        assert done.returncode == 0 and "no difference in a slice of every tensor" in done.stdout, done.stderr[-3000:]
        assert "Fetching" not in done.stderr and "it/s" not in done.stderr  # -q: no bar of huggingface_hub's
        weights = [row for row in stub.sent[before:] if row[0].endswith(".safetensors")]
        assert weights and all(asked is not None for _, asked, _ in weights), weights  # ranges only
        drawn = found["sample"]  # the cost said: each ranged read one request, every byte that came counted
        assert drawn["requests"] == len(weights) and drawn["bytes_read"] == sum(size for *_, size in weights)
        assert drawn["bytes_read"] < drawn["full_verify_bytes"] and drawn["full_verify_cheaper"] is True  # tiny
        done, _ = _verify(stub.url, tmp_path / "hf-loud", tmp_path / "cwd", "org/merged", "--sample", "0.3",
                          "--sample-seed", "2", quiet=False)  # fmt: skip
        assert done.returncode == 0 and "Fetching" in done.stderr, done.stderr[-3000:]
        said = [line.strip() for line in done.stdout.splitlines()]
        assert f"HTTP range requests (a full verify reads {drawn['full_verify_bytes'] / 1e6:,.1f} MB)" in done.stdout
        assert sum(line.startswith("a full verify would likely cost less here: ") for line in said) == 1  # one line


def test_a_pickled_merge_sampled_from_the_hub_is_read_whole(qwen_bf16, run_yaml, tmp_path):
    from helpers import config_text

    out = run_yaml(config_text(qwen_bf16, list("AB")), out=tmp_path / "o", safe_serialization=False).out
    (tmp_path / "cwd").mkdir()
    with HubStub({"org/merged": [out]}, lifetime=900, redirect=True) as stub:
        done, found = _verify(stub.url, tmp_path / "hf", tmp_path / "cwd", "org/merged", "--sample", "0.2",
                              "--sample-seed", "3", "--json")  # fmt: skip
        assert done.returncode == 0 and found is not None, done.stdout[-3000:] + done.stderr[-3000:]
        assert found["result"] == "no difference in sample"
        assert set(found["sample"]["whole"].values()) == {"the published merge is a pickle, which has no byte ranges"}
        pickled = [row for row in stub.sent if row[0].endswith(".bin")]
        assert pickled and sum(size for *_, size in pickled) == (out / "pytorch_model.bin").stat().st_size
