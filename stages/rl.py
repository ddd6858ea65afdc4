"""Stage `rl`: PPO-family RL fine-tuning on Ray actor groups with vLLM rollouts.

One driver (this module's `run`) and actor groups: policy (DeepSpeed ZeRO ranks, trains), critic (PPO's
`gae` only, DeepSpeed), reference (frozen), reward (the reward-model stage's output, or a Python file exposing
`reward_fn(prompts, completions, labels) -> scores`) and a vLLM rollout engine. Each step:

    generate (vLLM, n samples per prompt; with dynamic_sampling, more prompts until the groups are informative)
    -> make experience (old/reference log-probs, rewards, values, KL, advantages) -> train (PPO's clipped, GSPO's or
    CISPO's policy loss; value loss) -> weight sync (trainer -> vLLM)

and a checkpoint every `checkpoint_every` steps; a restart resumes from the latest with the same prompt order.
The held-out prompts (the validation set) are scored before training, every `eval_every` steps and at the end, with
the same seeds each time; `keep: best` outputs the policy of the best of these steps (the start model included)
instead of the last.
With `async_rollouts: 1` step t+1's generation (a thread of this driver: the engines are actors of their own) runs
while step t makes its experience and trains, with the weights before step t's update; the weight sync waits for
both. A checkpoint then keeps the rollout generated ahead, so a resumed run trains on the samples the uninterrupted
run trained on.
With an `environment` (runtime/environments.py) each sample is a multi-turn episode: every live episode's reply
generated at once, the environment's steps run concurrently, the trained ids those sampled with the environment's
messages between them (mask 0), the episode's reward the sum of its step rewards (and a reward file's, on its last
reply).
One config names several variants (e.g. grpo, ppo); each is a separate run of this stage.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/rl/grpo
"""
import dataclasses
import json
import random
import shutil
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import ray

from runtime import checkpoints, data, trainer
from runtime.actor_group import ActorGroup
from runtime.environments import context_length
from runtime.experience import (Rollout, episode_metrics, informative_groups, make_experience, roll, score,
                                 teacher_log_ratio)
from runtime.models import load_tokenizer
from runtime.progress import Progress, beat
from runtime.remote_reward import RemoteRewardError
from runtime.rl_actors import Roles
from runtime.rollout import sampling_seed

USES_RAY = True


@dataclasses.dataclass
class Config(trainer.TrainerConfig):
    name: str
    estimator: str
    steps: int
    rollout_batch_size: int
    n_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    ppo_epochs: int
    clip_low: float
    clip_high: float
    dual_clip: float | None
    value_clip: float | None
    critic_learning_rate: float
    entropy_coef: float
    kl_coef: float
    kl_estimator: str
    kl_in_reward: bool
    kl_target: float | None
    gamma: float
    lam: float
    loss_agg: str
    policy_loss: str
    packing: bool
    async_rollouts: int
    dynamic_sampling: bool
    max_generation_rounds: int
    overlong: str
    overlong_buffer: int
    normalize_reward: bool
    reward_clip: float | None
    is_cap: float | None
    reward: str | None  # model, judge, a reward service's URL, a reward file, or None (an environment's or teacher's)
    teacher: str | None  # on-policy distillation: the teacher's directory (the input `teacher`)
    teacher_coef: float
    colocate: bool
    eval_prompts: int
    eval_every: int
    keep: str  # last or best: which step's policy is the stage's output
    frozen_ranks: int
    vllm: dict  # the schema's rl.vllm: engines, tensor parallelism, memory, sleep
    environment: dict | None = None  # the experiment's environment block: multi-turn episodes (runtime/environments.py)
    judge: dict | None = None  # the judge block, where reward is judge (runtime/judge.py)
    remote_reward: dict | None = None  # how a reward service is called, where reward is a URL (runtime/remote_reward.py)

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["rl"], name=params["variant"], seed=params["seed"])


