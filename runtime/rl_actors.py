"""The rl stage's Ray actors: the policy and critic trainers (DeepSpeed ranks), the frozen reference and reward
model, and `Roles`, which starts them all with the vLLM rollout engines and places them: on CPU every role shares the
job's cores (`colocate`) or takes 1 CPU per actor; on GPUs one GPU per rank and per engine GPU, in placement groups of
their own, or, colocated, all roles in one placement group with a share of each GPU. Each takes and returns `Rollout`
rows."""
import dataclasses

import ray
import torch

from runtime import losses, trainer, weight_sync
from runtime.actor_group import (ActorGroup, actor_threads, bundles, check_gpus_shareable, cluster_gpus,
                                 reserve)
from runtime.environments import EpisodeRunner
from runtime.deepspeed_strategy import DeepSpeedWorker, Rank, inference_ds_config
from runtime.experience import Rollout
from runtime.judge import Judge, greedy_verdicts, judge_context
from runtime.logprobs import (entropy_from_logits, forward_tokens, on_device, response_logits, response_logprobs,
                              token_logprobs)
from runtime.models import (device, load_causal_lm, load_reward_model, load_tokenizer, load_value_model, model_dtype,
                            release_cached_memory, vocabulary_mismatch, weights_dtype)
from runtime.remote_reward import RemoteReward
from runtime.rewards import is_remote, load_reward_fn
from runtime.rollout import generate_on, start_engines

ROLE_CPUS = 0.25  # colocated roles share the job's cores; Ray CPU counts only place them


def forward_in_pieces(fn, rollout: Rollout, size: int | None) -> torch.Tensor:
    """`fn` over the rollout's rows `size` at a time (None: at once); the (B, T) results in row order. (A rank's
    share is never empty: runtime/experience.shares.)"""
    return torch.cat([fn(piece) for piece in rollout.micro_batches(size)])


