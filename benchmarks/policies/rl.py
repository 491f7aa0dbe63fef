"""The RL side of the policies benchmark: Meta-World tasks with the task's one-hot id appended, SAC training
(stable-baselines3) of a multi-task base and of one specialist per task, the actor's export to `.safetensors`,
and the evaluation of an actor file on a task with fixed seeds.

Environments are built from Meta-World's own benchmark objects (`metaworld.MT1(name, seed)`: 50 goal variations
of the task, the same for every seed of the run) so that the evaluation can name the variation and the reset
seed of every episode; success is Meta-World's `info["success"]` at any step of the episode (the episode stops
there, as Meta-World's `terminate_on_success` evaluation does).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import gymnasium as gym
import numpy as np

#: the variations of each task (goal and object positions) come from this seed, shared by every run: the agents
#: train on them and are evaluated on them, as Meta-World's MT benchmarks do
VARIATION_SEED = 0
#: 50 other variations of each task (`metaworld.MT1(name, seed=1)`): the held-out set the merges' scale and density
#: are tuned on, never the evaluation's. An episode is fixed by its variation alone: Meta-World's reset seed changes
#: nothing once the variation is set (checked: the same observations from reset seeds 1 and 999)
TUNING_SEED = 1


def _task_env(name: str, variation_seed: int = VARIATION_SEED):
    import metaworld

    bench = metaworld.MT1(name, seed=variation_seed)
    return bench.train_classes[name](), list(bench.train_tasks)


class MultiTask(gym.Env):
    """One or several Meta-World tasks behind one interface: each reset picks one of `tasks` (uniformly) and one
    of its 50 variations; the observation is Meta-World's 39 numbers followed by the one-hot id of the task among
    `all_tasks` (the same layout for the base, every specialist and every merge). Episodes are cut at `horizon`
    steps (truncation); `terminate_on_success` ends an episode at its first success (evaluation)."""

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(
        self,
        tasks: Sequence[str],
        all_tasks: Sequence[str],
        horizon: int,
        seed: int,
        terminate_on_success: bool = False,
        variation_seed: int = VARIATION_SEED,
    ):
        super().__init__()
        unknown = [t for t in tasks if t not in all_tasks]
        if unknown:
            raise ValueError(f"tasks {unknown} are not among {list(all_tasks)}")
        self.tasks, self.all_tasks = list(tasks), list(all_tasks)
        self.horizon, self.terminate_on_success = horizon, terminate_on_success
        self.envs = {t: _task_env(t, variation_seed) for t in self.tasks}
        for t, (env, _) in self.envs.items():
            if horizon > env.max_path_length:
                raise ValueError(f"horizon {horizon} exceeds {t}'s max_path_length {env.max_path_length}")
        n_obs = next(iter(self.envs.values()))[0].observation_space.shape[0] + len(self.all_tasks)
        # Meta-World's observations leave its declared bounds (gymnasium warns): declare them unbounded
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (n_obs,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.rng = np.random.default_rng(seed)
        self.current = self.tasks[0]
        self.steps = 0

    def one_hot(self, task: str) -> np.ndarray:
        v = np.zeros(len(self.all_tasks), np.float32)
        v[self.all_tasks.index(task)] = 1.0
        return v

    def _obs(self, obs: np.ndarray) -> np.ndarray:
        return np.concatenate([obs.astype(np.float32), self.one_hot(self.current)])

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """`options`: {"task": name, "variation": index} pins the episode (evaluation); otherwise both are drawn."""
        super().reset(seed=seed)
        options = options or {}
        self.current = options.get("task") or self.tasks[int(self.rng.integers(len(self.tasks)))]
        env, variations = self.envs[self.current]
        v = options.get("variation")
        env.set_task(variations[int(self.rng.integers(len(variations))) if v is None else v % len(variations)])
        obs, info = env.reset(seed=seed if seed is not None else int(self.rng.integers(2**31)))
        self.steps = 0
        return self._obs(obs), info

    def step(self, action):
        env, _ = self.envs[self.current]
        obs, reward, _, _, info = env.step(np.asarray(action, dtype=np.float32))
        self.steps += 1
        success = bool(info.get("success", 0.0))
        terminated = self.terminate_on_success and success
        truncated = self.steps >= self.horizon and not terminated
        return self._obs(obs), float(reward), terminated, truncated, info


# --------------------------------------------------------------------------- #
# Training (stable-baselines3 SAC)
# --------------------------------------------------------------------------- #
def _sac(env: gym.Env, rl: dict, seed: int, buffer: int):
    from stable_baselines3 import SAC

    return SAC(
        "MlpPolicy",
        env,
        learning_rate=rl["lr"],
        buffer_size=buffer,
        learning_starts=rl["learning_starts"],
        batch_size=rl["batch"],
        gamma=rl["gamma"],
        train_freq=rl["train_freq"],
        gradient_steps=rl["gradient_steps"],
        policy_kwargs={"net_arch": list(rl["net_arch"])},
        seed=seed,
        device="cpu",
        verbose=0,
    )


class Progress:
    """A stable-baselines3 callback that logs the success rate of the last `window` finished episodes."""

    def __init__(self, log, every: int, window: int = 20):
        from stable_baselines3.common.callbacks import BaseCallback

        outer = self

        class _CB(BaseCallback):
            def _on_step(self) -> bool:
                for done, info in zip(self.locals["dones"], self.locals["infos"], strict=True):
                    outer.current = outer.current or bool(info.get("success", 0.0))
                    if done:
                        outer.finished.append(outer.current)
                        outer.current = False
                if self.num_timesteps % every == 0:
                    recent = outer.finished[-window:]
                    rate = sum(recent) / len(recent) if recent else float("nan")
                    sps = self.num_timesteps / (time.perf_counter() - outer.start)
                    log(f"  {self.num_timesteps} steps, training success {rate:.2f} (last {len(recent)}), {sps:.0f}/s")
                    outer.curve.append({"steps": self.num_timesteps, "success": rate})
                return True

        self.callback = _CB()
        self.finished: list[bool] = []
        self.current = False
        self.curve: list[dict] = []
        self.start = time.perf_counter()


class _StopAt:
    """Ends `learn` right after environment step `steps` (before that step's gradient update, as a checkpoint
    saved by a callback at that step)."""

    def __init__(self, steps: int):
        from stable_baselines3.common.callbacks import BaseCallback

        class _CB(BaseCallback):
            def _on_step(self) -> bool:
                return self.num_timesteps < steps

        self.callback = _CB()


def train_base(
    folder: Path, tasks: Sequence[str], rl: dict, horizon: int, seed: int, log, callbacks: Sequence = ()
) -> dict:
    """The multi-task base: SAC on all `tasks` at once (one task per episode, its one-hot in the observation).
    `callbacks`: more stable-baselines3 callbacks (the screen's checkpoints). With `stop_at`, a run planned for
    `steps` stops after that many environment steps, where the screen's checkpoint of the same run was saved."""
    import torch

    torch.manual_seed(seed)
    env = MultiTask(tasks, tasks, horizon, seed)
    model = _sac(env, rl, seed, buffer=rl["steps"])
    progress = Progress(log, rl["log_every"])
    stop = [_StopAt(rl["stop_at"]).callback] if rl.get("stop_at") else []
    model.learn(total_timesteps=rl["steps"], callback=[progress.callback, *callbacks, *stop])
    folder.mkdir(parents=True, exist_ok=True)
    model.save(folder / "sac.zip")
    export_actor(model, folder / "actor.safetensors")
    return {"curve": progress.curve, "steps": rl["steps"]}


def fresh_optimizers(model) -> None:
    """New Adam states (zero moments) for the actor, the critics and the entropy coefficient, at the model's
    learning rate: a fine-tuning starts from the base's weights, not from its optimizer. Resumed moments keep
    moving weights this run gives no gradient (another task's one-hot column: its input is always 0 here); fresh
    ones leave them bit-identical."""
    import torch

    policy = model.policy
    lr = model.lr_schedule(1.0)
    policy.actor.optimizer = policy.optimizer_class(policy.actor.parameters(), lr=lr, **policy.optimizer_kwargs)
    policy.critic.optimizer = policy.optimizer_class(policy.critic.parameters(), lr=lr, **policy.optimizer_kwargs)
    if model.ent_coef_optimizer is not None:
        model.ent_coef_optimizer = torch.optim.Adam([model.log_ent_coef], lr=lr)


def finetune(
    folder: Path,
    base_zip: Path,
    task: str | Sequence[str],
    tasks: Sequence[str],
    rl: dict,
    horizon: int,
    seed: int,
    log,
    callbacks: Sequence = (),
) -> dict:
    """One specialist: the base's SAC (actor, critics, entropy coefficient) trained on `task` alone, with fresh
    optimizer moments (`rl["fresh_optimizer"]`, default true). `task` may be several tasks: the multi-task
    reference, the base trained on on all of them with the same settings.

    The replay buffer starts empty and is first filled with `warmup` steps of the base's own (stochastic) policy:
    stable-baselines3's `learning_starts` would fill it with uniform random actions instead, which a fine-tuning
    run must not do."""
    import torch
    from stable_baselines3 import SAC

    torch.manual_seed(seed)
    env = MultiTask([task] if isinstance(task, str) else list(task), tasks, horizon, seed)
    model = SAC.load(
        base_zip,
        env=env,
        device="cpu",
        buffer_size=rl["steps"] + rl["warmup"],
        learning_rate=rl["lr"],
        learning_starts=0,
        batch_size=rl["batch"],
        gamma=rl["gamma"],
        train_freq=rl["train_freq"],
        gradient_steps=rl["gradient_steps"],
    )
    if rl.get("fresh_optimizer", True):
        fresh_optimizers(model)
    model.set_random_seed(seed)
    _prefill(model, env, rl["warmup"], seed)
    progress = Progress(log, rl["log_every"])
    select = Select(rl["select"], env.tasks, tasks, horizon, log) if rl.get("select") else None
    more = [select.callback] if select else []
    model.learn(total_timesteps=rl["steps"], callback=[progress.callback, *more, *callbacks], reset_num_timesteps=True)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"curve": progress.curve, "steps": rl["steps"], "warmup": rl["warmup"]}
    if select and select.best is not None:
        from safetensors.torch import save_file

        save_file(select.best, str(folder / "actor.safetensors"))
        meta.update(selection=select.rows, selected=select.best_step)
    else:
        export_actor(model, folder / "actor.safetensors")
    return meta


