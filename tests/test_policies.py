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
    agent = {**sac, "steps": 100, "warmup": 30, "fresh_optimizer": True}
    rl.finetune(tmp_path / "agent", tmp_path / "base" / "sac.zip", TASKS[1], TASKS, agent, horizon=20, seed=1, log=log)
    resumed = {**agent, "fresh_optimizer": False}  # the base's Adam moments (the earlier runs)
    rl.finetune(tmp_path / "resumed", tmp_path / "base" / "sac.zip", TASKS[1], TASKS, resumed, 20, seed=1, log=log)

    model = SAC.load(tmp_path / "base" / "sac.zip", device="cpu")
    actor = rl.Actor(tmp_path / "base" / "actor.safetensors")
    env = rl.MultiTask(TASKS, TASKS, horizon=20, seed=3)
    obs, _ = env.reset(seed=3)
    for _ in range(5):
        want, _ = model.predict(obs, deterministic=True)
        np.testing.assert_allclose(actor(obs), want, rtol=1e-4, atol=1e-5)
        obs = env.step(want)[0]
    base, tuned, again = (load_file(str(tmp_path / d / "actor.safetensors")) for d in ("base", "agent", "resumed"))
    assert base.keys() == tuned.keys()
    assert any(not torch.equal(base[k], tuned[k]) for k in base)
    # the other task's one-hot column gets no gradient (its input is 0): fresh moments leave it bit-identical,
    # the base's resumed moments keep moving it (issue 42)
    other = base["latent_pi.0.weight"][:, 39]
    assert torch.equal(tuned["latent_pi.0.weight"][:, 39], other)
    assert not torch.equal(again["latent_pi.0.weight"][:, 39], other)
    assert not torch.equal(tuned["latent_pi.0.weight"][:, 40], base["latent_pi.0.weight"][:, 40])


def test_finetune_keeps_the_best_checkpoint_on_held_out_variations(tmp_path, monkeypatch):
    """`select`: the fine-tuning's actor is its checkpoint with the best held-out success (the tuning set), an
    earlier one on a tie. A checkpoint at step n is taken after that environment step, before its gradient update,
    and training is the same with or without the selection's evaluations: the actor chosen at step 50 is the
    49-step run's actor, byte for byte."""
    sac = {**run.SAC, "net_arch": [8, 8], "batch": 16, "learning_starts": 40, "log_every": 1000, "train_freq": 1}
    log = lambda msg: None  # noqa: E731
    rl.train_base(tmp_path / "base", TASKS, {**sac, "steps": 60}, horizon=10, seed=0, log=log)
    agent = {**sac, "warmup": 20, "fresh_optimizer": True}
    zip_ = tmp_path / "base" / "sac.zip"
    rl.finetune(tmp_path / "plain", zip_, TASKS[1], TASKS, {**agent, "steps": 49}, 10, seed=1, log=log)
    calls = []

    def scores(actor, task, tasks, episodes, horizon, seed, variation_seed=0, first=0):
        assert variation_seed == rl.TUNING_SEED and task == TASKS[1]
        calls.append(1)
        return [1, 0] if len(calls) in (1, 3) else [0, 0]  # steps 50 and 150 best, tied

    monkeypatch.setattr(rl, "evaluate", scores)
    picked = {**agent, "steps": 150, "select": {"every": 50, "episodes": 2}}
    meta = rl.finetune(tmp_path / "picked", zip_, TASKS[1], TASKS, picked, 10, seed=1, log=log)
    assert [r["steps"] for r in meta["selection"]] == [50, 100, 150] and meta["selected"] == 50
    assert meta["selection"][0]["success"] == {TASKS[1]: 0.5}
    chosen = (tmp_path / "picked" / "actor.safetensors").read_bytes()
    assert chosen == (tmp_path / "plain" / "actor.safetensors").read_bytes()