class PolicyWorker(DeepSpeedWorker):
    def setup(self, cfg, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.pad_id = load_tokenizer(rank.model_dir).pad_token_id
        self.cfg = cfg
        self.build_engine(cfg, rank, load_causal_lm)

    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        return forward_in_pieces(
            lambda rows: rows.from_batch(*response_logprobs(self.engine, rows.tokens(self.pad_id, self.cfg.packing),
                                                            self.cfg.temperature)),
            rollout, self.forward_micro_batch_size)

    def loss(self, rollout: Rollout):
        cfg = self.cfg
        batch = rollout.tokens(self.pad_id, cfg.packing)
        logits, labels, mask = response_logits(self.engine, batch)
        logp = token_logprobs(logits, labels, cfg.temperature) * mask
        # Without old log-probs (see experience.trains_once) the old policy is the current one: the ratio is 1.
        old = rollout.to_batch(rollout.old_logp, mask) if rollout.old_logp is not None else logp.detach()
        is_weight = None
        if cfg.is_cap:  # truncated IS: pi_trainer_old / pi_vllm, capped (vLLM's sampler differs numerically)
            is_weight = torch.exp(old - rollout.to_batch(rollout.rollout_logp, mask)).clamp(max=cfg.is_cap) * mask
        advantages = rollout.to_batch(rollout.advantages, mask)
        counted = mask  # the tokens the policy loss counts: not those of rows it leaves out (overlong mask)
        if rollout.keep is not None:
            counted = mask * rollout.keep.to(mask.device, mask.dtype).unsqueeze(-1)
        if cfg.policy_loss == "gspo":
            loss, clip_frac = losses.gspo_policy_loss(logp, old, advantages, counted, cfg.clip_low, cfg.clip_high,
                                                      is_weight)
        elif cfg.policy_loss == "cispo":
            loss, clip_frac = losses.cispo_policy_loss(logp, old, advantages, counted, cfg.clip_low, cfg.clip_high,
                                                       cfg.loss_agg, is_weight)
        else:
            loss, clip_frac = losses.policy_loss(logp, old, advantages, counted, cfg.clip_low, cfg.clip_high,
                                                 cfg.dual_clip, cfg.loss_agg, is_weight)
        # The entropy over the whole vocabulary is a (B, K, V) computation: without autograd unless it is trained on.
        with torch.set_grad_enabled(torch.is_grad_enabled() and bool(cfg.entropy_coef)):
            entropy = losses.masked_mean(entropy_from_logits(logits, cfg.temperature), mask)  # (the sampled one's)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
        stats = {"policy_loss": loss.detach(), "clip_fraction": clip_frac.detach(), "entropy": entropy.detach(),
                 # what packing saves: the positions this forward computed, and what the padded batch would have
                 "forward_tokens": forward_tokens(batch), "padded_tokens": batch["input_ids"].numel()}
        if not cfg.kl_in_reward and cfg.kl_coef:  # GRPO style: KL to the reference as a loss term
            kl = losses.aggregate(losses.kl_estimate(logp, rollout.to_batch(rollout.ref_logp, mask), cfg.kl_estimator),
                                  mask, cfg.loss_agg)
            loss = loss + cfg.kl_coef * kl
            stats["kl_loss"] = kl.detach()
        return loss, stats

    def init_weight_group(self, master_address: str, master_port: int, world_size: int) -> None:
        if self.rank == 0:
            weight_sync.init_trainer_group(self, master_address, master_port, world_size)

    def send_weights(self, engines: list, mode: str) -> int:
        return weight_sync.send_weights(self, engines, mode)


class CriticWorker(DeepSpeedWorker):
    TRAINS_HEAD = True

    def setup(self, cfg, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.pad_id = load_tokenizer(rank.model_dir).pad_token_id
        self.cfg = cfg
        self.build_engine(cfg, rank, load_value_model)

    def _values(self, rollout: Rollout):
        batch = on_device(rollout.tokens(self.pad_id), self.engine)
        mask = batch["loss_mask"][:, 1:]
        # The value of the state before each response token: logits at position t-1, shape (B, T).
        values = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             use_cache=False).logits[:, :-1, 0].float()
        return values * mask, mask

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        return forward_in_pieces(lambda rows: rows.from_batch(*self._values(rows)), rollout,
                                 self.forward_micro_batch_size)

    def loss(self, rollout: Rollout):
        values, mask = self._values(rollout)
        loss = losses.value_loss(values, rollout.to_batch(rollout.old_values, mask),
                                 rollout.to_batch(rollout.returns, mask), mask, self.cfg.value_clip, self.cfg.loss_agg)
        return loss, {"value_loss": loss.detach()}


class FrozenScorer(DeepSpeedWorker):
    """The reference policy's log-probs, or the reward model's scores: inference only, in `precision`, on this
    rank's device, `forward_micro_batch_size` rows at a time. With several ranks and ZeRO-3 (`frozen_ranks`,
    `zero_stage` 3) the weights are sharded across the ranks, each scoring its share of the rows."""
    packing = False  # the reference's forwards packed (rl.packing; setup sets it)
    temperature = 1.0  # the reference's log-probs at the sampling temperature (setup sets it)

    def setup(self, cfg, rank: Rank, kind: str) -> None:
        self.tokenizer = load_tokenizer(rank.model_dir)
        self.forward_micro_batch_size = cfg.forward_micro_batch_size
        self.packing = cfg.packing and kind == "policy"  # (a reward model's forwards stay padded)
        # The reference's log-probs at the sampling temperature, as the policy's: the KL compares the two
        # distributions the samples are drawn from and would be drawn from.
        self.temperature = cfg.temperature if kind == "policy" else 1.0
        loader = load_causal_lm if kind == "policy" else load_reward_model
        dtype = model_dtype(cfg.precision)
        torch.set_num_threads(rank.num_threads)
        if rank.rendezvous["world_size"] > 1 and cfg.zero_stage == 3:
            import deepspeed
            from transformers.integrations import HfDeepSpeedConfig
            self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
            config = inference_ds_config(3, weights_dtype(dtype) == "bfloat16")
            self._hf_ds_config = HfDeepSpeedConfig(config)  # from_pretrained loads straight into shards
            model = loader(rank.model_dir, dtype, cfg.attn_implementation)
            self.model = deepspeed.initialize(model=model, config=config)[0].module.eval()
        else:
            if torch.cuda.is_available():
                torch.cuda.set_device(0)
            self.model = loader(rank.model_dir, dtype, cfg.attn_implementation).to(device()).eval()

    # After each call the allocator's cache goes back to the GPU: vLLM and the trainers share it.
    @torch.no_grad()
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        pad_id = self.tokenizer.pad_token_id
        logp = forward_in_pieces(
            lambda rows: rows.from_batch(*response_logprobs(self.model, rows.tokens(pad_id, self.packing),
                                                            self.temperature)),
            rollout, self.forward_micro_batch_size)
        release_cached_memory()
        return logp

    @torch.no_grad()
    def scores(self, rollout: Rollout) -> list[float]:
        out = []
        for rows in rollout.micro_batches(self.forward_micro_batch_size):
            batch = on_device(rows.tokens(self.tokenizer.pad_token_id), self.model)
            out += self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              use_cache=False).logits[:, 0].tolist()
        release_cached_memory()
        return out


