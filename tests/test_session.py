"""One merge, one `MergeSession`: concurrent merges in one process never mix their statistics, cards or files."""

from __future__ import annotations

import json
import threading

import pytest
import yaml

from helpers import config_text
from mergekit_ram import session

pytestmark = pytest.mark.quick  # the quick subset: every test here (python -m pytest -q -m quick)


def test_current_is_per_thread_and_restored():
    outer = session.MergeSession(config=object())
    seen = {}

    def other_thread():
        seen["other"] = session.current()

    with session.active(outer):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert session.current() is outer
        inner = session.MergeSession(config=object())
        with session.active(inner):
            assert session.current() is inner
        assert session.current() is outer
    assert session.current() is None
    assert seen["other"] is None


def test_two_merges_on_two_threads_keep_their_own_statistics(qwen_bf16, tmp_path):
    """Two ramplus merges of different agents, run at the same time in one process: each folder's
    ram_stats.json, card and rho are its own config's, equal to the same merge run alone."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    jobs = {"AB": tmp_path / "ab", "BC": tmp_path / "bc"}
    texts = {agents: config_text(qwen_bf16, list(agents)) for agents in jobs}
    options = MergeOptions(copy_tokenizer=False, quiet=True, write_model_card=True)
    start = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def merge(agents: str) -> None:
        try:
            config = MergeConfiguration.model_validate(yaml.safe_load(texts[agents]))
            start.wait(timeout=600)  # both plan and count at once
            run_merge(config, str(jobs[agents]), options=options, config_source=texts[agents])
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=merge, args=(agents,)) for agents in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    for agents, out in jobs.items():
        alone = tmp_path / f"{agents}-alone"
        config = MergeConfiguration.model_validate(yaml.safe_load(texts[agents]))
        run_merge(config, str(alone), options=options, config_source=texts[agents])
        report = json.loads((out / "ram_stats.json").read_text(encoding="utf-8"))
        expected = json.loads((alone / "ram_stats.json").read_text(encoding="utf-8"))
        assert [a["model"] for a in report["agents"]] == [qwen_bf16.path(a) for a in agents]
        for mine, theirs in zip(report["agents"], expected["agents"], strict=True):
            assert mine == theirs, agents
        card = (out / "README.md").read_text(encoding="utf-8")
        assert "## RAM+ statistics" in card
        for a in "ABC":
            assert (f"| agent | {qwen_bf16.path(a)} |" in card) == (a in agents), (agents, a)
    assert session.current() is None


def test_a_planner_driven_directly_gets_its_own_session(qwen_bf16, tmp_path):
    """plan_to_disk without run_merge (as a script might): the statistics still go with this merge."""
    from mergekit.architecture import get_architecture_info
    from mergekit.config import MergeConfiguration
    from mergekit.graph import Executor
    from mergekit.io.tasks import LoaderCache
    from mergekit.options import MergeOptions
    from mergekit.plan import MergePlanner
    from transformers import AutoConfig

    agents = "AB"
    config = MergeConfiguration.model_validate(yaml.safe_load(config_text(qwen_bf16, list(agents))))
    options = MergeOptions(copy_tokenizer=False, quiet=True)
    LoaderCache().setup(options=options)
    arch = get_architecture_info(config, options)
    out_config = AutoConfig.from_pretrained(qwen_bf16.path("base"))
    tasks = MergePlanner(config, arch, options=options, out_model_config=out_config).plan_to_disk(str(tmp_path))
    for _ in Executor(targets=tasks, math_device="cpu", storage_device="cpu").run(quiet=True):
        pass
    report = json.loads((tmp_path / "ram_stats.json").read_text(encoding="utf-8"))
    assert [a["model"] for a in report["agents"]] == [qwen_bf16.path(a) for a in agents]
    assert all(a["rho_source"] == "counted" for a in report["agents"])
    assert session.current() is None
