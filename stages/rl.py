"""Stage `rl`: PPO-family RL fine-tuning on Ray actor groups with vLLM rollouts.

One driver (this module's `run`) and actor groups: policy (DeepSpeed ZeRO ranks, trains), critic (PPO's
`gae` only, DeepSpeed), reference (frozen), reward (the reward-model stage's output, or a Python file exposing
`reward_fn(prompts, completions, labels) -> scores`) and a vLLM rollout engine. Each step:

    generate (vLLM, n samples per prompt) -> make experience (old/reference log-probs, rewards, values,
    KL, advantages) -> train (clipped policy loss; value loss) -> weight sync (trainer -> vLLM)

and a checkpoint every `checkpoint_every` steps; a restart resumes from it with the same prompt order.
One config names several variants (e.g. grpo, ppo); each is a separate run of this stage.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/rl/grpo
"""
import dataclasses
import importlib.util
import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import ray
import torch

from stages import data, losses, trainer
from stages.actor_group import ActorGroup
from stages.advantages import compute_advantages
from stages.config import REPO_ROOT
from stages.deepspeed_strategy import DeepSpeedWorker
from stages.models import (load_causal_lm, load_reward_model, load_tokenizer, load_value_model, pad_prompt_response,
                           response_logits, response_logprobs)
from stages.progress import Progress
from stages.rollout import VLLMEngine, sampling_seed

USES_RAY = True
ROLE_CPUS = 0.25  # colocated roles share the job's cores; Ray CPU counts only place them


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
    normalize_reward: bool
    reward_clip: float | None
    is_cap: float | None
    reward: str
    colocate: bool
    eval_prompts: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["rl"], name=params["variant"], seed=params["seed"])


# --- actors -----------------------------------------------------------------------------------------------