def train_on(group: ActorGroup, cfg: Config, rollout: Rollout, rng: random.Random) -> dict:
    stats = []
    for _ in range(cfg.ppo_epochs):
        order = list(range(len(rollout)))
        rng.shuffle(order)  # the permutation (and RNG draws) of shuffling the rows themselves
        shuffled = rollout[order]
        for start in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            per_rank = group.call_per_rank("train_step", trainer.shard(shuffled[start:start + cfg.batch_size],
                                                                       cfg.num_workers, cfg.micro_batch_size))
            stats.append({k: statistics.fmean(r[k] for r in per_rank) for k in per_rank[0]})
    return {k: statistics.fmean(s[k] for s in stats) for k in stats[0]}


def next_prompts(count: int, order: list[dict], prompts: list[dict], rng: random.Random) -> tuple[list, list]:
    """The next `count` prompts of the run's order, and the order left: passes over the prompts, each in a seeded
    order, none twice in a pass, none skipped."""
    while len(order) < count:
        fresh = prompts[:]
        rng.shuffle(fresh)
        order = order + fresh
    return order[:count], order[count:]


def sample_step(roles, cfg: Config, batch: list[dict], draw, seed: int) -> tuple[Rollout, list | None, list, dict]:
    """The step's rollout for `batch`, its raw scores (None: not scored yet) and the prompts it used. With
    dynamic_sampling (DAPO), groups whose responses all scored the same are set aside and `draw(k)` gives k more
    prompts, for up to max_generation_rounds rounds; if the informative groups are still too few, set-aside groups
    fill the batch (their advantage is 0: they change nothing)."""
    rollout = roll(roles, batch, cfg.n_samples, cfg, seed, cfg.temperature)
    if not cfg.dynamic_sampling:
        return rollout, None, batch, {}  # (scored in make_experience)
    raw = score(roles, rollout)
    n, kept, spare, rounds = cfg.n_samples, [], [], 0
    while True:
        useful = set(informative_groups(raw, n))
        for g, prompt in enumerate(batch):
            (kept if g in useful else spare).append((rollout[g * n:(g + 1) * n], raw[g * n:(g + 1) * n], prompt))
        rounds += 1
        if len(kept) >= cfg.rollout_batch_size or rounds == cfg.max_generation_rounds:
            break
        batch = draw(cfg.rollout_batch_size - len(kept))
        rollout = roll(roles, batch, n, cfg, seed + 1_000_003 * rounds, cfg.temperature)
        raw = score(roles, rollout)
    chosen = (kept + spare)[:cfg.rollout_batch_size]
    stats = {"groups_informative": min(len(kept), cfg.rollout_batch_size), "groups_set_aside": len(spare),
             "generation_rounds": rounds}
    return (Rollout.join([part for part, _, _ in chosen]), [s for _, scores, _ in chosen for s in scores],
            [prompt for _, _, prompt in chosen], stats)


def sample_state(sample: tuple) -> dict:
    """A sample (rollout, raw scores, prompts, counts) as JSON, for a checkpoint (float32 values survive exactly)."""
    rollout, raw, batch, metrics = sample
    return {"rollout": rollout.state(), "raw": raw, "batch": batch, "metrics": metrics}


def sample_from_state(state: dict) -> tuple:
    return Rollout.from_state(state["rollout"]), state["raw"], state["batch"], state["metrics"]


def adapt_kl(kl_coef: float, kl: float, cfg: Config) -> float:
    # Adaptive KL controller (Ziegler et al. 2019): move the coefficient toward the target KL.
    if cfg.kl_target is None:
        return kl_coef
    error = max(-0.2, min(0.2, kl / cfg.kl_target - 1))
    return kl_coef * (1 + error * cfg.rollout_batch_size * cfg.n_samples / 10000)