def _regime_cfg() -> dict:
    cfg = json.loads(json.dumps(run.CONFIGS["regime-smoke"]))
    cfg.update(tasks=TASKS, horizon=8, multitask=False, merges=["linear", "ramplus"], interpolate=[0.5], jobs=1)
    cfg["eval"] = {"episodes": 2, "seed": 100_000, "bootstrap": 50}
    grid = {"task_arithmetic": {"method": "task_arithmetic", "weight": [1.0, 0.5]}}
    grid["dare_linear"] = {"method": "dare_linear", "density": [0.5], "weight": [1.0]}
    cfg["tune"] = {"episodes": 2, "grid": grid}
    return cfg


def _stage_folder(folder: Path, sd: dict[str, torch.Tensor], key: str) -> Path:
    folder.mkdir(parents=True)
    save_file(sd, str(folder / "actor.safetensors"))
    (folder / "stage.json").write_text(json.dumps({"key": key, "payload": {}, "seconds": 1.0}))
    return folder / "actor.safetensors"


def _tiny_regime_seed(tmp_path: Path, cfg: dict, gen_seed: int) -> tuple[dict, dict]:
    """A base and one agent per task with random weights (stage folders), and the regime seed 0 run on them:
    (agents, run_regime's result). The actors' one-hot layout is the configuration's (its base's tasks)."""
    gen = torch.Generator().manual_seed(gen_seed)
    base = _actor(gen, n_obs=39 + len(cfg.get("base_tasks", TASKS)))
    _stage_folder(tmp_path / "base", base, "kbase")
    agents = {}
    for task in TASKS:
        sd = {k: v + torch.randn(v.shape, generator=gen) * 0.05 for k, v in base.items()}
        agents[task] = (_stage_folder(tmp_path / f"agent-{task}", sd, f"k{task}"), f"k{task}")
    pipe = run.Pipeline(cfg, tmp_path / "root", seed=0)
    pipe.multitask = None
    return agents, run.run_regime(pipe, tmp_path / "base", "kbase", agents)


def test_regime_seed_tunes_merges_and_publishes_what_replays(tmp_path):
    """One seed of the regime run on tiny random actors: the grid is tuned on held-out variations, DARE merged at
    two mask draws (averaged per episode), base -> specialist interpolated; the report over three seeds writes
    per-episode outcomes, results.md regenerates from results.json, and stages.json lets a later run take the
    published actors (a replay refuses a stage that is not there)."""
    cfg = _regime_cfg()
    agents, result = _tiny_regime_seed(tmp_path, cfg, 1)

    assert set(result["tuning"]) == {"task_arithmetic", "dare_linear"}
    ta = result["tuning"]["task_arithmetic"]
    assert ta["best"] in ta["scores"] and len(ta["scores"]) == 2
    draws = result["per_draw"]["dare_linear (tuned)"]
    assert len(draws) == 2
    files = result["merge_files"]["dare_linear (tuned)"]
    assert len(files) == 2 and Path(files[0]).read_bytes() != Path(files[1]).read_bytes()  # two mask draws
    for t in TASKS:
        want = [(a + b) / 2 for a, b in zip(draws[0][t], draws[1][t], strict=True)]
        assert result["success"]["dare_linear (tuned)"][t] == want
        assert set(result["interpolation"][t]) == {"0", "0.5", "1"}
    reg = result["regime"]["agents"]
    assert all(0.01 < a["update_ratio"] < 0.5 and a["density"] > 0.99 for a in reg.values())

    runs = [{**result, "seed": s} for s in (0, 1, 2)]
    res = policy_report.build_regime(cfg, runs, {"cpu": "test"}, None, "test", 1.0, reps=50)
    out = tmp_path / "published"
    policy_report.write_regime(res, out)
    published = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text() == policy_report.markdown_regime(published)
    assert published["episodes"]["2"]["success"]["ramplus"] == result["success"]["ramplus"]
    assert str(tmp_path) not in (out / "results.json").read_text()  # portable: published names only
    assert (out / "policies" / "seed2" / f"{TASKS[0]}_agent.safetensors").exists()
    c = published["ramplus_vs"]["linear"]
    assert c["per_seed"] == [c["mean_diff"]] * 3 and c["p_improvement"] in (0.0, 0.5, 1.0)

    again = run.Pipeline(cfg, tmp_path / "root2", seed=0, published=out, replay=True)
    stage = run.Stage(tmp_path / "root2" / "agent", f"k{TASKS[1]}", {})
    again._adopt(stage, "agent")
    assert (stage.folder / "actor.safetensors").read_bytes() == agents[TASKS[1]][0].read_bytes()
    with pytest.raises(SystemExit, match="not in"):
        again._adopt(run.Stage(tmp_path / "root2" / "other", "missing", {}), "agent")


