"""DPO training throughput: alignpipe's DPO stage machinery vs TRL's DPOTrainer, same model/data/batches/tokens.

    make bench-dpo        # or: .venv/bin/python bench/dpo_throughput.py   (10 steps, the first 2 excluded)
    .venv/bin/python bench/dpo_throughput.py --tiny --steps 1 --sides alignpipe   # the code path only (tests)
Both train SmolLM2-135M-Instruct with sigmoid DPO, beta 0.1, fp32 (or both bf16: `--precision bf16`), on all of this machine's cores, and do the same
policy work per step:
- the same pairs in the same steps: the generated IMDB preference pairs (prompt <= 64 tokens, responses cut at 48
  by the preprocess stage's code), one epoch in the order alignpipe's trainer takes them (`trainer.fit`'s seeded
  shuffle, replayed here and checked against fit's log), given to TRL in that order (sequential sampling);
- the same tokens: TRL gets the token ids alignpipe's `pair_batch` makes (prompt and each response encoded apart,
  no special tokens), not its own tokenization, which would append EOS to the responses cut at 48 tokens and
  tokenize prompt+response as one text (its `_prepare_dataset` is bypassed for that); no sequence is longer than
  TRL's max_length (64 + 48), so neither side truncates;
- the same batches: global batch 8 in micro-batches of 4 pairs (alignpipe's micro_batch_size 4; TRL
  per_device_train_batch_size 4 x gradient_accumulation_steps 2), each micro-batch one right-padded batch of its 4
  prompt+chosen then its 4 prompt+rejected sequences (to the longest of the 8, no pad-to-multiple) through the
  policy;
- learning rate the dpo stage's (5e-6 here), no warmup, no gradient checkpointing (TRL 1.16 defaults to it; the
  stage's schema default is off).
Not equal: the reference's forward. alignpipe computes the reference log-probs once, before the first step
(stages/dpo.py's reference pass through the policy engine, as the dpo stage does; not timed); TRL runs its frozen
reference on every micro-batch (its precompute_ref_log_probs is off). And how each does it. alignpipe: the demo's
trainer in Ray actors (`--zero-stage`/`--workers`, default one ZeRO-0 rank with every core; `--workers 2
--zero-stage 2` for two ZeRO-2 ranks of one core each, which then take one micro-batch each), DeepSpeed, its output
layer over the response positions only; TRL: one process, transformers' Trainer and optimizer, its fused LM-head
log-probs.
A step's time is the wall time between two steps' ends (alignpipe: its metrics arriving; TRL: on_step_end). The
results (bench/results/dpo_throughput.json, `--out`) give each side's steady mean, median, min and max over the
steps after `--warmup`, pairs/s by the mean, and alignpipe's achieved training rate (`train_gflops`: 6 FLOPs per
parameter per position of its pairs over its steady steps, against the machine's matmul peaks). alignpipe's stage
settings not named here are the schema's defaults (launcher.config.stage_config). `trl-defaults`: TRL as its
DPOConfig defaults (bf16 autocast, gradient checkpointing), what a TRL user gets without asking; run by default only
on a CPU with native bf16.
"""
import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

from benchlib import (TRL_DEFAULTS, StepTimer, add_common_args, base_model, describe, emit, finish_args, machine,
                      print_training_rate, run_side, side_results, tagged, training_gflops, trl_defaults,
                      trl_step_timer, write_results)
from launcher.config import stage_config  # noqa: E402  (benchlib puts the repository on sys.path)

MAX_PROMPT_TOKENS, MAX_RESPONSE_TOKENS = 64, 48