def held_out_reward(roles: Roles, cfg: Config, prompts: list[dict]) -> dict:
    """Mean RL reward of n_samples responses (or episodes) to each held-out prompt, the same seeds before and after
    training: eval_reward, for episodes their success rate and turns (eval_success, eval_turns), with a teacher the
    reverse KL to it per response (eval_teacher_kl: the sum over its tokens of log pi_policy - log pi_teacher)."""
    rollout = roll(roles, prompts, cfg.n_samples, cfg, sampling_seed(cfg.seed, "held-out"), cfg.temperature)
    metrics = {"eval_reward": statistics.fmean(score(roles, rollout))}
    if roles.teacher is not None:
        metrics["eval_teacher_kl"] = -teacher_log_ratio(roles, rollout, rollout.rollout_logp).sum(-1).mean().item()
    if rollout.episodes:
        episodes = episode_metrics(rollout)
        metrics |= {"eval_success": episodes["episode_success"], "eval_turns": episodes["episode_turns"]}
    return metrics


def best_of(evals: list) -> tuple[int, float]:
    """(step, held-out reward) of the best of `evals`, [step, reward] pairs in step order; ties: the earliest."""
    step, reward = max(evals, key=lambda e: e[1])  # (max keeps the first of equal maxima)
    return step, reward