def test_headroom6_trains_each_specialist_with_its_tasks_settings(tmp_path):
    """The second headroom configuration (issue 51): its merged tasks sit in its base's six-task layout, each
    specialist trains with its task's settings (handle-press with one gradient step, the others four), the
    multi-task reference with the shared ones and the specialists' total budget, and each setting is in the stage
    key (a change retrains that agent only); the base is the screen's run, stopped where the screen chose."""
    cfg = run.CONFIGS["headroom6"]
    assert set(cfg["tasks"]) < set(cfg["base_tasks"]) and len(cfg["tasks"]) == 3
    assert run.published_folder(cfg) == run.HERE / "results" / "headroom6"
    record = json.loads((run.HERE / "results" / "headroom" / "screen" / "base6-easy.json").read_text())
    assert record["args"]["tasks"] == cfg["base_tasks"] and record["args"]["steps"] == cfg["base"]["steps"]
    assert any(row["steps"] == cfg["base"]["stop_at"] for row in record["rows"])
    pipe = run.Pipeline(cfg, tmp_path, 0)
    stages = pipe.agent_stages("base-key")
    utd = {row: sac["gradient_steps"] for row, _, sac, _, _ in stages}
    assert utd == {"handle-press-v3 agent": 1, "plate-slide-v3 agent": 4, "button-press-topdown-v3 agent": 4,
                   "multitask SAC": 4}  # fmt: skip
    assert stages[-1][2]["steps"] == 3 * cfg["agent"]["steps"] and "per_task" not in stages[-1][2]
    assert len({stage.key for *_, stage in stages}) == 4
    other = json.loads(json.dumps(cfg))
    other["agent"]["per_task"]["handle-press-v3"]["gradient_steps"] = 4
    keys = {row: stage.key for row, *_, stage in run.Pipeline(other, tmp_path, 0).agent_stages("base-key")}
    assert keys["handle-press-v3 agent"] != stages[0][4].key
    assert keys["plate-slide-v3 agent"] == stages[1][4].key