class Select:
    """Checkpoint selection on held-out variations: every `every` steps of a fine-tuning (after that environment
    step, before its gradient update), the deterministic actor's success on `episodes` variations of each trained
    task from the tuning set (`TUNING_SEED`, never the evaluation's); the best (mean over the tasks; a tie goes to
    the earlier, smaller update) is the run's actor.
    SAC's success swings between checkpoints (the screens: 5, 70, 15, 5 % at 2k-8k steps); the base itself was a
    checkpoint chosen so. The evaluations use their own environments: training is the same with or without them."""

    def __init__(self, select: dict, trained: Sequence[str], layout: Sequence[str], horizon: int, log):
        from stable_baselines3.common.callbacks import BaseCallback

        outer = self
        self.every, self.episodes = int(select["every"]), int(select["episodes"])
        self.trained, self.layout, self.horizon, self.log = list(trained), list(layout), horizon, log
        self.rows: list[dict] = []
        self.best: dict | None = None
        self.best_step, self.best_score = None, -1.0

        class _CB(BaseCallback):
            def _on_step(self) -> bool:
                if self.num_timesteps % outer.every == 0:
                    outer.checkpoint(self.model, self.num_timesteps)
                return True

        self.callback = _CB()

    def checkpoint(self, model, step: int) -> None:
        sd = {k: v.detach().to("cpu").clone().contiguous() for k, v in model.policy.actor.state_dict().items()}
        weights = {k: v.numpy() for k, v in sd.items()}
        success = {t: evaluate(weights, t, self.layout, self.episodes, self.horizon, 0, TUNING_SEED)
                   for t in self.trained}  # fmt: skip
        score = float(np.mean([np.mean(x) for x in success.values()]))
        self.rows.append({"steps": step, "success": {t: float(np.mean(x)) for t, x in success.items()}})
        if score > self.best_score:
            self.best, self.best_step, self.best_score = sd, step, score
        self.log(f"  {step} steps, held-out success {score:.2f} (best {self.best_score:.2f} at {self.best_step})")


