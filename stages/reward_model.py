"""Stage `reward_model`: a scalar head on the SFT model trained on preference pairs (Bradley-Terry).

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/reward_model
Output: a Hugging Face sequence-classification directory (one label), metrics.json with held-out pairwise
accuracy and the mean/std of its rewards (RL normalises rewards with them), and train_log.jsonl.
With `reward_model.from: <dir>` (a sequence-classification model with the policy's tokenizer) nothing is trained: the
given model is evaluated on the held-out pairs and becomes the output.
"""
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from runtime import data, losses, trainer
from runtime.deepspeed_strategy import DeepSpeedWorker, Rank
from runtime.logprobs import on_device, pair_batch
from runtime.models import link_given_model, load_reward_model, load_tokenizer

USES_RAY = True
LOSSES = {"sigmoid": losses.pairwise_sigmoid_loss, "logexp": losses.pairwise_logexp_loss}


@dataclasses.dataclass
class Config(trainer.TrainerConfig):
    loss: str
    use_margin: bool
    head_learning_rate: float | None
    given: str | None  # the config's `from`: a reward model to use instead of training one

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        keys = dict(params["reward_model"])
        given = keys.pop("from")
        return cls(**keys, given=given, seed=params["seed"])


def score_pairs(model, tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of prompt+chosen and prompt+rejected, one forward pass over both: (B,), (B,), in float32 (a bf16 score
    would round the small margins the loss depends on)."""
    batch = on_device(pair_batch(tokenizer, rows), model)
    rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    use_cache=False).logits.squeeze(-1).float()
    return rewards[:len(rows)], rewards[len(rows):]


class RewardWorker(DeepSpeedWorker):
    TRAINS_HEAD = True
    def setup(self, cfg: Config, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.tokenizer = load_tokenizer(rank.model_dir)
        self.cfg = cfg
        self.build_engine(cfg, rank, load_reward_model)

    def param_groups(self, model, learning_rate):
        # The score head starts from random weights while the backbone is already trained: with one small
        # learning rate the head barely moves in a short run (the demo's reward model stayed at chance).
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # LoRA freezes most
        head = [p for name, p in trained if name.startswith("score.")]
        body = [p for name, p in trained if not name.startswith("score.")]
        return [{"params": body, "lr": learning_rate},
                {"params": head, "lr": self.cfg.head_learning_rate or learning_rate}]

    def loss(self, rows):
        chosen, rejected = score_pairs(self.engine, self.tokenizer, rows)
        margin = torch.tensor([float(r.get("margin", 0.0)) for r in rows], device=chosen.device) \
            if self.cfg.use_margin else None
        loss = LOSSES[self.cfg.loss](chosen, rejected, margin)
        return loss, {"loss": loss.detach(), "accuracy": (chosen > rejected).float().mean().detach(),
                      "reward_margin": (chosen - rejected).mean().detach()}

    @torch.no_grad()
    def evaluate(self, rows) -> list[tuple[float, float]]:
        """Each pair's (chosen, rejected) rewards, forward_micro_batch_size pairs a forward (trainer.forward_pieces)."""
        self.engine.eval()
        pairs = []
        for piece in trainer.forward_pieces(rows, self.cfg):
            chosen, rejected = score_pairs(self.engine, self.tokenizer, piece)
            pairs += zip(chosen.tolist(), rejected.tolist())
        self.engine.train()
        return pairs


def held_out_metrics(group, rows: list, world_size: int) -> dict:
    """Pairwise accuracy and the rewards' mean and std over the held-out pairs (trainer.per_row: as many forwards on
    every rank)."""
    pairs = trainer.per_row(group, rows, world_size, "evaluate")
    rewards = [r for pair in pairs for r in pair]
    return {"accuracy": statistics.fmean(c > r for c, r in pairs), "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards), "pairs": len(pairs)}


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    train_rows = data.read_jsonl(inputs["data"] / "pairs_train.jsonl")
    eval_rows = data.read_jsonl(inputs["data"] / "pairs_eval.jsonl")
    if cfg.given:
        # Rollouts reach the reward model as the policy's token ids: the two must share one tokenizer.
        if load_tokenizer(inputs["given"]).get_vocab() != load_tokenizer(inputs["model"]).get_vocab():
            raise ValueError(f"reward_model.from = {inputs['given']}: its tokenizer differs from the policy's "
                             f"({inputs['model']}); a given reward model must use the same one")
        link_given_model(inputs["given"], inputs["model"], output)
        tracker.set_tags({"alignpipe.given_model": str(inputs["given"])})
    total_steps = 0 if cfg.given else trainer.steps_for(cfg, len(train_rows), "reward_model")
    group = trainer.start_workers(RewardWorker, cfg, output if cfg.given else inputs["model"], total_steps, tracker)
    before = held_out_metrics(group, eval_rows, cfg.num_workers)
    log = [] if cfg.given else trainer.fit(group, cfg, train_rows, "reward_model", tracker)
    after = held_out_metrics(group, eval_rows, cfg.num_workers)
    if not cfg.given:
        group.call("save_hf", str(output), str(inputs["model"]))
    group.shutdown()
    trainer.save_log(output, log)
    summary = {"steps": len(log), "given": cfg.given and str(inputs["given"]), "eval_accuracy_before": before["accuracy"],
               "eval_accuracy": after["accuracy"], "reward_mean": after["reward_mean"], "reward_std": after["reward_std"], "eval_pairs": after["pairs"]}
    (output / "metrics.json").write_text(json.dumps(summary, indent=2))
    tracker.log_metrics({k: v for k, v in summary.items() if k not in ("steps", "given")}, step=len(log))
    tracker.log_artifact(output / "metrics.json")
    print(f"[reward_model] held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, "
          f"reward mean {after['reward_mean']:.3f} std {after['reward_std']:.3f}", flush=True)
