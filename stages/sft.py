"""Stage `sft`: supervised fine-tuning with DeepSpeed ZeRO on Ray actors; loss on response tokens only.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/sft
Output: a Hugging Face `save_pretrained` directory, plus train_log.jsonl (per-step metrics) and metrics.json.
"""
import dataclasses
import json
import random
import statistics
from pathlib import Path

import ray
import torch

from stages import data
from stages.actor_group import ActorGroup
from stages.deepspeed_strategy import DeepSpeedWorker
from stages.models import load_causal_lm, load_tokenizer, pad_prompt_response, response_logprobs
from stages.progress import Progress

USES_RAY = True


@dataclasses.dataclass
class Config:
    zero_stage: int
    num_workers: int
    epochs: int
    batch_size: int
    micro_batch_size: int
    learning_rate: float
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float
    seed: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["sft"], seed=params["seed"])


def tokenize_sft(tokenizer, rows: list[dict]) -> dict:
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return pad_prompt_response([encode(r["prompt"]) for r in rows], [encode(r["response"]) for r in rows],
                               tokenizer.pad_token_id)


def response_nll(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of the response tokens, and their count."""
    logp, mask = response_logprobs(model, batch)
    return -logp.sum(), mask.sum()


class SFTWorker(DeepSpeedWorker):
    def setup(self, args: dict) -> None:
        self.init_distributed(args["rank"], args["rendezvous"], args["num_threads"])
        self.tokenizer = load_tokenizer(args["model_dir"])
        self.build_engine(model_loader=load_causal_lm, **args["engine"])

    def loss(self, rows):
        nll, tokens = response_nll(self.engine, tokenize_sft(self.tokenizer, rows))
        loss = nll / tokens.clamp(min=1)
        return loss, {"loss": loss.item(), "tokens": tokens.item()}

    @torch.no_grad()
    def eval_nll(self, rows) -> tuple[float, float]:
        self.engine.eval()
        nll, tokens = response_nll(self.engine, tokenize_sft(self.tokenizer, rows))
        self.engine.train()
        return nll.item(), tokens.item()


def shard(rows: list, world_size: int, micro_batch_size: int) -> list[list[list]]:
    """Split a global batch into each rank's list of micro-batches (rank-major, contiguous)."""
    per_rank = len(rows) // world_size
    return [[rows[r * per_rank + i: r * per_rank + i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
            for r in range(world_size)]


def evaluate_nll(group: ActorGroup, rows: list, world_size: int) -> float:
    parts = [rows[r::world_size] for r in range(world_size)]
    results = group.call_per_rank("eval_nll", parts)
    return sum(n for n, _ in results) / max(1.0, sum(t for _, t in results))


def run(cfg: Config, inputs: dict, output: Path, run) -> None:
    train_rows = data.read_jsonl(inputs["data"] / "sft_train.jsonl")
    eval_rows = data.read_jsonl(inputs["data"] / "sft_eval.jsonl")
    steps_per_epoch = len(train_rows) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"sft.batch_size = {cfg.batch_size} is larger than the {len(train_rows)} training rows")
    total_steps = steps_per_epoch * cfg.epochs
    grad_accum = cfg.batch_size // (cfg.micro_batch_size * cfg.num_workers)
    threads = max(1, int(ray.available_resources().get("CPU", 1)) // cfg.num_workers)

    group = ActorGroup(SFTWorker, cfg.num_workers, cpus_per_actor=1)
    engine_args = dict(model_dir=str(inputs["model"]), zero_stage=cfg.zero_stage, micro_batch_size=cfg.micro_batch_size,
                       grad_accum=grad_accum, learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
                       warmup_steps=cfg.warmup_steps, total_steps=total_steps, max_grad_norm=cfg.max_grad_norm,
                       seed=cfg.seed)
    group.call_per_rank("setup", [{"rank": r, "rendezvous": group.rendezvous, "num_threads": threads,
                                   "model_dir": str(inputs["model"]), "engine": engine_args}
                                  for r in range(cfg.num_workers)])
    print(f"[sft] {len(train_rows)} rows, {total_steps} steps of {cfg.batch_size} on {cfg.num_workers} "
          f"ZeRO-{cfg.zero_stage} ranks ({threads} threads each)", flush=True)
    eval_before = evaluate_nll(group, eval_rows, cfg.num_workers)
    run.log_metrics({"eval_loss": eval_before}, step=0)

    rng = random.Random(cfg.seed)
    progress = Progress("sft", total_steps)
    log = []
    step = 0
    for epoch in range(cfg.epochs):
        order = train_rows[:]
        rng.shuffle(order)
        for start in range(0, steps_per_epoch * cfg.batch_size, cfg.batch_size):
            step += 1
            per_rank = group.call_per_rank("train_step", shard(order[start:start + cfg.batch_size],
                                                                cfg.num_workers, cfg.micro_batch_size))
            metrics = {"train_loss": statistics.fmean(r["loss"] for r in per_rank), "lr": per_rank[0]["lr"],
                       "epoch": epoch}
            run.log_metrics(metrics, step=step)
            log.append({"step": step, **metrics})
            progress.update(step, loss=metrics["train_loss"], lr=metrics["lr"])

    eval_after = evaluate_nll(group, eval_rows, cfg.num_workers)
    run.log_metrics({"eval_loss": eval_after}, step=step)
    group.call("save_hf", str(output), str(inputs["model"]))
    group.shutdown()
    data.write_jsonl(output / "train_log.jsonl", log)
    summary = {"steps": step, "final_train_loss": log[-1]["train_loss"], "eval_loss_before": eval_before,
               "eval_loss_after": eval_after}
    (output / "metrics.json").write_text(json.dumps(summary, indent=2))
    run.log_artifact(output / "metrics.json")
    print(f"[sft] eval loss {eval_before:.4f} -> {eval_after:.4f}; model -> {output}", flush=True)
