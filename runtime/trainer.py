"""The driver side of every DeepSpeed training stage (SFT, reward model, DPO).

`fit` places one DeepSpeed rank per Ray actor, feeds each optimizer step's global batch to the ranks as
micro-batches, logs per-step metrics to MLflow with a progress line, and exports the model at the end.
The per-stage part is the worker class (its `loss`) and the evaluation function.
"""
import dataclasses
import random
import statistics
from pathlib import Path

import ray

from runtime import checkpoints, data
from runtime.actor_group import ActorGroup, cluster_gpus
from runtime.deepspeed_strategy import Rank
from runtime.progress import Progress


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
    keep_checkpoints: int
    lora_rank: int
    lora_alpha: float
    lora_targets: list[str] | str | None  # names, "all-linear", or None: the architecture's default
    precision: str  # auto, bf16 or fp32 (runtime/models.resolved_precision: auto is bf16 on GPUs and native-bf16 CPUs)
    gradient_checkpointing: bool
    attn_implementation: str
    offload_optimizer: bool
    forward_micro_batch_size: int | None  # rows per forward where nothing trains; None: a whole batch
    seed: int


def shard(rows: list, world_size: int, micro_batch_size: int) -> list[list[list]]:
    """Split a global batch into each rank's list of micro-batches (rank-major, contiguous)."""
    per_rank = len(rows) // world_size
    return [[rows[r * per_rank + i: r * per_rank + i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
            for r in range(world_size)]


def start_workers(worker_cls, cfg: TrainerConfig, model_dir: Path, total_steps: int, tracker,
                  cpus_per_actor: float = 1, gpus_per_actor: float | None = None, shared=None,
                  threads: int | None = None) -> ActorGroup:
    """An ActorGroup of `worker_cls` ranks, each set up with the stage's Config `cfg` and its DeepSpeed engine
    built; where they run goes to `tracker`. Each rank gets one GPU where the cluster has GPUs (`gpus_per_actor`
    None), or the share given (roles colocated in `shared`), and `threads` torch threads (None: the cluster's
    CPUs over the ranks)."""
    threads = threads or max(1, int(ray.cluster_resources().get("CPU", 1)) // cfg.num_workers)
    if gpus_per_actor is None:
        gpus_per_actor = 1 if cluster_gpus() else 0
    group = ActorGroup(worker_cls, cfg.num_workers, cpus_per_actor=cpus_per_actor, gpus_per_actor=gpus_per_actor,
                       shared=shared)
    tracker.record_placements(group.placements)
    ray.get([actor.setup.remote(cfg, Rank(r, group.rendezvous, threads, str(model_dir), total_steps))
             for r, actor in enumerate(group.actors)])
    print(f"[{worker_cls.__name__}] {cfg.num_workers} ZeRO-{cfg.zero_stage} ranks x {threads} threads, "
          f"{total_steps} steps of {cfg.batch_size}", flush=True)
    return group


def fit(group, cfg: TrainerConfig, rows: list, name: str, tracker) -> list[dict]:
    """Train for cfg.epochs over `rows` (shuffled per epoch by cfg.seed); returns the per-step log.

    Every cfg.checkpoint_every steps all ranks save a checkpoint into tracker.checkpoint_dir (when the job
    provides one; runtime/checkpoints.py keeps the newest cfg.keep_checkpoints), and a later start resumes from
    the latest: the data order is replayed from the seed, so the resumed run sees exactly the batches the
    uninterrupted run would have, none twice."""
    steps_per_epoch = len(rows) // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    ckpt_dir = tracker.checkpoint_dir if cfg.checkpoint_every else None
    log, step = [], 0
    if resumed := checkpoints.resume(ckpt_dir, {"model": group}, name):
        step, state = resumed
        log = state["log"]
        tracker.log_metrics({"resumed_from_step": step}, step=step)
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
            tracker.log_metrics(metrics, step=step)
            log.append({"step": step, **metrics, "rows": [r.get("id", i) for i, r in enumerate(batch)]})
            progress.update(step, **{k: v for k, v in metrics.items() if k not in ("epoch", "tokens")})
            if ckpt_dir and step % cfg.checkpoint_every == 0 and step < total:
                checkpoints.save(ckpt_dir, step, {"model": group}, {"log": log}, cfg.keep_checkpoints)
    return log


def steps_for(cfg: TrainerConfig, num_rows: int, what: str) -> int:
    steps_per_epoch = num_rows // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{what}.batch_size = {cfg.batch_size} is larger than the {num_rows} training rows")
    return steps_per_epoch * cfg.epochs


def evaluate_split(group, rows: list, world_size: int, method: str = "evaluate") -> list:
    """Call `method` on every rank with an interleaved share of `rows`; per-rank results in rank order."""
    return group.call_per_rank(method, [rows[r::world_size] for r in range(world_size)])


def per_row(group, rows: list, world_size: int, method: str) -> list:
    """`method`'s one result per row, in row order. The rows are dealt to the ranks in interleaved shares of equal
    length (padded to a multiple of the ranks with repeats of the first rows, whose results are dropped): under
    ZeRO-3 each forward gathers the weights from every rank, so every rank must run as many forwards (`method` runs
    its share in `forward_pieces`, as many on every rank)."""
    padded = rows + [rows[i % len(rows)] for i in range(-len(rows) % world_size)]
    parts = evaluate_split(group, padded, world_size, method)
    return [parts[i % world_size][i // world_size] for i in range(len(rows))]


def forward_pieces(rows: list, cfg: TrainerConfig) -> list[list]:
    """`rows` in pieces of cfg.forward_micro_batch_size rows (pairs) for forwards where nothing trains (None: the
    training micro-batch, which fits; a rank's whole share of the held-out rows would not)."""
    size = cfg.forward_micro_batch_size or cfg.micro_batch_size
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def save_log(output: Path, log: list[dict]) -> None:
    data.write_jsonl(output / "train_log.jsonl", log)
