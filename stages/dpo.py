"""Stage `dpo`: direct preference optimisation of the SFT model against its frozen copy.

Losses (runtime/losses.py): `dpo` (sigmoid; with label_smoothing > 0 it is cDPO), `ipo`, `kto` (each pair
split into a desirable and an undesirable sample), `simpo` (reference-free); any of them plus an optional
NLL term on the chosen response (nll_weight).

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/dpo
Output: the trained policy as a Hugging Face directory, metrics.json (held-out implicit rewards, margins and
accuracy before and after training) and train_log.jsonl.
"""
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from runtime import data, losses, trainer
from runtime.deepspeed_strategy import DeepSpeedWorker, Rank
from runtime.logprobs import pair_batch, response_logprobs
from runtime.models import device, load_causal_lm, load_tokenizer, model_dtype

USES_RAY = True


@dataclasses.dataclass
class Config(trainer.TrainerConfig):
    loss: str
    beta: float
    label_smoothing: float
    nll_weight: float
    simpo_gamma: float
    kto_desirable_weight: float
    kto_undesirable_weight: float

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["dpo"], seed=params["seed"])


def sequence_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-prob per sequence and the response length: (N,), (N,)."""
    logp, mask = response_logprobs(model, batch)
    return logp.sum(-1), mask.sum(-1).clamp(min=1)


class DPOWorker(DeepSpeedWorker):
    def setup(self, cfg: Config, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.tokenizer = load_tokenizer(rank.model_dir)
        self.cfg = cfg
        # The reference is built before the engine: under ZeRO-3 every model built afterwards is partitioned.
        self.reference = None if cfg.loss == "simpo" else \
            load_causal_lm(rank.model_dir, model_dtype(cfg.precision), cfg.attn_implementation).to(device()).eval()
        self.build_engine(cfg, rank, load_causal_lm)

    def pair_logps(self, model, rows, mismatched: bool = False):
        """(chosen, rejected) summed log-probs and lengths; `mismatched` pairs each prompt with the next
        row's chosen response (KTO's estimate of the KL reference point)."""
        if mismatched:
            rows = [dict(r, chosen=rows[(i + 1) % len(rows)]["chosen"]) for i, r in enumerate(rows)]
        logps, lengths = sequence_logps(model, pair_batch(self.tokenizer, rows))
        n = len(rows)
        return logps[:n], logps[n:], lengths[:n], lengths[n:]

    def compute(self, rows):
        """Loss and implicit rewards (chosen, rejected) for a batch of pairs."""
        cfg = self.cfg
        pc, pr, nc, nr = self.pair_logps(self.engine, rows)
        if cfg.loss == "simpo":
            loss, chosen, rejected = losses.simpo_loss(pc / nc, pr / nr, cfg.beta, cfg.simpo_gamma)
        else:
            with torch.no_grad():
                rc, rr, _, _ = self.pair_logps(self.reference, rows)
            if cfg.loss == "dpo":
                loss, chosen, rejected = losses.dpo_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing)
            elif cfg.loss == "ipo":
                loss, chosen, rejected = losses.ipo_loss(pc / nc, pr / nr, rc / nc, rr / nr, cfg.beta)
            else:  # kto
                with torch.no_grad():
                    mc, _, _, _ = self.pair_logps(self.engine, rows, mismatched=True)
                    mrc, _, _, _ = self.pair_logps(self.reference, rows, mismatched=True)
                desirable = torch.tensor([1] * len(rows) + [0] * len(rows), device=pc.device)
                loss, rewards = losses.kto_loss(torch.cat([pc, pr]), torch.cat([rc, rr]), desirable,
                                                (mc - mrc).mean(), cfg.beta, cfg.kto_desirable_weight,
                                                cfg.kto_undesirable_weight)
                chosen, rejected = rewards[:len(rows)], rewards[len(rows):]
        if cfg.nll_weight:
            loss = loss + cfg.nll_weight * losses.sequence_nll(pc, nc)
        return loss, chosen, rejected

    def loss(self, rows):
        loss, chosen, rejected = self.compute(rows)
        return loss, {"loss": loss.detach(), "accuracy": (chosen > rejected).float().mean().detach(),
                      "margin": (chosen - rejected).mean().detach(), "chosen_reward": chosen.mean().detach(),
                      "rejected_reward": rejected.mean().detach()}

    @torch.no_grad()
    def evaluate(self, rows) -> list[tuple[float, float]]:
        if not rows:
            return []
        self.engine.eval()
        _, chosen, rejected = self.compute(rows)
        self.engine.train()
        return list(zip(chosen.tolist(), rejected.tolist()))


def held_out_metrics(group, rows: list, world_size: int) -> dict:
    return pair_metrics([p for part in trainer.evaluate_split(group, rows, world_size) for p in part])


def pair_metrics(pairs: list[tuple[float, float]]) -> dict:
    """Mean margin, accuracy and implicit rewards of (chosen, rejected) implicit-reward pairs."""
    return {"margin": statistics.fmean(c - r for c, r in pairs), "accuracy": statistics.fmean(c > r for c, r in pairs),
            "chosen_reward": statistics.fmean(c for c, _ in pairs), "rejected_reward": statistics.fmean(r for _, r in pairs)}


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    train_rows = data.read_jsonl(inputs["data"] / "pairs_train.jsonl")
    eval_rows = data.read_jsonl(inputs["data"] / "pairs_eval.jsonl")
    total_steps = trainer.steps_for(cfg, len(train_rows), "dpo")
    group = trainer.start_workers(DPOWorker, cfg, inputs["model"], total_steps, tracker)
    # Before training the policy is its reference, so every reference-based implicit reward is exactly 0.
    before = held_out_metrics(group, eval_rows, cfg.num_workers) if cfg.loss == "simpo" else pair_metrics([(0.0, 0.0)])
    log = trainer.fit(group, cfg, train_rows, "dpo", tracker)
    after = held_out_metrics(group, eval_rows, cfg.num_workers)
    group.call("save_hf", str(output), str(inputs["model"]))
    group.shutdown()
    trainer.save_log(output, log)
    summary = {"steps": len(log)} | {f"eval_{k}_before": v for k, v in before.items()} | \
              {f"eval_{k}": v for k, v in after.items()}
    (output / "metrics.json").write_text(json.dumps(summary, indent=2))
    tracker.log_metrics({k: v for k, v in summary.items() if k != "steps"}, step=len(log))
    tracker.log_artifact(output / "metrics.json")
    print(f"[dpo] {cfg.loss}: held-out margin {before['margin']:.4f} -> {after['margin']:.4f}, "
          f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}", flush=True)