def test_headroom_seed_reports_the_share_of_each_gain_kept(tmp_path):
    """The headroom configuration (issue 51) end to end on tiny random actors: one seed as the regime run's
    (tuning, DARE's draws, interpolation), then the report over three seeds with the share of each specialist's gain
    that each merge keeps on its task, (merge - base) / (specialist - base): checked here on set outcomes, its
    interval covering it, and results.md regenerated from results.json."""
    import regime

    assert run.published_folder(run.CONFIGS["headroom"]) == run.HERE / "results" / "headroom"
    assert run.published_folder(run.CONFIGS["regime"]) == run.REGIME_RESULTS
    cfg = json.loads(json.dumps(run.CONFIGS["headroom-smoke"]))
    cfg.update({k: v for k, v in _regime_cfg().items() if k not in ("gain_kept", "published")})
    _, result = _tiny_regime_seed(tmp_path, cfg, 4)
    assert len(result["per_draw"]["dare_linear (tuned)"]) == 2

    # set outcomes, 4 episodes a task: every row 1 of 4 but each specialist 3 of 4 (+50 points) and ramplus 2 of 4
    # in seed 0 and 3 of 4 in seeds 1 and 2 (kept: 50 %, 100 %, 100 %; ratio of the means 5/6)
    runs = []
    for s in (0, 1, 2):
        success = {row: {t: [1, 0, 0, 0] for t in TASKS} for row in result["success"]}
        for t in TASKS:
            success[f"{t} agent"][t] = [1, 1, 1, 0]
            success["ramplus"][t] = [1, 1, 0, 0] if s == 0 else [1, 1, 1, 0]
        chosen = {"seconds": 1.0, "cached": False, "selected": 100, "selection": [{"steps": 100, "success": {TASKS[0]:
                  0.5}}, {"steps": 200, "success": {TASKS[0]: 0.25}}]}  # fmt: skip
        runs.append({**result, "seed": s, "success": success, "stages": {**result["stages"], "agent x": chosen}})
    res = policy_report.build_regime(cfg, runs, {"cpu": "test"}, None, "headroom-smoke", 1.0, reps=200)
    kept = res["kept"]["ramplus"]
    for t in TASKS:
        k = kept["tasks"][t]
        assert k["per_seed"] == pytest.approx([0.5, 1.0, 1.0])
        assert k["kept"] == pytest.approx(5 / 6) and k["mean_per_seed"] == pytest.approx(5 / 6)
        assert k["ci"][0] <= 5 / 6 <= k["ci"][1]
    assert kept["mean"] == pytest.approx(5 / 6)
    assert res["kept"]["linear"]["tasks"][TASKS[0]]["per_seed"] == [0.0, 0.0, 0.0]
    assert res["kept"]["linear"]["tasks"][TASKS[0]]["ci"] == [0.0, 0.0]
    assert "base" not in res["kept"] and f"{TASKS[0]} agent" not in res["kept"]
    # a specialist that gained nothing leaves no share to keep: none per seed, no ratio, no interval
    flat = [{**r, "success": {**r["success"], f"{TASKS[1]} agent": {TASKS[1]: [1, 0, 0, 0]}}} for r in runs]
    none = regime.kept_share(flat, "ramplus", TASKS, 50)
    assert none["tasks"][TASKS[1]] == {**none["tasks"][TASKS[1]], "kept": None, "ci": None, "per_seed": [None] * 3}
    assert none["mean"] is None and none["mean_ci"] is None and none["tasks"][TASKS[0]]["kept"] == pytest.approx(5 / 6)
    # the same base and specialists' episodes give the same resamples in every row (paired)
    boot = regime.gain_replicates(runs, ["base", "linear"], TASKS[0], 20)
    np.testing.assert_array_equal(boot["base"], boot["linear"])

    out = tmp_path / "published"
    policy_report.write_regime(res, out)
    published = json.loads((out / "results.json").read_text())
    text = (out / "results.md").read_text()
    assert text == policy_report.markdown_regime(published)
    assert "Share of each specialist's gain" in text and "| ramplus (r=0.1, α=2) | 83 [" in text
    assert "- seed 2: x 100 (50, 25)" in text  # the checkpoint each specialist kept
    assert (out / "kept.png").exists() and (out / "regime.png").exists()


def test_headroom6_seed_end_to_end_in_its_wider_layout(tmp_path):
    """headroom6's shape end to end on tiny random actors: the merged tasks sit inside a wider one-hot layout (the
    six-task base's; here three tasks, the merged two not first and in another order), each task with its own
    settings. Every policy is evaluated in that layout, the regime statistics read each agent's own task-ID column
    at its place in the layout, and the report over three seeds gives the share of each gain kept."""
    cfg = json.loads(json.dumps(run.CONFIGS["headroom-smoke"]))
    cfg.update({k: v for k, v in _regime_cfg().items() if k not in ("gain_kept", "published")})
    cfg["agent"] = {**cfg["agent"], "gradient_steps": 2, "per_task": {TASKS[0]: {"gradient_steps": 1}}}
    cfg["base_tasks"] = ["button-press-topdown-v3", TASKS[1], TASKS[0]]
    pipe = run.Pipeline(cfg, tmp_path / "keys", 0)
    assert pipe.layout == cfg["base_tasks"] and pipe.tasks == TASKS
    assert {row: sac["gradient_steps"] for row, _, sac, _, _ in pipe.agent_stages("k")} == {
        f"{TASKS[0]} agent": 1, f"{TASKS[1]} agent": 2}  # fmt: skip

    _, result = _tiny_regime_seed(tmp_path, cfg, 6)
    reg = result["regime"]["agents"]
    assert {t: reg[t]["own_column"]["index"] for t in TASKS} == {TASKS[0]: 39 + 2, TASKS[1]: 39 + 1}
    assert set(reg[TASKS[0]]["columns"]) == set(cfg["base_tasks"])
    assert set(result["success"]["base"]) == set(TASKS) and len(result["per_draw"]["dare_linear (tuned)"]) == 2
    assert all(len(v) == cfg["eval"]["episodes"] for row in result["success"].values() for v in row.values())

    runs = [{**result, "seed": s} for s in (0, 1, 2)]
    res = policy_report.build_regime(cfg, runs, {"cpu": "test"}, None, "headroom6-test", 1.0, reps=50)
    assert set(res["kept"]["ramplus"]["tasks"]) == set(TASKS)
    out = tmp_path / "published"
    policy_report.write_regime(res, out)
    published = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text() == policy_report.markdown_regime(published)