class Roles:
    """Every actor of the stage, started once; `trainers` are the groups a checkpoint saves."""

    def __init__(self, cfg, inputs: dict, total_train_steps: int, threads: int, max_len: int, tracker):
        self.gpus = cluster_gpus() > 0
        self.sleeps = cfg.vllm["sleep"]
        self.engines_asleep: set[str] = set()  # what the engines' sleep freed and no wake_up brought back yet
        if self.sleeps and not (self.gpus and cfg.colocate and cfg.zero_stage == 3):
            raise ValueError("rl.vllm.sleep needs GPUs, colocate: true and zero_stage 3 (vLLM sleeps while DeepSpeed "
                             "trains on the same GPUs, DeepSpeed's ZeRO-3 states move to CPU memory while vLLM "
                             "generates); set it to false")
        policy_dir = str(inputs["model"])
        wants_critic = cfg.estimator == "gae"
        wants_reward = cfg.reward == "model"
        wants_reference = bool(cfg.kl_coef)  # its log-probs serve the KL penalty alone (runtime/experience.py)
        frozen_roles = wants_reference + wants_reward + bool(cfg.teacher)
        if cfg.teacher and (problem := vocabulary_mismatch(policy_dir, inputs["teacher"])):
            raise ValueError(f"rl.teacher: {problem}")
        tp = cfg.vllm["tensor_parallel_size"]
        if tp > 1 and not self.gpus:
            raise ValueError(f"rl.vllm.tensor_parallel_size = {tp} splits an engine over GPUs; this job has none")
        if self.gpus and (cfg.colocate or tp > 1):
            check_gpus_shareable("rl.colocate: true (every role and CUDA IPC on the same GPUs)" if cfg.colocate else
                                 f"rl.vllm.tensor_parallel_size = {tp} (an engine's actor beside its vLLM worker)")
        # Placement: CPU shares of the job's cores, or GPUs (one per rank, shared by every role when colocated).
        shared, gpu = None, 0
        if self.gpus:
            roles = 2 + wants_critic + frozen_roles  # policy, engines, critic?, reference?, reward model?, teacher?
            width = max(cfg.num_workers, cfg.frozen_ranks if frozen_roles else 0, cfg.vllm["num_engines"] * tp)
            if cfg.colocate:
                shared = reserve(bundles(width, 1, 1), "PACK", f"{width} GPUs shared by the rl stage's roles")
                gpu = 1 / roles
            else:
                gpu = 1
        # Colocated on CPU, every actor takes an equal share of the job's cores (at most ROLE_CPUS) so that all fit.
        actors = cfg.num_workers * (1 + wants_critic) + cfg.frozen_ranks * frozen_roles + \
            cfg.vllm["num_engines"] + (cfg.judge["vllm"]["num_engines"] if cfg.reward == "judge" else 0)
        cpu_share = min(ROLE_CPUS, int(100 * ray.cluster_resources().get("CPU", 1) / actors) / 100)
        cpus = 1 if not cfg.colocate else 0 if shared else cpu_share
        # The frozen models' and engines' torch threads: the CPUs each reserves, or the job's where roles take turns.
        role_threads = actor_threads(cpus, threads, takes_turns=cfg.colocate and not self.gpus)
        trainer_threads = None  # (start_workers: the job's CPUs over the ranks)
        engine_threads = role_threads
        if cfg.async_rollouts and cfg.colocate and not self.gpus:
            # The engines generate while the others score and train: they split the job's cores (the engines half)
            # instead of each taking all of them, which would run both phases at a fraction of their speed.
            engine_threads = max(1, threads // 2)
            role_threads = max(1, threads - engine_threads)
            trainer_threads = max(1, role_threads // cfg.num_workers)
            print(f"[rl] asynchronous rollouts on {threads} CPU threads: the vLLM engines take {engine_threads}, the "
                  f"trainers and scorers {role_threads}", flush=True)
        start = lambda cls, c: trainer.start_workers(cls, c, inputs["model"], total_train_steps, tracker,
                                                     cpus_per_actor=cpus, gpus_per_actor=gpu, shared=shared,
                                                     threads=trainer_threads)
        engines = lambda: start_engines(policy_dir, cfg.seed, max_len, cfg.vllm, engine_threads, cpus, self.gpus,
                                        model_dtype(cfg.precision, self.gpus), shared, gpu)
        # On CPU the engines start first (start_engines does not wait for them): vLLM's start-up runs while the
        # trainers and scorers load. On GPUs they start last, so that the trainers' GPUs are reserved as planned.
        self.engines = None if self.gpus else engines()
        self.policy = start(PolicyWorker, cfg)
        self.critic = start(CriticWorker, dataclasses.replace(cfg, learning_rate=cfg.critic_learning_rate)) \
            if wants_critic else None
        self.trainers = {"policy": self.policy} | ({"critic": self.critic} if self.critic else {})
        frozen = lambda model_dir, kind: self._frozen(cfg, model_dir, kind, role_threads, cpus, gpu, shared, tracker)
        self.reference = frozen(policy_dir, "policy") if wants_reference else None
        self.reward_model = frozen(str(inputs["reward_model"]), "reward") if wants_reward else None
        self.teacher = frozen(str(inputs["teacher"]), "policy") if cfg.teacher else None
        # A reward function: a reward file's, a reward service, or the judge (None: the reward model, or no reward:
        # an environment's step rewards or the teacher's alone); reward_file names it in errors.
        self.reward_file = self.reward_fn = self.judge_engines = None
        if cfg.reward == "judge":
            context = judge_context(inputs["judge_model"])
            self.judge_engines = start_engines(str(inputs["judge_model"]), cfg.seed, context, cfg.judge["vllm"],
                                               engine_threads, cpus, self.gpus,
                                               model_dtype(cfg.precision, self.gpus))
            verdicts = greedy_verdicts(lambda *args: generate_on(self.judge_engines, *args), context)
            self.reward_file, self.reward_fn = "judge", Judge(cfg.judge, load_tokenizer(inputs["judge_model"]), verdicts)
        elif is_remote(cfg.reward):
            self.reward_file, self.reward_fn = cfg.reward, RemoteReward(cfg.reward, cfg.remote_reward)
        elif cfg.reward != "model" and cfg.reward:
            self.reward_file = inputs["reward_file"]
            self.reward_fn = load_reward_fn(self.reward_file)
        self.episodes = EpisodeRunner(cfg.environment, inputs["environment_file"], load_tokenizer(policy_dir),
                                      max_len) if cfg.environment else None
        if self.gpus:
            # Started, not just created: vLLM measures the GPU memory it may take while it starts, so the trainers'
            # states must not leave the GPUs meanwhile (the held-out reward's before_generate offloads them).
            self.engines = engines()
            ray.get([engine.__ray_ready__.remote() for engine in self.engines])
        self.weight_mode = "memory" if not self.gpus else ("ipc" if cfg.colocate else "nccl")
        if self.weight_mode == "nccl":
            self._init_weight_group(tp)

    def reward_counts(self) -> dict:
        """What scoring counted so far: the judge's verdicts and those without a score, a reward service's requests and
        retries."""
        if isinstance(self.reward_fn, Judge):
            return {"judge_scored": self.reward_fn.rows, "judge_unparsed": self.reward_fn.unparsed}
        if isinstance(self.reward_fn, RemoteReward):
            return {"remote_requests": self.reward_fn.requests, "remote_retries": self.reward_fn.retries}
        return {}

    @staticmethod
    def _frozen(cfg, model_dir: str, kind: str, threads: int, cpus: float, gpu: float, shared, tracker) -> ActorGroup:
        group = ActorGroup(FrozenScorer, cfg.frozen_ranks, cpus_per_actor=cpus, gpus_per_actor=gpu, shared=shared)
        tracker.record_placements(group.placements)
        ray.get([actor.setup.remote(cfg, Rank(r, group.rendezvous, threads, model_dir, 0), kind)
                 for r, actor in enumerate(group.actors)])
        return group

    def _init_weight_group(self, tp: int) -> None:
        """Policy rank 0 and every vLLM worker in one NCCL group (rank 0 the trainer)."""
        address, port = ray.get(self.policy.actors[0].rendezvous_address.remote())
        world = 1 + len(self.engines) * tp
        ray.get([self.policy.actors[0].init_weight_group.remote(address, port, world)] +
                [engine.init_weight_group.remote(address, port, 1 + i * tp, world)
                 for i, engine in enumerate(self.engines)])

    def sync_weights(self) -> None:
        """Trainer -> vLLM in memory, one module's weights at a time (runtime/weight_sync.py: through shared memory
        on CPU, an NCCL broadcast or CUDA IPC on GPUs); the engines then drop prefixes cached with the old weights.
        Engines asleep get their weights' memory back first (sleep level 2 left it unallocated)."""
        if "weights" in self.engines_asleep:
            ray.get([engine.wake_up.remote(["weights"]) for engine in self.engines])
            self.engines_asleep.discard("weights")
        self.policy.call("send_weights", self.engines, self.weight_mode)
        if self.weight_mode != "memory":
            ray.get([engine.finish_weight_update.remote() for engine in self.engines])

    def before_generate(self) -> None:
        """vllm.sleep: the engines wholly awake with the policy's weights, the trainers' states off the GPUs. vLLM
        0.32 schedules no request until every tag is awake (its engine core stays paused), so a partial wake would
        leave `generate` waiting forever. Where no sync followed the last sleep (the held-out reward before step 0, a
        dynamic-sampling round) the engines' weights were discarded and the unchanged policy's are sent again."""
        if not self.sleeps:
            return
        if "weights" in self.engines_asleep:
            self.sync_weights()
        for group in self.trainers.values():
            group.call("offload_states")
        if self.engines_asleep:
            awake = ray.get([engine.wake_up.remote(sorted(self.engines_asleep)) for engine in self.engines])
            if not all(awake):  # vLLM ignores a wake-up of tags it does not have asleep: generate would wait forever
                raise RuntimeError(f"vLLM engines {[i for i, a in enumerate(awake) if not a]} are not wholly awake "
                                   f"after wake_up({sorted(self.engines_asleep)})")
            self.engines_asleep = set()

    def after_generate(self) -> None:
        """vllm.sleep: vLLM frees its GPU memory, weights discarded (sleep level 2: the next sync resends them, as in
        OpenRLHF and veRL, instead of a copy to CPU memory and back every step), the trainers' states come back."""
        if self.sleeps:
            ray.get([engine.sleep.remote(level=2) for engine in self.engines])
            self.engines_asleep = {"weights", "kv_cache"}
            for group in self.trainers.values():
                group.call("reload_states")
