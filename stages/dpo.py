"""Stage `dpo`: direct preference optimisation of the SFT model against its frozen copy.

Losses (runtime/losses.py): `dpo` (sigmoid; with label_smoothing > 0 it is cDPO), `ipo`, `kto` (each pair
split into a desirable and an undesirable sample), `simpo` (reference-free); any of them plus an optional
NLL term on the chosen response (nll_weight).

The reference is never held while the policy trains. Its log-probs never change, so they are computed once, before
training, by the policy engine itself: before its first update the policy is its reference (the same weights from
the same directory, in the same precision; LoRA adapters start at zero), and under ZeRO-3 it is already sharded, so
the pass needs no second copy of the model, no second load and no process group of its own. `with_reference` stores
each pair's reference log-probs in its row (chosen and rejected, summed; for KTO also those of its mismatched pair),
for the training and the held-out pairs alike, and the rows carry them to whichever rank trains on or evaluates
them. KTO's mismatched pairs (its KL reference point) are fixed with the data: each prompt with the next row's
chosen response in file order.

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
from runtime.logprobs import pad_prompt_response, pair_batch, response_logprobs
from runtime.models import load_causal_lm, load_tokenizer

USES_RAY = True


@dataclasses.dataclass
class Config(trainer.TrainerConfig):
    packing: bool
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


# What a row carries of the reference (DPOWorker.reference_logps): summed log-probs of prompt+chosen, of
# prompt+rejected and, for KTO, of the prompt with its mismatched response.
REFERENCE_KEYS = ("ref_chosen_logp", "ref_rejected_logp", "ref_mismatched_logp")


def sequence_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-prob per sequence and the response length: (N,), (N,)."""
    logp, mask = response_logprobs(model, batch)
    return logp.sum(-1), mask.sum(-1).clamp(min=1)


class DPOWorker(DeepSpeedWorker):
    def setup(self, cfg: Config, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.tokenizer = load_tokenizer(rank.model_dir)
        self.cfg = cfg
        self.build_engine(cfg, rank, load_causal_lm)

    def pair_logps(self, rows):
        """The policy's (chosen, rejected) summed log-probs and response lengths."""
        logps, lengths = sequence_logps(self.engine, pair_batch(self.tokenizer, rows, self.cfg.packing))
        n = len(rows)
        return logps[:n], logps[n:], lengths[:n], lengths[n:]

    def mismatched_logps(self, rows) -> torch.Tensor:
        """The policy's summed log-probs of each prompt followed by its row's `mismatched` response (KTO)."""
        encode = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # as pair_batch encodes
        batch = pad_prompt_response([encode(r["prompt"]) for r in rows], [encode(r["mismatched"]) for r in rows],
                                    self.tokenizer.pad_token_id, self.cfg.packing)
        return sequence_logps(self.engine, batch)[0]

    @torch.no_grad()
    def reference_logps(self, rows) -> list[dict]:
        """Each row's reference log-probs (REFERENCE_KEYS of its loss), from the policy before its first update,
        which is the reference, in eval mode as the frozen copy was."""
        if self.engine.global_steps:
            raise RuntimeError("DPO's reference log-probs come from the policy before its first update; this rank has "
                               f"taken {self.engine.global_steps} optimizer steps")
        self.engine.eval()
        scored = []
        for piece in trainer.forward_pieces(rows, self.cfg):
            chosen, rejected, _, _ = self.pair_logps(piece)
            columns = [chosen, rejected] + ([self.mismatched_logps(piece)] if self.cfg.loss == "kto" else [])
            scored += [dict(zip(REFERENCE_KEYS, values)) for values in zip(*(c.tolist() for c in columns))]
        self.engine.train()
        return scored

    def compute(self, rows):
        """Loss and implicit rewards (chosen, rejected) for a batch of pairs with their reference log-probs."""
        cfg = self.cfg
        pc, pr, nc, nr = self.pair_logps(rows)
        if cfg.loss == "simpo":
            loss, chosen, rejected = losses.simpo_loss(pc / nc, pr / nr, cfg.beta, cfg.simpo_gamma)
        else:
            reference = lambda key: torch.tensor([r[key] for r in rows], dtype=pc.dtype, device=pc.device)
            rc, rr = reference("ref_chosen_logp"), reference("ref_rejected_logp")
            if cfg.loss == "dpo":
                loss, chosen, rejected = losses.dpo_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing)
            elif cfg.loss == "ipo":
                loss, chosen, rejected = losses.ipo_loss(pc / nc, pr / nr, rc / nc, rr / nr, cfg.beta)
            else:  # kto; its KL reference point: the mean policy-to-reference log-ratio of the mismatched pairs
                with torch.no_grad():
                    kl_point = (self.mismatched_logps(rows) - reference("ref_mismatched_logp")).mean()
                desirable = torch.tensor([1] * len(rows) + [0] * len(rows), device=pc.device)
                loss, rewards = losses.kto_loss(torch.cat([pc, pr]), torch.cat([rc, rr]), desirable, kl_point,
                                                cfg.beta, cfg.kto_desirable_weight, cfg.kto_undesirable_weight)
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
        """Implicit rewards (chosen, rejected) of held-out pairs with their reference log-probs."""
        self.engine.eval()
        pairs = []
        for piece in trainer.forward_pieces(rows, self.cfg):
            _, chosen, rejected = self.compute(piece)
            pairs += zip(chosen.tolist(), rejected.tolist())
        self.engine.train()
        return pairs


def with_reference(rows: list[dict], loss: str, reference_logps) -> list[dict]:
    """`rows` with what `loss` needs of the reference: for KTO each prompt's mismatched response (the next row's
    chosen, fixed here so that the reference pass and every step pair the same texts), and the reference log-probs
    `reference_logps` gives (rows -> one dict per row: trainer.per_row over the ranks, or one worker's
    `reference_logps`). SimPO is reference-free: its rows stay as they are."""
    if loss == "simpo":
        return rows
    if loss == "kto":
        rows = [dict(row, mismatched=rows[(i + 1) % len(rows)]["chosen"]) for i, row in enumerate(rows)]
    return [row | logps for row, logps in zip(rows, reference_logps(rows), strict=True)]


def held_out_metrics(group, rows: list, world_size: int) -> dict:
    return pair_metrics(trainer.per_row(group, rows, world_size, "evaluate"))


def pair_metrics(pairs: list[tuple[float, float]]) -> dict:
    """Mean margin, accuracy and implicit rewards of (chosen, rejected) implicit-reward pairs."""
    return {"margin": statistics.fmean(c - r for c, r in pairs), "accuracy": statistics.fmean(c > r for c, r in pairs),
            "chosen_reward": statistics.fmean(c for c, _ in pairs), "rejected_reward": statistics.fmean(r for _, r in pairs)}


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    train_rows = data.read_jsonl(inputs["data"] / "pairs_train.jsonl")
    eval_rows = data.read_jsonl(inputs["data"] / "pairs_eval.jsonl")
    total_steps = trainer.steps_for(cfg, len(train_rows), "dpo")
    group = trainer.start_workers(DPOWorker, cfg, inputs["model"], total_steps, tracker)
    # The reference pass, before fit: the policy has not been updated yet (fit may resume from a checkpoint later).
    reference_logps = lambda rows: trainer.per_row(group, rows, cfg.num_workers, "reference_logps")
    train_rows = with_reference(train_rows, cfg.loss, reference_logps)
    eval_rows = with_reference(eval_rows, cfg.loss, reference_logps)
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