def test_unfinished_seeds_publish_their_finished_stages(tmp_path):
    """`--publish-stages`: the base and each finished agent stage go into the publication's stages.json (the
    entries already there kept), and a later run in another cache adopts them instead of training them."""
    cfg = json.loads(json.dumps(run.CONFIGS["headroom-smoke"]))
    root, out = tmp_path / "root", tmp_path / "published"
    gen = torch.Generator().manual_seed(5)
    pipe = run.Pipeline(cfg, root, seed=1)
    base = pipe.base_stage()
    _stage_folder(base.folder, _actor(gen), base.key)
    (base.folder / "sac.zip").write_bytes(b"sac")
    first = pipe.agent_stages(base.key)[0]  # the first task's specialist: finished; the rest: not
    _stage_folder(first[-1].folder, _actor(gen), first[-1].key)
    out.mkdir()
    (out / "stages.json").write_text(json.dumps({"earlier": {"files": {}, "meta": {}}}))
    assert run.main(["--config", "headroom-smoke", "--publish-stages", "--root", str(root), "--out", str(out),
                     "--seeds", "1"]) == 0  # fmt: skip
    index = json.loads((out / "stages.json").read_text())
    assert set(index) == {"earlier", base.key, first[-1].key}
    assert index[first[-1].key]["files"] == {"actor.safetensors": f"policies/seed1/{TASKS[0]}_agent.safetensors"}
    assert (out / "base" / "sac.zip").read_bytes() == b"sac"

    again = run.Pipeline(cfg, tmp_path / "root2", seed=1, published=out, replay=True)
    stage = again.agent_stages(again.base_stage().key)[0][-1]
    again._adopt(stage, "agent")
    assert (stage.folder / "actor.safetensors").read_bytes() == (first[-1].folder / "actor.safetensors").read_bytes()


def test_merge_batch_gives_mergekit_pytorchs_bytes(tmp_path):
    """The in-process batch is `mergekit-pytorch` itself: a dare_linear merge (random masks) gives the same bytes
    as the command with the same --random-seed and PYTHONHASHSEED."""
    import os
    import subprocess

    import yaml

    gen = torch.Generator().manual_seed(2)
    for name in ("base", "a", "b"):
        save_file(_actor(gen), str(tmp_path / f"{name}.safetensors"))
    config = {"merge_method": "dare_linear", "base_model": str(tmp_path / "base.safetensors"), "dtype": "float32"}
    config["models"] = [{"model": str(tmp_path / f"{n}.safetensors"), "parameters": {"weight": 0.5, "density": 0.5}}
                        for n in ("a", "b")]  # fmt: skip
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    jobs = [[str(tmp_path / "m.yaml"), str(tmp_path / "in"), "--random-seed", "7"]]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    bin_dir = Path(sys.executable).parent
    subprocess.run([sys.executable, str(POLICIES / "merge_batch.py"), str(tmp_path / "jobs.json")], env=env, check=True)
    cli = [str(bin_dir / "mergekit-pytorch"), str(tmp_path / "m.yaml"), str(tmp_path / "cli"), "--random-seed", "7"]
    subprocess.run(cli, env=env, check=True, capture_output=True)
    a, b = (tmp_path / d / "model.safetensors" for d in ("in", "cli"))
    assert a.read_bytes() == b.read_bytes()