def token_tensor(rows: list[dict], key: str, mask: torch.Tensor) -> torch.Tensor:
    """Per-row response-token lists rows[i][key] laid into the (B, T) positions where mask is 1."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[mask.bool()] = torch.tensor([v for r in rows for v in r[key]], dtype=torch.float32)
    return out


def per_row(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [v[m.bool()].tolist() for v, m in zip(values, mask)]


def sample_batch(rows: list[dict], pad_id: int) -> dict:
    return pad_prompt_response([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], pad_id)


class PolicyWorker(DeepSpeedWorker):
    def setup(self, args: dict) -> None:
        self.init_distributed(args["rank"], args["rendezvous"], args["num_threads"])
        self.pad_id = load_tokenizer(args["model_dir"]).pad_token_id
        self.cfg = args["rl"]
        self.build_engine(model_loader=load_causal_lm, **args["engine"])

    @torch.no_grad()
    def logprobs(self, rows: list[dict]) -> list[list[float]]:
        if not rows:
            return []
        return per_row(*response_logprobs(self.engine, sample_batch(rows, self.pad_id)))

    def loss(self, rows):
        cfg = self.cfg
        batch = sample_batch(rows, self.pad_id)
        logits, labels, mask = response_logits(self.engine, batch)
        logp = losses.token_logprobs(logits, labels) * mask
        # Without old log-probs (see trains_once) the old policy is the current one: the ratio is exactly 1.
        old = token_tensor(rows, "old_logp", mask) if "old_logp" in rows[0] else logp.detach()
        is_weight = None
        if cfg["is_cap"]:  # truncated IS: pi_trainer_old / pi_vllm, capped (vLLM's sampler differs numerically)
            is_weight = torch.exp(old - token_tensor(rows, "rollout_logp", mask)).clamp(max=cfg["is_cap"]) * mask
        loss, clip_frac = losses.policy_loss(logp, old, token_tensor(rows, "advantages", mask), mask,
                                             cfg["clip_low"], cfg["clip_high"], cfg["dual_clip"], cfg["loss_agg"],
                                             is_weight)
        entropy = losses.masked_mean(losses.entropy_from_logits(logits), mask)
        if cfg["entropy_coef"]:
            loss = loss - cfg["entropy_coef"] * entropy
        stats = {"policy_loss": loss.item(), "clip_fraction": clip_frac.item(), "entropy": entropy.item()}
        if not cfg["kl_in_reward"] and cfg["kl_coef"]:  # GRPO style: KL to the reference as a loss term
            kl = losses.aggregate(losses.kl_estimate(logp, token_tensor(rows, "ref_logp", mask),
                                                     cfg["kl_estimator"]), mask, cfg["loss_agg"])
            loss = loss + cfg["kl_coef"] * kl
            stats["kl_loss"] = kl.item()
        return loss, stats


class CriticWorker(DeepSpeedWorker):
    TRAINS_HEAD = True
    def setup(self, args: dict) -> None:
        self.init_distributed(args["rank"], args["rendezvous"], args["num_threads"])
        self.pad_id = load_tokenizer(args["model_dir"]).pad_token_id
        self.cfg = args["rl"]
        self.build_engine(model_loader=load_value_model, **args["engine"])

    def _values(self, rows):
        batch = sample_batch(rows, self.pad_id)
        mask = batch["loss_mask"][:, 1:]
        # The value of the state before each response token: logits at position t-1, shape (B, T).
        values = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1, 0]
        return values * mask, mask

    @torch.no_grad()
    def values(self, rows: list[dict]) -> list[list[float]]:
        if not rows:
            return []
        values, mask = self._values(rows)
        return per_row(values, mask)

    def loss(self, rows):
        values, mask = self._values(rows)
        loss = losses.value_loss(values, token_tensor(rows, "old_values", mask), token_tensor(rows, "returns", mask),
                                 mask, self.cfg["value_clip"], self.cfg["loss_agg"])
        return loss, {"value_loss": loss.item()}


class FrozenScorer:
    """The reference policy's log-probs, or the reward model's scores: inference only, one actor."""

    def __init__(self, model_dir: str, kind: str, num_threads: int):
        torch.set_num_threads(num_threads)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = (load_causal_lm if kind == "policy" else load_reward_model)(model_dir).eval()

    @torch.no_grad()
    def logprobs(self, rows: list[dict]) -> list[list[float]]:
        return per_row(*response_logprobs(self.model, sample_batch(rows, self.tokenizer.pad_token_id)))

    @torch.no_grad()
    def scores(self, rows: list[dict]) -> list[float]:
        batch = sample_batch(rows, self.tokenizer.pad_token_id)
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].tolist()


def load_reward_fn(path: str):
    """reward_fn from a Python file (a path relative to the repository root, or absolute)."""
    spec = importlib.util.spec_from_file_location("alignpipe_user_reward", REPO_ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_fn", None)):
        raise ValueError(f"rl.reward = {path}: the file must define reward_fn(prompts, completions, labels)")
    return module.reward_fn


# --- driver -----------------------------------------------------------------------------------------------

def split_call(group: ActorGroup, method: str, rows: list) -> list:
    """Call `method` on the ranks of `group` with contiguous shares of rows; results back in row order."""
    size = -(-len(rows) // len(group.actors))
    parts = group.call_per_rank(method, [rows[i * size:(i + 1) * size] for i in range(len(group.actors))])
    return [x for part in parts for x in part]


class Roles:
    """Every actor of the stage, started once."""

    def __init__(self, cfg: Config, inputs: dict, total_train_steps: int, threads: int, max_len: int):
        cpus = ROLE_CPUS if cfg.colocate else 1
        rl_cfg = {k: getattr(cfg, k) for k in ("clip_low", "clip_high", "dual_clip", "loss_agg", "is_cap",
                                                "entropy_coef", "kl_in_reward", "kl_coef", "kl_estimator",
                                                "value_clip")}
        policy_dir = str(inputs["model"])
        self.policy = trainer.start_workers(PolicyWorker, cfg, inputs["model"], total_train_steps, {"rl": rl_cfg},
                                            cpus_per_actor=cpus)
        self.critic = None
        if cfg.estimator == "gae":
            critic_cfg = dataclasses.replace(cfg, learning_rate=cfg.critic_learning_rate)
            self.critic = trainer.start_workers(CriticWorker, critic_cfg, inputs["model"], total_train_steps,
                                                {"rl": rl_cfg}, cpus_per_actor=cpus)
        remote = lambda cls: ray.remote(num_cpus=cpus)(cls)
        self.reference = remote(FrozenScorer).remote(policy_dir, "policy", threads)
        self.reward_model = remote(FrozenScorer).remote(str(inputs["reward_model"]), "reward", threads) \
            if cfg.reward == "model" else None
        self.reward_fn = None if cfg.reward == "model" else load_reward_fn(cfg.reward)
        self.engine = remote(VLLMEngine).remote(policy_dir, cfg.seed, max_len, num_threads=threads)


def generate(roles: Roles, prompts: list[dict], n: int, cfg: Config, seed: int, temperature: float) -> list[dict]:
    outputs = ray.get(roles.engine.generate.remote([p["prompt_ids"] for p in prompts], n, temperature, cfg.top_p,
                                                   cfg.max_new_tokens, seed))
    rows = []
    for prompt, samples in zip(prompts, outputs):
        for s in samples:
            response = s["token_ids"] or [0]  # an empty response still needs one position to score
            rows.append({"prompt_ids": prompt["prompt_ids"], "response_ids": response, "prompt": prompt["prompt"],
                         "completion": s["text"], "label": prompt.get("label"), "prompt_id": prompt["id"],
                         "rollout_logp": (s["logprobs"] or [0.0])[:len(response)]})
    return rows


def score(roles: Roles, rows: list[dict]) -> list[float]:
    if roles.reward_model is not None:
        return ray.get(roles.reward_model.scores.remote(rows))
    return [float(s) for s in roles.reward_fn([r["prompt"] for r in rows], [r["completion"] for r in rows],
                                              [r["label"] for r in rows])]


def trains_once(cfg: Config) -> bool:
    """Is each rollout trained on in one optimizer step, by the weights that sampled it? Then the policy's old
    log-probs are the training forward's own, detached (as in TRL's GRPO with num_iterations=1), and need no pass
    of their own. (The KL in the reward is computed before training, so it still needs them.)"""
    return cfg.ppo_epochs == 1 and cfg.batch_size == cfg.rollout_batch_size * cfg.n_samples and not cfg.kl_in_reward


def make_experience(roles: Roles, cfg: Config, rows: list[dict], kl_coef: float, reward_stats: dict) -> dict:
    raw = score(roles, rows)
    scores = torch.tensor(raw)
    if cfg.normalize_reward:
        scores = (scores - reward_stats["mean"]) / max(reward_stats["std"], 1e-6)
    if cfg.reward_clip:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    for row, r in zip(rows, ray.get(roles.reference.logprobs.remote(rows))):
        row["ref_logp"] = r
    once = trains_once(cfg)
    if not once:
        for row, o in zip(rows, split_call(roles.policy, "logprobs", rows)):
            row["old_logp"] = o
    sampled = "rollout_logp" if once else "old_logp"  # vLLM's log-probs come from the same weights
    width = max(len(r["response_ids"]) for r in rows)
    mask = torch.tensor([[1.0] * len(r["response_ids"]) + [0.0] * (width - len(r["response_ids"])) for r in rows])
    pad = lambda key: torch.tensor([r[key] + [0.0] * (width - len(r[key])) for r in rows])
    kl = losses.kl_estimate(pad(sampled), pad("ref_logp"), cfg.kl_estimator) * mask
    token_rewards = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    token_rewards[torch.arange(len(rows)), last] = scores
    if cfg.kl_in_reward:
        token_rewards = token_rewards - kl_coef * kl
    values = None
    if roles.critic is not None:
        for row, v in zip(rows, split_call(roles.critic, "values", rows)):
            row["old_values"] = v
        values = pad("old_values")
    advantages, returns = compute_advantages(cfg.estimator, token_rewards, mask, cfg.n_samples, values,
                                             cfg.gamma, cfg.lam)
    for i, row in enumerate(rows):
        n = len(row["response_ids"])
        row["advantages"], row["returns"] = advantages[i, :n].tolist(), returns[i, :n].tolist()
    lengths = mask.sum(-1)
    metrics = {"reward_mean": statistics.fmean(raw), "reward_std": statistics.pstdev(raw),
               "kl": (kl.sum(-1)).mean().item(), "response_length": lengths.mean().item(),
               "advantage_mean": losses.masked_mean(advantages, mask).item(),
               "advantage_std": advantages[mask.bool()].std().item() if mask.sum() > 1 else 0.0}
    if not once:  # how far vLLM's sampling log-probs are from the trainer's: near 0 when the weight sync works
        metrics["vllm_logprob_gap"] = losses.masked_mean((pad("old_logp") - pad("rollout_logp")).abs(), mask).item()
    return metrics


def train_on(group: ActorGroup, cfg: Config, rows: list[dict], rng: random.Random) -> dict:
    stats = []
    for _ in range(cfg.ppo_epochs):
        order = rows[:]
        rng.shuffle(order)
        for start in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            per_rank = group.call_per_rank("train_step", trainer.shard(order[start:start + cfg.batch_size],
                                                                       cfg.num_workers, cfg.micro_batch_size))
            stats.append({k: statistics.fmean(r[k] for r in per_rank) for k in per_rank[0]})
    return {k: statistics.fmean(s[k] for s in stats) for k in stats[0]}


def sync_weights(roles: Roles, sync_dir: Path, tokenizer_dir: Path) -> None:
    """Trainer -> vLLM. On CPU: rank 0 writes the weights, vLLM reloads them and resets its prefix cache.
    (On GPU the same call is where an NCCL broadcast or CUDA IPC handles would go.)"""
    shutil.rmtree(sync_dir, ignore_errors=True)
    roles.policy.call("save_hf", str(sync_dir), str(tokenizer_dir))
    ray.get(roles.engine.update_weights.remote(str(sync_dir)))


def adapt_kl(kl_coef: float, kl: float, cfg: Config) -> float:
    # Adaptive KL controller (Ziegler et al. 2019): move the coefficient toward the target KL.
    if cfg.kl_target is None:
        return kl_coef
    error = max(-0.2, min(0.2, kl / cfg.kl_target - 1))
    return kl_coef * (1 + error * cfg.rollout_batch_size * cfg.n_samples / 10000)


def held_out_reward(roles: Roles, cfg: Config, prompts: list[dict]) -> float:
    """Mean RL reward of n_samples responses to each held-out prompt (same seeds before and after training)."""
    rows = generate(roles, prompts, cfg.n_samples, cfg, sampling_seed(cfg.seed, "held-out"), cfg.temperature)
    return statistics.fmean(score(roles, rows))


def run(cfg: Config, inputs: dict, output: Path, run) -> None:
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
    max_len = max(len(p["prompt_ids"]) for p in prompts + eval_prompts) + cfg.max_new_tokens + 8
    threads = max(1, int(ray.cluster_resources().get("CPU", 1)))
    roles = Roles(cfg, inputs, cfg.steps * rows_per_step // cfg.batch_size * cfg.ppo_epochs, threads, max_len)
    sync_dir = output.with_name(output.name + ".weights")
    ckpt_dir = getattr(run, "checkpoint_dir", None) if cfg.checkpoint_every else None

    step, log, kl_coef = 0, [], cfg.kl_coef
    if ckpt_dir and (ckpt_dir / "latest.json").exists():
        state = json.loads((ckpt_dir / "latest.json").read_text())
        roles.policy.call("load_checkpoint", str(ckpt_dir / "policy"), state["tag"])
        if roles.critic:
            roles.critic.call("load_checkpoint", str(ckpt_dir / "critic"), state["tag"])
        step, log, kl_coef = state["step"], state["log"], state["kl_coef"]
        sync_weights(roles, sync_dir, inputs["model"])
        print(f"[rl] resumed from checkpoint at step {step}", flush=True)
        run.log_metrics({"resumed_from_step": step}, step=step)
        eval_before = state["eval_reward_before"]
    else:
        eval_before = held_out_reward(roles, cfg, eval_prompts)
        run.log_metrics({"eval_reward": eval_before}, step=0)

    rng = random.Random(cfg.seed)
    order: list[dict] = []
    progress = Progress(f"rl/{cfg.name}", cfg.steps)
    for s in range(cfg.steps):
        if len(order) < cfg.rollout_batch_size:  # a new pass over the prompts, in a seeded order
            fresh = prompts[:]
            rng.shuffle(fresh)
            order = order + fresh
        batch, order = order[:cfg.rollout_batch_size], order[cfg.rollout_batch_size:]
        train_rng = random.Random(cfg.seed * 1_000_003 + s)
        if s < step:
            continue  # replayed to reach the resumed position: same prompts, none twice, none skipped
        timings = {}
        t0 = time.perf_counter()
        rows = generate(roles, batch, cfg.n_samples, cfg, sampling_seed(cfg.seed, f"step {s}"), cfg.temperature)
        timings["time_generate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = make_experience(roles, cfg, rows, kl_coef, reward_stats)
        timings["time_make_experience"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics |= train_on(roles.policy, cfg, rows, train_rng)
        if roles.critic:
            metrics |= train_on(roles.critic, cfg, rows, train_rng)
        timings["time_train"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync_weights(roles, sync_dir, inputs["model"])
        timings["time_weight_sync"] = time.perf_counter() - t0
        step = s + 1
        kl_coef = adapt_kl(kl_coef, metrics["kl"], cfg)
        metrics |= timings | {"kl_coef": kl_coef}
        run.log_metrics(metrics, step=step)
        log.append({"step": step, "loss": metrics["policy_loss"], **metrics, "prompt_ids": [p["id"] for p in batch]})
        progress.update(step, reward=metrics["reward_mean"], kl=metrics["kl"], clip=metrics["clip_fraction"])
        if ckpt_dir and step % cfg.checkpoint_every == 0 and step < cfg.steps:
            tag = f"step{step}"
            roles.policy.call("save_checkpoint", str(ckpt_dir / "policy"), tag)
            if roles.critic:
                roles.critic.call("save_checkpoint", str(ckpt_dir / "critic"), tag)
            (ckpt_dir / "latest.json.tmp").write_text(json.dumps(
                {"step": step, "tag": tag, "log": log, "kl_coef": kl_coef, "eval_reward_before": eval_before}))
            os.replace(ckpt_dir / "latest.json.tmp", ckpt_dir / "latest.json")
            print(f"[checkpoint] step {step} -> {ckpt_dir}", flush=True)

    eval_after = held_out_reward(roles, cfg, eval_prompts)
    run.log_metrics({"eval_reward": eval_after, "eval_reward_before": eval_before, "final_kl": log[-1]["kl"]},
                    step=step)
    roles.policy.call("save_hf", str(output), str(inputs["model"]))
    shutil.rmtree(sync_dir, ignore_errors=True)
    trainer.save_log(output, log)
    summary = {"variant": cfg.name, "estimator": cfg.estimator, "steps": step, "eval_reward_before": eval_before,
               "eval_reward": eval_after, "final_reward_mean": log[-1]["reward_mean"], "final_kl": log[-1]["kl"]}
    (output / "metrics.json").write_text(json.dumps(summary, indent=2))
    run.log_artifact(output / "metrics.json")
    print(f"[rl/{cfg.name}] held-out reward {eval_before:.4f} -> {eval_after:.4f}", flush=True)