def _prefill(model, env: MultiTask, steps: int, seed: int) -> None:
    obs, _ = env.reset(seed=seed)
    for _ in range(steps):
        action, _ = model.predict(obs, deterministic=False)
        nxt, reward, terminated, truncated, info = env.step(action)
        done = terminated or truncated
        info = {**info, "TimeLimit.truncated": truncated and not terminated}
        model.replay_buffer.add(obs[None], nxt[None], action[None], np.array([reward]), np.array([done]), [info])
        obs = env.reset()[0] if done else nxt


# --------------------------------------------------------------------------- #
# Actors as files
# --------------------------------------------------------------------------- #
def export_actor(model, path: Path) -> None:
    """The SAC actor's weights (`latent_pi.*`, `mu.*`, `log_std.*`) as float32 `.safetensors`."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.policy.actor.state_dict().items()}
    save_file(sd, str(path))


def load_actor(path: Path) -> dict[str, np.ndarray]:
    """An actor file's tensors as float32 numpy arrays (bf16 files too)."""
    import torch
    from safetensors.torch import load_file

    return {k: v.to(torch.float32).numpy() for k, v in load_file(str(path)).items()}


class Actor:
    """The deterministic action of an SB3 SAC actor stored as a file (or given as its tensors): tanh(mu(relu(...
    relu(W0 x + b0)))), in numpy float32 (what `SAC.predict(obs, deterministic=True)` computes, without torch's
    per-call overhead)."""

    def __init__(self, path: Path | dict[str, np.ndarray]):
        sd = path if isinstance(path, dict) else load_actor(path)
        idx = sorted({int(k.split(".")[1]) for k in sd if k.startswith("latent_pi.")})
        self.layers = [(sd[f"latent_pi.{i}.weight"].T, sd[f"latent_pi.{i}.bias"]) for i in idx]
        self.mu = (sd["mu.weight"].T, sd["mu.bias"])

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        x = obs.astype(np.float32)
        for w, b in self.layers:
            x = np.maximum(x @ w + b, 0.0)
        return np.tanh(x @ self.mu[0] + self.mu[1])