def make_pairs(model_dir: Path, count: int, tiny: bool = False) -> list[dict]:
    """`count` preference pairs of the built-in IMDB dataset, as the preprocess stage makes them, numbered. `tiny`:
    Rotten Tomatoes' (its pairs need the sentiment of a tenth as many reviews: 17 s less for a code-path check)."""
    from stages import preprocess
    from runtime.models import load_tokenizer
    cfg = stage_config(preprocess, {"seed": 0, "data": {"max_prompt_tokens": MAX_PROMPT_TOKENS,
                                                          "preference": {"path": "builtin:rotten_tomatoes" if tiny
                                                                         else "builtin:imdb"},
                                                          "long_responses": "truncate",
                                                          "max_response_tokens": MAX_RESPONSE_TOKENS}}, "data")
    formatter = preprocess.Formatter(cfg, load_tokenizer(model_dir))
    raw = preprocess.read_rows("preference", cfg.preference | {"max_samples": 2 * count}, cfg, formatter)
    pairs = [pair for r in raw if (pair := formatter.pair(r, cfg.preference))][:count]
    if len(pairs) < count:
        sys.exit(f"only {len(pairs)} pairs for {count}: fewer --steps or a smaller --batch")
    return [{"id": i, **pair} for i, pair in enumerate(pairs)]


def dpo_config(batch: int, zero_stage: int, workers: int, precision: str = "fp32"):
    """The dpo stage's Config from the schema's defaults, with what the bench compares (batch, one epoch, sigmoid
    DPO with beta 0.1, learning rate 5e-6 without warmup) and the trainer layout set here; TRL's side takes its
    batch layout, learning rate, beta and seed from it too."""
    from stages import dpo
    return stage_config(dpo, {"seed": 0, "dpo": {"zero_stage": zero_stage, "num_workers": workers, "epochs": 1,
                                                  "batch_size": batch, "micro_batch_size": batch // 2,
                                                  "learning_rate": 5e-6, "warmup_steps": 0, "checkpoint_every": 0,
                                                  "loss": "dpo", "beta": 0.1, "precision": precision}})


def step_batches(pairs: list[dict], batch: int, steps: int, seed: int) -> list[list[dict]]:
    """Each step's pairs as alignpipe's `trainer.fit` takes them: one epoch over the first steps x batch pairs,
    shuffled by `seed` (fit's shuffle replayed; bench_alignpipe checks it against fit's log)."""
    order = pairs[:steps * batch]
    random.Random(seed).shuffle(order)
    return [order[s * batch:(s + 1) * batch] for s in range(steps)]


def bench_alignpipe(model_dir: Path, pairs: list[dict], batch: int, steps: int, zero_stage: int,
                    workers: int, precision: str = "fp32") -> list[float]:
    import ray
    from stages import dpo
    from runtime import trainer
    from runtime.models import load_tokenizer
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp"))
    cfg = dpo_config(batch, zero_stage, workers, precision)
    if getattr(cfg, "gradient_checkpointing", False):
        sys.exit("the dpo stage's schema now checkpoints gradients: TRL's side runs without (set it here)")
    timer = StepTimer()
    group = trainer.start_workers(dpo.DPOWorker, cfg, model_dir, steps, timer)
    pairs = dpo.with_reference(pairs[:steps * batch], cfg.loss,
                               lambda rows: trainer.per_row(group, rows, cfg.num_workers, "reference_logps"))
    timer.start()
    log = trainer.fit(group, cfg, pairs, "alignpipe-dpo", timer)
    group.shutdown()
    ray.shutdown()
    if [entry["rows"] for entry in log] != [[p["id"] for p in b] for b in step_batches(pairs, batch, steps, cfg.seed)]:
        sys.exit("trainer.fit no longer takes the pairs in the order step_batches replays: update step_batches, "
                 "or TRL's side trains on other batches")
    # each step's positions: every pair's prompt+chosen and prompt+rejected (runtime.logprobs.pair_batch)
    tokenizer = load_tokenizer(model_dir)
    tokens = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    emit("TRAINED_TOKENS", [sum(2 * tokens(p["prompt"]) + tokens(p["chosen"]) + tokens(p["rejected"]) for p in b)
                            for b in step_batches(pairs, batch, steps, cfg.seed)])
    return timer.step_seconds()


