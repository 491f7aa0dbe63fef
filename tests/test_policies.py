"""The Meta-World policies benchmark (benchmarks/policies): its merge-and-evaluate stage on two tiny policies, and a
smoke run of its training code.

The first test writes a base and two agents as SAC actors (stable-baselines3's tensor names) with random weights,
merges them with real `mergekit-pytorch` processes, inspects them, rolls every policy out on Meta-World for a few
short episodes and writes the report; no training. The second trains a tiny multi-task SAC base and fine-tunes one
agent from it for a few hundred steps, and checks that the exported actor acts as stable-baselines3's policy does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

NEEDS = 'the policies benchmark\'s extra is not installed (the suite\'s set-up leaves it out): pip install -e ".[policies]"'
pytest.importorskip("stable_baselines3", reason=NEEDS)
pytest.importorskip("metaworld", reason=NEEDS)

POLICIES = Path(__file__).resolve().parents[1] / "benchmarks" / "policies"
sys.path.insert(0, str(POLICIES))
import policy_report  # noqa: E402
import rl  # noqa: E402
import run  # noqa: E402

TASKS = ["reach-v3", "drawer-close-v3"]


def _actor(gen: torch.Generator, hidden: int = 8, n_obs: int = 39 + len(TASKS)) -> dict[str, torch.Tensor]:
    shapes = {
        "latent_pi.0.weight": (hidden, n_obs),
        "latent_pi.0.bias": (hidden,),
        "latent_pi.2.weight": (hidden, hidden),
        "latent_pi.2.bias": (hidden,),
        "mu.weight": (4, hidden),
        "mu.bias": (4,),
        "log_std.weight": (4, hidden),
        "log_std.bias": (4,),
    }
    return {k: torch.randn(s, generator=gen) * 0.3 for k, s in shapes.items()}


def _cfg() -> dict:
    cfg = json.loads(json.dumps(run.CONFIGS["smoke"]))
    cfg.update(horizon=8, merges=["ramplus", "ta_sum"], bf16=[], inspect=["float32"], jobs=2)
    cfg["eval"] = {"episodes": 2, "seed": 100_000, "bootstrap": 50}
    return cfg


def test_merge_and_evaluate_two_tiny_policies(tmp_path, capsys):
    gen = torch.Generator().manual_seed(0)
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    base = _actor(gen)
    save_file(base, str(base_dir / "actor.safetensors"))
    agents = {}
    for i, task in enumerate(TASKS):
        # a sparse update: each agent changes its own half of the rows of every matrix (disjoint: all unique)
        sd = {}
        for k, v in base.items():
            delta = torch.randn(v.shape, generator=gen) * 0.05
            mask = torch.zeros(v.shape[0], dtype=torch.bool)
            mask[i :: len(TASKS)] = True
            sd[k] = v + delta * mask.view(-1, *([1] * (v.dim() - 1)))
        path = tmp_path / f"{task}.safetensors"
        save_file(sd, str(path))
        agents[task] = (path, f"key-{task}")

    cfg = _cfg()
    cfg["tasks"] = TASKS
    pipe = run.Pipeline(cfg, tmp_path / "root", seed=0)
    merged = pipe.merges(base_dir, "base-key", agents)
    assert set(merged) == {"ramplus", "ta_sum"}
    out = {row: load_file(str(p)) for row, p in merged.items()}
    sds = [load_file(str(p)) for p, _ in agents.values()]
    for k, b in base.items():
        taus = [sd[k] - b for sd in sds]
        # task arithmetic w = 1: base + the sum of the task vectors
        torch.testing.assert_close(out["ta_sum"][k], b + sum(taus), rtol=1e-5, atol=1e-6)
        # RAM+: every change is one agent's (no shared entry: rho 0, lambda 1), so the same merge
        torch.testing.assert_close(out["ramplus"][k], b + sum(taus), rtol=1e-5, atol=1e-6)
    stats = json.loads((merged["ramplus"].parent / "ram_stats.json").read_text())
    assert {a["shared"] for a in stats["agents"]} == {0}

    inspected = pipe.inspect(base_dir, "base-key", agents)
    assert set(inspected) == {"float32"}
    assert all(0.4 < a["density"] < 0.6 for a in inspected["float32"]["agents"])

    policies = {"base": base_dir / "actor.safetensors", **{f"{t} agent": p for t, (p, _) in agents.items()}, **merged}
    capsys.readouterr()
    # one file under two names is evaluated once per task (two builds of one stage folder at once raced)
    success = pipe.evaluate({**policies, "ramplus, again": merged["ramplus"]})
    distinct = {p.read_bytes() for p in policies.values()}
    assert f"evaluating {len(distinct) * len(TASKS)} (policy, task) pairs" in capsys.readouterr().out
    assert success.pop("ramplus, again") == success["ramplus"]
    assert set(success) == set(policies)
    for per_task in success.values():
        assert set(per_task) == set(TASKS)
        assert all(len(x) == 2 and set(x) <= {0, 1} for x in per_task.values())
    assert pipe.evaluate(policies) == success  # cached by the file's bytes, the same episodes

    runs = [{"seed": 0, "stages": pipe.stages, "success": success, "stats": inspected, "files": policies}]
    res = policy_report.build(cfg, runs, {"cpu": "test"}, None, "test", 1.0)
    policy_report.write(res, tmp_path / "results")
    text = (tmp_path / "results" / "results.md").read_text()
    assert "| ramplus (r=0.1, α=2) |" in text and "reach-v3" in text
    assert (tmp_path / "results" / "ram_stats" / "seed0" / "ramplus.json").exists()

    # three training seeds (here the same run three times): per-seed columns and intervals over the seeds
    three = [{**runs[0], "seed": s} for s in (0, 1, 2)]
    res = policy_report.build(cfg, three, {"cpu": "test"}, None, "test", 1.0)
    c = res["ramplus_vs"]["ta_sum"]
    assert c["per_seed"] == [c["mean_diff"]] * 3 and c["seed_ci"] == [c["mean_diff"]] * 2
    policy_report.write(res, tmp_path / "results3")
    assert "| model | seed 0 | seed 1 | seed 2 |" in (tmp_path / "results3" / "results.md").read_text()


@pytest.mark.quick
def test_seed_interval_is_students_t_over_the_seeds():
    assert policy_report.seed_interval([0.1, 0.3]) is None  # two seeds: no interval
    lo, hi = policy_report.seed_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446 * np.std([1.0, 2.0, 3.0, 4.0], ddof=1) / 2  # t(0.975, 3 degrees of freedom)
    assert lo == pytest.approx(2.5 - half, abs=1e-5) and hi == pytest.approx(2.5 + half, abs=1e-5)


@pytest.mark.quick
def test_episodes_are_fixed_by_their_index():
    env = rl.MultiTask(TASKS[:1], TASKS, horizon=5, seed=0, terminate_on_success=True)
    first, _ = env.reset(seed=7, options={"task": TASKS[0], "variation": 3})
    env.reset(seed=8, options={"task": TASKS[0], "variation": 4})
    again, _ = env.reset(seed=7, options={"task": TASKS[0], "variation": 3})
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first[-2:], [1.0, 0.0])  # the one-hot of reach-v3 among TASKS
    with pytest.raises(ValueError, match="not among"):
        rl.MultiTask(["window-close-v3"], TASKS, horizon=5, seed=0)


def test_training_smoke_run(tmp_path):
    """A few hundred SAC steps: the multi-task base, then one agent fine-tuned from it; the exported actor acts as
    stable-baselines3's deterministic policy does, and the agent's actor differs from the base's."""
    from stable_baselines3 import SAC

    sac = {**run.SAC, "net_arch": [16, 16], "batch": 16, "learning_starts": 50, "log_every": 100}
    log = lambda msg: None  # noqa: E731
    meta = rl.train_base(tmp_path / "base", TASKS, {**sac, "steps": 150}, horizon=20, seed=0, log=log)
    assert [c["steps"] for c in meta["curve"]] == [100]
    agent = {**sac, "steps": 100, "warmup": 30}
    rl.finetune(tmp_path / "agent", tmp_path / "base" / "sac.zip", TASKS[1], TASKS, agent, horizon=20, seed=1, log=log)

    model = SAC.load(tmp_path / "base" / "sac.zip", device="cpu")
    actor = rl.Actor(tmp_path / "base" / "actor.safetensors")
    env = rl.MultiTask(TASKS, TASKS, horizon=20, seed=3)
    obs, _ = env.reset(seed=3)
    for _ in range(5):
        want, _ = model.predict(obs, deterministic=True)
        np.testing.assert_allclose(actor(obs), want, rtol=1e-4, atol=1e-5)
        obs = env.step(want)[0]
    base, tuned = (load_file(str(tmp_path / d / "actor.safetensors")) for d in ("base", "agent"))
    assert base.keys() == tuned.keys()
    assert any(not torch.equal(base[k], tuned[k]) for k in base)