def keep_best_dirs(root: Path, steps: set) -> None:
    """Remove the best policies saved in `root` (step<N>/) except those of `steps`."""
    for path in root.glob("step*"):
        if int(path.name[4:]) not in steps:
            shutil.rmtree(path, ignore_errors=True)


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    tokenizer = load_tokenizer(inputs["model"])
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [r | {"prompt_ids": encode(r["prompt"])} for r in data.read_jsonl(inputs["data"] / "prompts_train.jsonl")]
    eval_prompts = [r | {"prompt_ids": encode(r["prompt"])}
                    for r in data.read_jsonl(inputs["data"] / "prompts_eval.jsonl")[:cfg.eval_prompts]]
    if cfg.rollout_batch_size > len(prompts):
        raise ValueError(f"rl.rollout_batch_size = {cfg.rollout_batch_size} exceeds the {len(prompts)} training prompts")
    rows_per_step = cfg.rollout_batch_size * cfg.n_samples
    if rows_per_step % cfg.batch_size:
        raise ValueError(f"rl: rollout_batch_size * n_samples = {rows_per_step} must be a multiple of batch_size "
                         f"= {cfg.batch_size}")
    reward_stats = {"mean": 0.0, "std": 1.0}
    if cfg.reward == "model":
        rm = json.loads((inputs["reward_model"] / "metrics.json").read_text())
        reward_stats = {"mean": rm["reward_mean"], "std": rm["reward_std"]}
    max_len = context_length(max(len(p["prompt_ids"]) for p in prompts + eval_prompts), cfg.max_new_tokens,
                             cfg.environment, inputs["model"])
    threads = max(1, int(ray.cluster_resources().get("CPU", 1)))
    roles = Roles(cfg, inputs, cfg.steps * rows_per_step // cfg.batch_size * cfg.ppo_epochs, threads, max_len, tracker)
    beat(f"rl/{cfg.name}: its actors and engines started")
    ckpt_dir = tracker.checkpoint_dir if cfg.checkpoint_every else None
    # keep: best saves each new best policy when it is found: beside the checkpoints, where a resumed run finds it
    # (the job removes them once the stage succeeded), or without checkpoints in the output being written (removed
    # if the stage fails), whence the best is moved into place at the end.
    best_root = (ckpt_dir or output) / "best"
    evals = []  # [step, held-out reward]: the validation curve
    teacher_kls = []  # [step, held-out reverse KL to the teacher] (rl.teacher)
    checkpointed_best = None  # the best step that the latest checkpoint names: its policy must stay until a later one

    def validate(s: int) -> None:
        """Score the held-out prompts with the policy after s steps; save it if it is the best yet (keep: best; the
        final policy goes to the output at the end)."""
        try:
            held_out = held_out_reward(roles, cfg, eval_prompts)
        except RemoteRewardError as err:  # which scoring the service left undone
            raise RemoteRewardError(f"rl/{cfg.name}, the held-out reward after step {s}: {err}") from None
        reward = held_out["eval_reward"]
        evals.append([s, reward])
        if "eval_teacher_kl" in held_out:
            teacher_kls.append([s, held_out["eval_teacher_kl"]])
        tracker.log_metrics(held_out, step=s)
        best_step, best_reward = best_of(evals)
        print(f"[rl/{cfg.name}] step {s}/{cfg.steps} held-out reward {reward:.4f} (best {best_reward:.4f} at step "
              f"{best_step})", flush=True)
        beat(f"rl/{cfg.name}: held-out reward at step {s}")
        if cfg.keep == "best" and best_step == s and s < cfg.steps:
            roles.policy.call("save_hf", str(best_root / f"step{s}"), str(inputs["model"]))
            keep_best_dirs(best_root, {s, checkpointed_best})

    step, log, kl_coef = 0, [], cfg.kl_coef
    counted = {}  # the judge's or reward service's counts at the step before (Roles.reward_counts)
    rng, order = random.Random(cfg.seed), []  # the prompts' order: passes over them, each seeded
    if resumed := checkpoints.resume(ckpt_dir, roles.trainers, "rl"):
        step, state = resumed
        log, kl_coef, evals, teacher_kls = state["log"], state["kl_coef"], state["evals"], state.get("teacher_kls", [])
        # A best saved after the checkpoint is the interrupted run's: this run scores those steps again.
        checkpointed_best = best_of(evals)[0]
        keep_best_dirs(best_root, {checkpointed_best})
        for s, reward in evals:  # the validation curve so far, into this attempt's MLflow run (a new one)
            tracker.log_metrics({"eval_reward": reward}, step=s)
        # Where the order stood (dynamic sampling draws a varying number of prompts per step): same prompts next.
        by_id = {p["id"]: p for p in prompts}
        order = [by_id[i] for i in state["order"]]
        version, internal, gauss = state["order_rng"]
        rng.setstate((version, tuple(internal), gauss))
        roles.sync_weights()
        tracker.log_metrics({"resumed_from_step": step}, step=step)
    else:
        shutil.rmtree(best_root, ignore_errors=True)  # an earlier attempt's, cut short before its first checkpoint
        validate(0)

    def draw(count: int) -> list[dict]:
        nonlocal order
        drawn, order = next_prompts(count, order, prompts, rng)
        return drawn

    def sample(s: int) -> tuple:
        """Step s's rollout, raw scores, prompts and counts (sample_step), with its generation time in the counts."""
        t0 = time.perf_counter()
        rollout, raw, batch, metrics = sample_step(roles, cfg, draw(cfg.rollout_batch_size), draw,
                                                   sampling_seed(cfg.seed, f"step {s}"))
        return rollout, raw, batch, metrics | {"time_generate": time.perf_counter() - t0}

    ahead = None  # step s's sample, generated while step s - 1 trained (async_rollouts)
    if resumed and "ahead" in state:
        ahead = Future()
        ahead.set_result(sample_from_state(state["ahead"]))
    pool = ThreadPoolExecutor(1, thread_name_prefix="rollout") if cfg.async_rollouts else None
    progress = Progress(f"rl/{cfg.name}", cfg.steps)
    try:
        for s in range(step, cfg.steps):
            train_rng = random.Random(cfg.seed * 1_000_003 + s)
            t0 = time.perf_counter()
            rollout, raw, batch, metrics = ahead.result() if ahead else sample(s)
            timings = {"time_wait_rollout": time.perf_counter() - t0}
            # each part of a step is progress: the stall watch's limit then bounds a part, and its message names the
            # part after which a stage stalled (a hanging reward function: after "responses generated")
            part_done = lambda part: beat(f"rl/{cfg.name} step {s + 1}/{cfg.steps}: {part}")
            part_done("responses generated")
            # step s + 1 samples now, with the weights the engines hold: those before this step's update
            ahead = pool.submit(sample, s + 1) if pool and s + 1 < cfg.steps else None
            t0 = time.perf_counter()
            metrics |= make_experience(roles, cfg, rollout, kl_coef, reward_stats, raw)
            timings["time_make_experience"] = time.perf_counter() - t0
            part_done("experience made")
            t0 = time.perf_counter()
            metrics |= train_on(roles.policy, cfg, rollout, train_rng)
            if roles.critic:
                metrics |= train_on(roles.critic, cfg, rollout, train_rng)
            timings["time_train"] = time.perf_counter() - t0
            part_done("trained")
            t0 = time.perf_counter()
            if ahead:
                ahead.result()  # the engines are done with the old weights before they take the new (raises its error)
                timings["time_wait_rollout"] += time.perf_counter() - t0
                t0 = time.perf_counter()
            roles.sync_weights()
            timings["time_weight_sync"] = time.perf_counter() - t0
            step = s + 1
            kl_coef = adapt_kl(kl_coef, metrics["kl"], cfg) if "kl" in metrics else kl_coef
            counts = roles.reward_counts()  # since the step before (held-out scoring included)
            metrics |= timings | {"kl_coef": kl_coef} | {k: n - counted.get(k, 0) for k, n in counts.items()}
            counted = counts
            tracker.log_metrics(metrics, step=step)
            log.append({"step": step, "loss": metrics["policy_loss"], **metrics, "prompt_ids": [p["id"] for p in batch]})
            progress.update(step, reward=metrics["reward_mean"], **({"kl": metrics["kl"]} if "kl" in metrics else {}),
                            clip=metrics["clip_fraction"])
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:  # (the last step's: after the loop)
                validate(step)
            if ckpt_dir and step % cfg.checkpoint_every == 0 and step < cfg.steps:
                checkpoints.save(ckpt_dir, step, roles.trainers,
                                 {"log": log, "kl_coef": kl_coef, "evals": evals, "teacher_kls": teacher_kls,
                                  "order": [p["id"] for p in order], "order_rng": rng.getstate()}
                                 | ({"ahead": sample_state(ahead.result())} if ahead else {}), cfg.keep_checkpoints)
                checkpointed_best = best_of(evals)[0]
                keep_best_dirs(best_root, {checkpointed_best})
    except BaseException as err:  # an interruption: episodes being played ahead end at their next turn
        if roles.episodes is not None:
            roles.episodes.stopping.set()
        if isinstance(err, RemoteRewardError) and not str(err).startswith(f"rl/{cfg.name},"):  # (validate names its)
            raise RemoteRewardError(f"rl/{cfg.name}, step {step + 1} of {cfg.steps}: {err}") from None
        raise
    finally:
        if pool:  # the rollout generated ahead ends before the stage does (an interruption shuts Ray down next)
            pool.shutdown()

    validate(step)
    (_, eval_before), (_, eval_after) = evals[0], evals[-1]
    best_step, best_reward = best_of(evals)
    kept_step = best_step if cfg.keep == "best" else step
    if kept_step == step:
        roles.policy.call("save_hf", str(output), str(inputs["model"]))
    else:
        for path in (best_root / f"step{kept_step}").iterdir():
            shutil.move(path, output / path.name)
    shutil.rmtree(best_root, ignore_errors=True)
    chosen = {"best_step": best_step, "best_eval_reward": best_reward, "kept_step": kept_step}
    final_kl = {"final_kl": log[-1]["kl"]} if "kl" in log[-1] else {}  # (none without a KL penalty: no reference)
    tracker.log_metrics({"eval_reward_before": eval_before} | final_kl | chosen, step=step)
    trainer.save_log(output, log)
    summary = {"variant": cfg.name, "estimator": cfg.estimator, "steps": step, "eval_reward_before": eval_before,
               "eval_reward": eval_after, "final_reward_mean": log[-1]["reward_mean"]} | final_kl
    if teacher_kls:
        summary |= {"eval_teacher_kl_before": teacher_kls[0][1], "eval_teacher_kl": teacher_kls[-1][1]}
    (output / "metrics.json").write_text(json.dumps(summary | chosen, indent=2))
    tracker.log_artifact(output / "metrics.json")
    print(f"[rl/{cfg.name}] held-out reward {eval_before:.4f} -> {eval_after:.4f}, best {best_reward:.4f} at step "
          f"{best_step}; the output holds the policy of step {kept_step}", flush=True)
