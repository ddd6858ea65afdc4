"""RL experience: the rollout record, and making it (sample with vLLM, then score, log-probs, values, KL and
advantages) for one step of the rl stage.

`roles` is the stage's `rl_actors.Roles`, left untyped here: rl_actors imports this module, not the reverse."""
from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.nn.functional as F

from runtime import losses
from runtime.advantages import compute_advantages
from runtime.environments import summarise
from runtime.logprobs import pad_prompt_response
from runtime.rewards import call_reward_fn
from runtime.rollout import generate_on


def pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    """Per-row value lists, zero-padded on the right to `width`: (B, width) float32."""
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)


@dataclasses.dataclass(slots=True)
class Rollout:
    """One step's samples, one row per response; the n_samples responses to a prompt are contiguous rows.

    Every tensor is (B, T) float32, T the step's longest response, response-aligned: row i's value for its
    response token t at [i, t] for t < len(response_ids[i]), 0 after. `mask` is 1 on the tokens the policy sampled
    and trains on: all of a single-turn response, the replies of an episode (not the environment's messages, which
    sit between them). The fields after rollout_logp stay None until make_experience fills them."""
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    mask: torch.Tensor
    prompts: list[str] | None = None  # text and labels, for a reward_fn
    completions: list[str] | None = None
    labels: list | None = None
    truncated: list[bool] | None = None  # cut at max_new_tokens before the end of turn (an episode: by its budget)
    episodes: list[dict] | None = None  # an episode's stats per row (runtime/environments.Episode.stats)
    env_rewards: torch.Tensor | None = None  # an episode's step rewards, each at its reply's last token
    keep: torch.Tensor | None = None  # (B,) 1 for a row the policy loss counts, 0 for one it leaves out (overlong mask)
    rollout_logp: torch.Tensor | None = None  # vLLM's log-probs of the sampled tokens
    ref_logp: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None  # the policy's before this step's training; None when trains_once
    old_values: torch.Tensor | None = None  # the critic's (gae only)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # the critic's targets

    @classmethod
    def of(cls, prompt_ids: list[list[int]], response_ids: list[list[int]], *, prompts=None, completions=None,
           labels=None, truncated=None, episodes=None, masks: list[list[float]] | None = None,
           **per_token: list[list[float]]) -> Rollout:
        """A record from token lists, with any per-token fields (e.g. rollout_logp) given as per-row lists; `masks`:
        the rows' loss masks (default: 1 on every response token)."""
        width = max(map(len, response_ids))
        mask = pad_rows(masks or [[1.0] * len(r) for r in response_ids], width)
        return cls(prompt_ids, response_ids, mask, prompts, completions, labels, truncated, episodes,
                   **{key: pad_rows(rows, width) for key, rows in per_token.items()})

    @classmethod
    def join(cls, parts: list[Rollout]) -> Rollout:
        """The rows of several records, in order, as one (per-token tensors padded to the widest)."""
        width = max(part.mask.shape[1] for part in parts)

        def joined(values):
            if values[0] is None:
                return None
            if isinstance(values[0], torch.Tensor):
                return torch.cat([F.pad(v, (0, width - v.shape[1])) if v.dim() == 2 else v for v in values])
            return [x for value in values for x in value]
        return cls(*(joined([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    def __len__(self) -> int:
        return len(self.response_ids)

    def state(self) -> dict:
        """The rows as JSON: each field, a tensor as its values and dtype."""
        value = lambda v: {"values": v.tolist(), "dtype": str(v.dtype).removeprefix("torch.")} \
            if isinstance(v, torch.Tensor) else v
        return {f.name: value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> Rollout:
        value = lambda v: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])) \
            if isinstance(v, dict) and "dtype" in v else v
        return cls(**{name: value(v) for name, v in state.items()})

    def __getitem__(self, index: slice | list[int]) -> Rollout:
        """The rows at `index`, a slice or a list of row numbers (in that order); T stays the same."""
        def take(value):
            if value is None:
                return None
            if isinstance(value, torch.Tensor) or isinstance(index, slice):
                return value[index]
            return [value[i] for i in index]
        return Rollout(*(take(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def tokens(self, pad_id: int, packed: bool = False) -> dict:
        """The prompt+response batch a model forward takes (logprobs.pad_prompt_response: right-padded, and `packed`
        into one row too)."""
        masks = [self.mask[i, :len(r)].tolist() for i, r in enumerate(self.response_ids)]
        return pad_prompt_response(self.prompt_ids, self.response_ids, pad_id, packed, masks)

    def to_batch(self, values: torch.Tensor, batch_mask: torch.Tensor) -> torch.Tensor:
        """Response-aligned (B, T) values laid into the response positions (batch_mask 1) of a model batch (B, K), on
        the batch's device. (Gathers, not boolean indexing: no shape depends on the data, so it runs on any device.)"""
        first = batch_mask.argmax(dim=1, keepdim=True)  # each row's first response position in the batch
        positions = torch.arange(batch_mask.shape[1], device=batch_mask.device).unsqueeze(0)
        index = (positions - first).clamp(0, values.shape[1] - 1)
        laid = values.to(batch_mask.device, torch.float32).gather(1, index)
        return torch.where(batch_mask.bool(), laid, 0.0)

    def from_batch(self, values: torch.Tensor, batch_mask: torch.Tensor) -> torch.Tensor:
        """A model batch's per-token values (B, K) at its response positions, response-aligned (B, T), on the CPU."""
        first = batch_mask.argmax(dim=1, keepdim=True)
        steps = torch.arange(self.mask.shape[1], device=values.device).unsqueeze(0)
        index = (first + steps).clamp(max=values.shape[1] - 1)
        aligned = torch.where(self.mask.to(values.device).bool(), values.gather(1, index).float(), 0.0)
        return aligned.to(self.mask.device)

    def lengths(self) -> torch.Tensor:
        """(B,) each row's response length in tokens (an episode's: its replies and the environment's messages)."""
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.float32)

    def last_trained(self) -> torch.Tensor:
        """(B,) each row's last position with mask 1: the last token the policy produced, where the reward sits."""
        positions = torch.arange(self.mask.shape[1]).expand_as(self.mask)
        return torch.where(self.mask.bool(), positions, 0).max(-1).values

    def micro_batches(self, size: int | None) -> list[Rollout]:
        """The rows in consecutive pieces of at most `size` (None: all at once), for forwards where nothing trains."""
        size = size or max(1, len(self))
        return [self[i:i + size] for i in range(0, len(self), size)]


def generate(roles, prompts: list[dict], n: int, cfg, seed: int, temperature: float,
             ignore_eos: bool = False) -> Rollout:
    """n samples per prompt from the vLLM engines; `ignore_eos`: every response max_new_tokens long (benchmarks)."""
    roles.before_generate()
    outputs = generate_on(roles.engines, [p["prompt_ids"] for p in prompts], n, temperature, cfg.top_p,
                          cfg.max_new_tokens, seed, ignore_eos)
    roles.after_generate()
    samples = [(prompt, s) for prompt, out in zip(prompts, outputs) for s in out]
    responses = [s["token_ids"] or [0] for _, s in samples]  # an empty response still needs one position to score
    return Rollout.of([p["prompt_ids"] for p, _ in samples], responses, prompts=[p["prompt"] for p, _ in samples],
                      completions=[s["text"] for _, s in samples], labels=[p.get("label") for p, _ in samples],
                      truncated=[s["truncated"] for _, s in samples], rollout_logp=[(s["logprobs"] or [0.0])[:len(r)] for (_, s), r in zip(samples, responses)])


def run_episodes(roles, prompts: list[dict], n: int, cfg, seed: int, temperature: float) -> Rollout:
    """n multi-turn episodes per prompt against the stage's environment (runtime/environments.py), each turn of
    every live episode generated at once on the vLLM engines."""
    def sample(contexts, seeds, max_tokens):
        return [out[0] for out in generate_on(roles.engines, contexts, 1, temperature, cfg.top_p, max_tokens, seed,
                                              seeds=seeds)]
    roles.before_generate()
    done = roles.episodes.run(sample, prompts, n, seed, cfg.max_new_tokens)
    roles.after_generate()
    rows = [(prompt, episode, stats) for prompt, (episode, stats) in zip([p for p in prompts for _ in range(n)], done)]
    # An episode that never got to reply (its reset failed) keeps one untrained position.
    responses = [e.ids or roles.episodes.format.eot_ids[:1] for _, e, _ in rows]
    pad = lambda values, e: values if e.ids else [0.0]
    return Rollout.of([e.prompt_ids for _, e, _ in rows], responses, prompts=[p["prompt"] for p, _, _ in rows],
                      completions=[e.replies[-1] if e.replies else "" for _, e, _ in rows],
                      labels=[p.get("label") for p, _, _ in rows], truncated=[e.truncated for _, e, _ in rows],
                      episodes=[stats for _, _, stats in rows], masks=[pad(e.mask, e) for _, e, _ in rows],
                      rollout_logp=[pad(e.logprobs, e) for _, e, _ in rows],
                      env_rewards=[pad(e.rewards, e) for _, e, _ in rows])


def roll(roles, prompts: list[dict], n: int, cfg, seed: int, temperature: float) -> Rollout:
    """The rollout of `prompts`: single replies, or episodes where the stage has an environment."""
    if roles.episodes is not None:
        return run_episodes(roles, prompts, n, cfg, seed, temperature)
    return generate(roles, prompts, n, cfg, seed, temperature)


def episode_metrics(rollout: Rollout) -> dict:
    """The step's episode metrics (episode_turns, episode_success, ...): means over its episodes."""
    return {f"episode_{key}": value for key, value in summarise(rollout.episodes).items() if key != "reward"}


def informative_groups(scores: list[float], n_samples: int) -> list[int]:
    """DAPO's dynamic sampling (Yu et al. 2025, eq. 11): the prompts (groups of n_samples rows) whose responses did not
    all score the same. A group of equal scores has zero advantage under every group estimator: it teaches nothing."""
    return [g for g in range(len(scores) // n_samples) if len(set(scores[g * n_samples:(g + 1) * n_samples])) > 1]


def score(roles, rollout: Rollout) -> list[float]:
    """Each row's reward: the reward model's or reward file's score (of an episode's last reply), plus the sum of an
    episode's step rewards."""
    scores = [0.0] * len(rollout)
    if roles.reward_model is not None:
        scores = [s for part in split_call(roles.reward_model, "scores", rollout) for s in part]
    elif roles.reward_fn is not None:
        scores = call_reward_fn(roles.reward_fn, roles.reward_file, rollout.prompts, rollout.completions,
                                rollout.labels)
    if rollout.env_rewards is not None:
        scores = [s + e for s, e in zip(scores, rollout.env_rewards.sum(-1).tolist())]
    return scores


def teacher_log_ratio(roles, rollout: Rollout, policy_logp: torch.Tensor) -> torch.Tensor:
    """(B, T) log pi_teacher(y_t) - log pi_policy(y_t) at each sampled token, 0 off the mask: on-policy distillation's
    per-token reward, the negative of the reverse KL's per-token estimate (GKD, Agarwal et al. 2024, with the
    student's samples; Thinking Machines' "On-Policy Distillation", 2025). The teacher's log-probs are taken at the
    sampling temperature, as the policy's."""
    teacher = torch.cat(split_call(roles.teacher, "logprobs", rollout))
    return (teacher - policy_logp) * rollout.mask


def trains_once(cfg) -> bool:
    """Is each rollout trained on in one optimizer step, by the weights that sampled it? Then the policy's old
    log-probs are the training forward's own, detached (as in TRL's GRPO with num_iterations=1), and need no pass
    of their own. (The KL in the reward is computed before training, so it still needs them.)"""
    return cfg.ppo_epochs == 1 and cfg.batch_size == cfg.rollout_batch_size * cfg.n_samples and not cfg.kl_in_reward


def shares(rollout: Rollout, ranks: int) -> list[Rollout]:
    """Contiguous shares of the rows, one per rank, all of one size. Under ZeRO-3 every forward gathers each layer's
    weights from all ranks, so every rank must run as many forwards as the others: a rank with fewer rows (fewer
    forward_micro_batch_size pieces, or none) would leave the rest waiting in a gather forever. A short share is
    filled up with copies of the last row, whose results `split_call` drops."""
    size = -(-len(rollout) // ranks)
    return [rollout[[min(i, len(rollout) - 1) for i in range(r * size, (r + 1) * size)]] for r in range(ranks)]


def split_call(group, method: str, rollout: Rollout) -> list:
    """Call `method` on the ranks of `group` with equal shares of the rows (`shares`); each rank's results for its
    own rows (filler rows dropped), in rank order, so in row order once joined."""
    size = -(-len(rollout) // len(group.actors))
    per_rank = group.call_per_rank(method, shares(rollout, len(group.actors)))
    return [result[:max(0, min(size, len(rollout) - r * size))] for r, result in enumerate(per_rank)]


def place_rewards(rollout: Rollout, scores: torch.Tensor, turn_rewards: bool) -> torch.Tensor:
    """(B, T) per-token rewards: each row's score (B,) at its last trained token; with `turn_rewards`, an episode's
    step rewards at their own replies' last tokens and the rest of its score (a final reward, a penalty) at the last."""
    rewards = torch.zeros_like(rollout.mask)
    if turn_rewards and rollout.env_rewards is not None:
        rewards = rollout.env_rewards.clone()
        scores = scores - rollout.env_rewards.sum(-1)
    rewards[torch.arange(len(rollout)), rollout.last_trained()] += scores
    return rewards


def make_experience(roles, cfg, rollout: Rollout, kl_coef: float, reward_stats: dict,
                    raw: list[float] | None = None) -> dict:
    """Fill the rollout's log-probs, values, advantages and returns; the step's experience metrics. `raw`: the rows'
    scores where the caller has them (dynamic sampling scores before it chooses the rows)."""
    raw = score(roles, rollout) if raw is None else raw
    scores = torch.tensor(raw)
    metrics = {}
    if cfg.overlong == "penalty":  # DAPO's soft overlong punishment, added to the task's reward
        limit = cfg.environment["max_episode_tokens"] if rollout.episodes else cfg.max_new_tokens
        penalty = losses.overlong_penalty(rollout.lengths(), limit, cfg.overlong_buffer)
        scores = scores + penalty
        metrics["overlong_penalty"] = penalty.mean().item()
    elif cfg.overlong == "mask":  # DAPO's overlong filtering: a cut response says nothing about its reward
        rollout.keep = torch.tensor([0.0 if cut else 1.0 for cut in rollout.truncated])
        metrics["overlong_masked"] = 1 - rollout.keep.mean().item()
    if cfg.normalize_reward:
        scores = (scores - reward_stats["mean"]) / max(reward_stats["std"], 1e-6)
    if cfg.reward_clip:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    if cfg.kl_coef:  # without a KL penalty (DAPO's recipe) the reference's log-probs would go unused: not computed
        rollout.ref_logp = torch.cat(split_call(roles.reference, "logprobs", rollout))
    once = trains_once(cfg)
    if not once:
        rollout.old_logp = torch.cat(split_call(roles.policy, "logprobs", rollout))
    sampled = rollout.rollout_logp if once else rollout.old_logp  # vLLM's log-probs come from the same weights
    mask = rollout.mask
    token_rewards = place_rewards(rollout, scores, bool(cfg.environment and cfg.environment["turn_rewards"]))
    if cfg.kl_coef:
        kl = losses.kl_estimate(sampled, rollout.ref_logp, cfg.kl_estimator) * mask
        metrics["kl"] = kl.sum(-1).mean().item()
        if cfg.kl_in_reward:
            token_rewards = token_rewards - kl_coef * kl
    if roles.teacher is not None:  # a dense reward: the teacher's log-ratio at every sampled token
        log_ratio = teacher_log_ratio(roles, rollout, sampled)
        token_rewards = token_rewards + cfg.teacher_coef * log_ratio
        metrics["teacher_kl"] = -log_ratio.sum(-1).mean().item()
    if roles.critic is not None:
        rollout.old_values = torch.cat(split_call(roles.critic, "values", rollout))
    advantages, returns = compute_advantages(cfg.estimator, token_rewards, mask, cfg.n_samples, rollout.old_values,
                                             cfg.gamma, cfg.lam)
    padding = ~mask.bool()
    rollout.advantages = advantages.float().masked_fill(padding, 0.0)
    rollout.returns = returns.float().masked_fill(padding, 0.0)
    lengths = rollout.lengths()
    metrics |= {"reward_mean": statistics.fmean(raw), "truncated": statistics.fmean(map(float, rollout.truncated))
                if rollout.truncated else 0.0, "reward_std": statistics.pstdev(raw),
               "response_length": lengths.mean().item(),
               "advantage_mean": losses.masked_mean(advantages, mask).item(),
               "advantage_std": advantages[mask.bool()].std().item() if mask.sum() > 1 else 0.0}
    if rollout.episodes:
        metrics |= episode_metrics(rollout)
    if not once:  # how far vLLM's sampling log-probs are from the trainer's: near 0 when the weight sync works
        metrics["vllm_logprob_gap"] = losses.masked_mean((rollout.old_logp - rollout.rollout_logp).abs(), mask).item()
    return metrics
