"""The rl stage's Ray actors: the policy and critic trainers (DeepSpeed ranks), the frozen reference and reward
model, and `Roles`, which starts them all with the vLLM rollout engine. Each takes and returns `Rollout` rows."""
import dataclasses

import ray
import torch

from runtime import losses, trainer
from runtime.rewards import load_reward_fn
from runtime.deepspeed_strategy import DeepSpeedWorker, Rank
from runtime.experience import Rollout
from runtime.logprobs import entropy_from_logits, response_logits, response_logprobs, token_logprobs
from runtime.models import load_causal_lm, load_reward_model, load_tokenizer, load_value_model
from runtime.rollout import VLLMEngine

ROLE_CPUS = 0.25  # colocated roles share the job's cores; Ray CPU counts only place them


class PolicyWorker(DeepSpeedWorker):
    def setup(self, cfg, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.pad_id = load_tokenizer(rank.model_dir).pad_token_id
        self.cfg = cfg
        self.build_engine(cfg, rank, load_causal_lm)

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        if not rollout:
            return torch.zeros_like(rollout.mask)
        return rollout.from_batch(*response_logprobs(self.engine, rollout.tokens(self.pad_id)))

    def loss(self, rollout: Rollout):
        cfg = self.cfg
        logits, labels, mask = response_logits(self.engine, rollout.tokens(self.pad_id))
        logp = token_logprobs(logits, labels) * mask
        # Without old log-probs (see experience.trains_once) the old policy is the current one: the ratio is 1.
        old = rollout.to_batch(rollout.old_logp, mask) if rollout.old_logp is not None else logp.detach()
        is_weight = None
        if cfg.is_cap:  # truncated IS: pi_trainer_old / pi_vllm, capped (vLLM's sampler differs numerically)
            is_weight = torch.exp(old - rollout.to_batch(rollout.rollout_logp, mask)).clamp(max=cfg.is_cap) * mask
        loss, clip_frac = losses.policy_loss(logp, old, rollout.to_batch(rollout.advantages, mask), mask,
                                             cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.loss_agg, is_weight)
        entropy = losses.masked_mean(entropy_from_logits(logits), mask)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
        stats = {"policy_loss": loss.item(), "clip_fraction": clip_frac.item(), "entropy": entropy.item()}
        if not cfg.kl_in_reward and cfg.kl_coef:  # GRPO style: KL to the reference as a loss term
            kl = losses.aggregate(losses.kl_estimate(logp, rollout.to_batch(rollout.ref_logp, mask), cfg.kl_estimator),
                                  mask, cfg.loss_agg)
            loss = loss + cfg.kl_coef * kl
            stats["kl_loss"] = kl.item()
        return loss, stats


class CriticWorker(DeepSpeedWorker):
    TRAINS_HEAD = True

    def setup(self, cfg, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.pad_id = load_tokenizer(rank.model_dir).pad_token_id
        self.cfg = cfg
        self.build_engine(cfg, rank, load_value_model)

    def _values(self, rollout: Rollout):
        batch = rollout.tokens(self.pad_id)
        mask = batch["loss_mask"][:, 1:]
        # The value of the state before each response token: logits at position t-1, shape (B, T).
        values = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1, 0]
        return values * mask, mask

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        if not rollout:
            return torch.zeros_like(rollout.mask)
        return rollout.from_batch(*self._values(rollout))

    def loss(self, rollout: Rollout):
        values, mask = self._values(rollout)
        loss = losses.value_loss(values, rollout.to_batch(rollout.old_values, mask),
                                 rollout.to_batch(rollout.returns, mask), mask, self.cfg.value_clip, self.cfg.loss_agg)
        return loss, {"value_loss": loss.item()}


class FrozenScorer:
    """The reference policy's log-probs, or the reward model's scores: inference only, one actor."""

    def __init__(self, model_dir: str, kind: str, num_threads: int):
        torch.set_num_threads(num_threads)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = (load_causal_lm if kind == "policy" else load_reward_model)(model_dir).eval()

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        return rollout.from_batch(*response_logprobs(self.model, rollout.tokens(self.tokenizer.pad_token_id)))

    @torch.no_grad()
    def scores(self, rollout: Rollout) -> list[float]:
        batch = rollout.tokens(self.tokenizer.pad_token_id)
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].tolist()


class Roles:
    """Every actor of the stage, started once; `trainers` are the groups a checkpoint saves."""

    def __init__(self, cfg, inputs: dict, total_train_steps: int, threads: int, max_len: int, tracker):
        cpus = ROLE_CPUS if cfg.colocate else 1
        policy_dir = str(inputs["model"])
        self.policy = trainer.start_workers(PolicyWorker, cfg, inputs["model"], total_train_steps, tracker,
                                            cpus_per_actor=cpus)
        self.critic = None
        if cfg.estimator == "gae":
            critic_cfg = dataclasses.replace(cfg, learning_rate=cfg.critic_learning_rate)
            self.critic = trainer.start_workers(CriticWorker, critic_cfg, inputs["model"], total_train_steps, tracker,
                                                cpus_per_actor=cpus)
        self.trainers = {"policy": self.policy} | ({"critic": self.critic} if self.critic else {})
        remote = lambda cls: ray.remote(num_cpus=cpus)(cls)
        self.reference = remote(FrozenScorer).remote(policy_dir, "policy", threads)
        self.reward_model = remote(FrozenScorer).remote(str(inputs["reward_model"]), "reward", threads) \
            if cfg.reward == "model" else None
        self.reward_file = None if cfg.reward == "model" else inputs["reward_file"]
        self.reward_fn = self.reward_file and load_reward_fn(self.reward_file)
        self.engine = remote(VLLMEngine).remote(policy_dir, cfg.seed, max_len, num_threads=threads)