def test_regime_statistics_see_unique_task_columns(tmp_path):
    """‖τ‖/‖θ_base‖, density and overlap per agent; each agent's own task-ID column changed by it alone."""
    import regime

    gen = torch.Generator().manual_seed(3)
    base = _actor(gen)
    save_file(base, str(tmp_path / "base.safetensors"))
    files = {}
    for j, task in enumerate(TASKS):
        sd = {k: v.clone() for k, v in base.items()}
        sd["latent_pi.0.weight"][:, 39 + j] += 0.1  # the own task-ID column, every row
        sd["mu.bias"] += 0.01  # shared by both agents
        files[task] = tmp_path / f"{task}.safetensors"
        save_file(sd, str(files[task]))
    stats = regime.statistics(tmp_path / "base.safetensors", files, TASKS)
    base_norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in base.values())))
    assert stats["base_norm"] == pytest.approx(base_norm)
    for task in TASKS:
        a = stats["agents"][task]
        rows = base["latent_pi.0.weight"].shape[0]
        assert a["own_column"] == {**a["own_column"], "changed": rows, "unique": rows}
        assert a["other_columns_changed"] == 0
        assert a["unique_share"] == pytest.approx(rows / (rows + 4))
        assert a["update_ratio"] == pytest.approx(np.sqrt(rows * 0.01 + 4 * 1e-4) / base_norm, rel=1e-4)
    assert stats["unchanged_inputs"] == list(range(39))


def test_hierarchical_bootstrap_covers_the_seeds_spread():
    """Seeds that disagree widen the interval of the mean; identical seeds with no episode noise give a point."""
    import regime

    same = np.full((5, 100), 0.3)
    assert regime.interval(regime.hierarchical(same, np.mean, 200)) == pytest.approx((0.3, 0.3))
    spread = np.repeat(np.array([[0.0], [0.2], [0.4], [0.6], [0.8]]), 100, axis=1)
    lo, hi = regime.interval(regime.hierarchical(spread, np.mean, 500))
    assert lo < 0.25 and hi > 0.55
    assert regime.improvement([0.1, -0.1, 0.0, 0.2]) == pytest.approx(0.625)
    assert regime.iqm([0, 1, 2, 3, 4, 5, 6, 100]) == pytest.approx(3.5)


def test_out_keeps_published_results_unless_asked(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(SystemExit, match="--overwrite"):
        run.main(["--config", "regime-smoke", "--root", str(tmp_path / "root"), "--out", str(tmp_path)])
    assert (tmp_path / "results.json").read_text() == "{}"


def test_base_stopped_at_a_step_is_the_screens_checkpoint_there(tmp_path):
    """`stop_at`: the pipeline's base is the screen's checkpoint of the same run at that step, byte for byte (the
    published base came from the screen); the screen's evaluations in between change nothing."""
    import screen

    sac = {**run.SAC, "net_arch": [8, 8], "batch": 16, "learning_starts": 40, "log_every": 1000, "train_freq": 1}
    log = lambda msg: None  # noqa: E731
    ck = screen.Checkpoints(tmp_path / "screen", 120, TASKS, TASKS, episodes=1, horizon=10)
    rl.train_base(tmp_path / "long", TASKS, {**sac, "steps": 240}, 10, seed=0, log=log, callbacks=[ck.callback])
    rl.train_base(tmp_path / "stop", TASKS, {**sac, "steps": 240, "stop_at": 120}, 10, seed=0, log=log)
    saved = (tmp_path / "screen" / "actor-120.safetensors").read_bytes()
    assert (tmp_path / "stop" / "actor.safetensors").read_bytes() == saved
    assert (tmp_path / "long" / "actor.safetensors").read_bytes() != saved


@pytest.mark.parametrize("folder", ["results", "results/regime", "results/headroom", "results/headroom6"])
def test_published_results_md_regenerates_from_results_json(folder):
    """Every number of a published results.md comes from its results.json (the earlier four-seed run, and the
    regime run)."""
    path = POLICIES / folder
    res = json.loads((path / "results.json").read_text())
    render = policy_report.markdown_regime if res.get("format") == "regime" else policy_report.markdown
    assert (path / "results.md").read_text() == render(res)