def bench_trl(model_dir: Path, pairs: list[dict], batch: int, steps: int, zero_stage: int,
              workers: int, precision: str = "fp32", own_defaults: bool = False) -> list[float]:
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from runtime.models import load_causal_lm, load_tokenizer
    torch.set_num_threads(os.cpu_count())
    cfg = dpo_config(batch, zero_stage, workers)
    tokenizer = load_tokenizer(model_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # as runtime.logprobs.pair_batch
    rows = [{"prompt_ids": encode(p["prompt"]), "chosen_ids": encode(p["chosen"]),
             "rejected_ids": encode(p["rejected"])} for b in step_batches(pairs, batch, steps, cfg.seed) for p in b]
    max_length = MAX_PROMPT_TOKENS + MAX_RESPONSE_TOKENS
    longest = max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows)
    if longest > max_length:
        sys.exit(f"a pair of {longest} tokens: TRL would truncate it to {max_length}, alignpipe would not")

    class SameTokensDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already tokenized as alignpipe's pair_batch tokenizes

    times = []
    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=cfg.micro_batch_size,
                     gradient_accumulation_steps=batch // cfg.micro_batch_size, train_sampling_strategy="sequential",
                     max_steps=steps, learning_rate=cfg.learning_rate, beta=cfg.beta, loss_type=["sigmoid"],
                     max_length=max_length, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                     seed=cfg.seed, warmup_steps=0, dataloader_num_workers=0, **trl_defaults(own_defaults, precision))
    trainer = SameTokensDPOTrainer(model=load_causal_lm(model_dir), ref_model=load_causal_lm(model_dir), args=args,
                                   train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                                   callbacks=[trl_step_timer(times)])
    trainer.train()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "dpo_throughput", steps=10, warmup=2)
    parser.add_argument("--batch", type=int, default=8, help="pairs per step, in two micro-batches (even)")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--workers", type=int, default=1, choices=[1, 2], help="alignpipe's DeepSpeed ranks")
    args = parser.parse_args()
    finish_args(parser, args)
    if args.batch < 2 or args.batch % 2:
        parser.error("--batch must be even")
    if args.only:
        pairs = make_pairs(args.model, args.steps * args.batch, args.tiny)
        if args.only == "alignpipe":
            times = bench_alignpipe(args.model, pairs, args.batch, args.steps, args.zero_stage, args.workers,
                                    args.precision)
        else:
            times = bench_trl(args.model, pairs, args.batch, args.steps, args.zero_stage, args.workers, args.precision,
                              own_defaults=args.only == TRL_DEFAULTS)
        emit("STEP_TIMES", times)
        return
    base_model(args.model, args.tiny)
    results = {"machine": machine()}
    for side in args.sides:
        times, lines = run_side(__file__, side, ["--model", str(args.model), "--steps", str(args.steps), "--warmup",
                                                 str(args.warmup), "--batch", str(args.batch), "--zero-stage",
                                                 str(args.zero_stage), "--workers", str(args.workers), "--precision",
                                                 args.precision] + ["--tiny"] * args.tiny, args.steps)
        results[side] = side_results(times, args.warmup, "pairs_per_second", args.batch)
        print(describe(side, results[side], "pairs_per_second", "pairs"), flush=True)
        if tokens := tagged(lines, "TRAINED_TOKENS"):  # alignpipe's: the whole step trains
            results[side]["train_gflops"] = training_gflops(args.model, sum(tokens[0][args.warmup:]),
                                                            sum(times[args.warmup:]))
            print_training_rate(side, results[side]["train_gflops"], results["machine"])
    results["setup"] = {"model": "tiny (schema model.tiny)" if args.tiny else "SmolLM2-135M-Instruct",
                        "batch": args.batch, "micro_batch": args.batch // 2, "steps": args.steps, "sides": args.sides,
                        "alignpipe_trainer": f"{args.workers} rank(s), ZeRO-{args.zero_stage}",
                        "warmup_steps_excluded": args.warmup, "max_prompt_tokens": MAX_PROMPT_TOKENS,
                        "max_response_tokens": MAX_RESPONSE_TOKENS, "gradient_checkpointing": False,
                        "same_batches_and_tokens": True, "precision": args.precision}
    write_results(args.out, results)
    for other in ("trl", TRL_DEFAULTS):
        if "alignpipe" in results and other in results:
            a, t = results["alignpipe"]["steady_step_seconds"], results[other]["steady_step_seconds"]
            print(f"speed-up alignpipe vs {other}: {t['mean'] / a['mean']:.2f}x by mean s/step, "
                  f"{t['median'] / a['median']:.2f}x by median", flush=True)


if __name__ == "__main__":
    main()
