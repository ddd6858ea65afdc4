"""The driver side of every DeepSpeed training stage (SFT, reward model, DPO).

`fit` places one DeepSpeed rank per Ray actor, feeds each optimizer step's global batch to the ranks as
micro-batches, logs per-step metrics to MLflow with a progress line, and exports the model at the end.
The per-stage part is the worker class (its `loss`) and the evaluation function.
"""
import dataclasses
import json
import os
import random
import shutil
import statistics
from pathlib import Path

import ray

from stages import data
from stages.actor_group import ActorGroup
from stages.progress import Progress


@dataclasses.dataclass
class TrainerConfig:
    """Keys every training stage has (the schema's `trainer` block)."""
    zero_stage: int
    num_workers: int
    epochs: int
    batch_size: int
    micro_batch_size: int
    learning_rate: float
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float
    checkpoint_every: int
    lora_rank: int
    lora_alpha: float
    lora_targets: list[str]
    seed: int


def shard(rows: list, world_size: int, micro_batch_size: int) -> list[list[list]]:
    """Split a global batch into each rank's list of micro-batches (rank-major, contiguous)."""
    per_rank = len(rows) // world_size
    return [[rows[r * per_rank + i: r * per_rank + i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
            for r in range(world_size)]


def start_workers(worker_cls, cfg: TrainerConfig, model_dir: Path, total_steps: int, extra: dict | None = None,
                  cpus_per_actor: float = 1):
    """An ActorGroup of `worker_cls` ranks, each with its DeepSpeed engine built."""
    grad_accum = cfg.batch_size // (cfg.micro_batch_size * cfg.num_workers)
    threads = max(1, int(ray.cluster_resources().get("CPU", 1)) // cfg.num_workers)
    group = ActorGroup(worker_cls, cfg.num_workers, cpus_per_actor=cpus_per_actor)
    engine = dict(model_dir=str(model_dir), zero_stage=cfg.zero_stage, micro_batch_size=cfg.micro_batch_size,
                  grad_accum=grad_accum, learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
                  warmup_steps=cfg.warmup_steps, total_steps=total_steps, max_grad_norm=cfg.max_grad_norm,
                  seed=cfg.seed, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_targets=cfg.lora_targets)
    group.call_per_rank("setup", [{"rank": r, "rendezvous": group.rendezvous, "num_threads": threads,
                                   "model_dir": str(model_dir), "engine": engine, **(extra or {})}
                                  for r in range(cfg.num_workers)])
    print(f"[{worker_cls.__name__}] {cfg.num_workers} ZeRO-{cfg.zero_stage} ranks x {threads} threads, "
          f"{total_steps} steps of {cfg.batch_size}", flush=True)
    return group


def fit(group, cfg: TrainerConfig, rows: list, name: str, run) -> list[dict]:
    """Train for cfg.epochs over `rows` (shuffled per epoch by cfg.seed); returns the per-step log.

    Every cfg.checkpoint_every steps all ranks save a checkpoint into run.checkpoint_dir (when the launcher
    provides one), and a later start resumes from the latest: the data order is replayed from the seed, so
    the resumed run sees exactly the batches the uninterrupted run would have, none twice."""
    steps_per_epoch = len(rows) // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    ckpt_dir = getattr(run, "checkpoint_dir", None) if cfg.checkpoint_every else None
    log, step = resume(group, ckpt_dir, name, run)
    progress = Progress(name, total)
    rng = random.Random(cfg.seed)
    for epoch in range(cfg.epochs):
        order = rows[:]
        rng.shuffle(order)  # replayed for finished epochs too, so the RNG stream matches an uninterrupted run
        for index in range(steps_per_epoch):
            if epoch * steps_per_epoch + index < step:
                continue
            step += 1
            batch = order[index * cfg.batch_size:(index + 1) * cfg.batch_size]
            per_rank = group.call_per_rank("train_step", shard(batch, cfg.num_workers, cfg.micro_batch_size))
            metrics = {key: statistics.fmean(r[key] for r in per_rank) for key in per_rank[0]} | {"epoch": epoch}
            run.log_metrics(metrics, step=step)
            log.append({"step": step, **metrics, "rows": [r.get("id", i) for i, r in enumerate(batch)]})
            progress.update(step, **{k: v for k, v in metrics.items() if k not in ("epoch", "tokens")})
            if ckpt_dir and step % cfg.checkpoint_every == 0 and step < total:
                save_checkpoint(group, ckpt_dir, step, log)
    return log


def save_checkpoint(group, ckpt_dir: Path, step: int, log: list[dict]) -> None:
    tag = f"step{step}"
    group.call("save_checkpoint", str(ckpt_dir), tag)
    (ckpt_dir / tag / "train_log.json").write_text(json.dumps(log))
    latest = ckpt_dir / "latest.json"
    (ckpt_dir / "latest.json.tmp").write_text(json.dumps({"step": step, "tag": tag}))
    os.replace(ckpt_dir / "latest.json.tmp", latest)  # the checkpoint counts only once this rename happened
    for old in ckpt_dir.glob("step*"):
        if old.name != tag:
            shutil.rmtree(old, ignore_errors=True)
    print(f"[checkpoint] step {step} -> {ckpt_dir / tag}", flush=True)


def resume(group, ckpt_dir: Path | None, name: str, run) -> tuple[list[dict], int]:
    """(log so far, step) from the latest checkpoint in ckpt_dir, or ([], 0)."""
    if ckpt_dir is None or not (ckpt_dir / "latest.json").exists():
        return [], 0
    latest = json.loads((ckpt_dir / "latest.json").read_text())
    group.call("load_checkpoint", str(ckpt_dir), latest["tag"])
    log = json.loads((ckpt_dir / latest["tag"] / "train_log.json").read_text())
    print(f"[{name}] resumed from checkpoint at step {latest['step']}", flush=True)
    run.log_metrics({"resumed_from_step": latest["step"]}, step=latest["step"])
    return log, latest["step"]


def steps_for(cfg: TrainerConfig, num_rows: int, what: str) -> int:
    steps_per_epoch = num_rows // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{what}.batch_size = {cfg.batch_size} is larger than the {num_rows} training rows")
    return steps_per_epoch * cfg.epochs


def evaluate_split(group, rows: list, world_size: int, method: str = "evaluate") -> list:
    """Call `method` on every rank with an interleaved share of `rows`; per-rank results in rank order."""
    return group.call_per_rank(method, [rows[r::world_size] for r in range(world_size)])


def save_log(output: Path, log: list[dict]) -> None:
    data.write_jsonl(output / "train_log.jsonl", log)