@functools.cache
def _evaluation_env(task: str, tasks: tuple[str, ...], horizon: int, seed: int, variation_seed: int) -> MultiTask:
    """One environment per task and process, reused for every actor: building Meta-World's 50 variations costs
    about as much as ten evaluation episodes. Each episode resets it completely (its variation, its reset seed)."""
    return MultiTask([task], tasks, horizon, seed, terminate_on_success=True, variation_seed=variation_seed)


def evaluate(
    actor: Path | dict[str, np.ndarray],
    task: str,
    tasks: Sequence[str],
    episodes: int,
    horizon: int,
    seed: int,
    variation_seed: int = VARIATION_SEED,
    first: int = 0,
) -> list[int]:
    """1/0 per episode: did the actor succeed at some step? Episode i runs variation first + i (mod 50) of the
    variations drawn with `variation_seed` (the evaluation's, or the held-out tuning set's), from reset seed
    `seed + i` (which changes nothing: the variation fixes the episode), the same for every actor."""
    act = Actor(actor)
    env = _evaluation_env(task, tuple(tasks), horizon, seed, variation_seed)
    out = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i, options={"task": task, "variation": first + i})
        success = 0
        while True:
            obs, _, terminated, truncated, _ = env.step(act(obs))
            if terminated:
                success = 1
            if terminated or truncated:
                break
        out.append(success)
    return out
