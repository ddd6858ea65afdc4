"""DPO training throughput: alignpipe's DPO stage machinery vs TRL's DPOTrainer, same model/data/batch.

    make bench-dpo        # or: .venv/bin/python bench/dpo_throughput.py --steps 8
    .venv/bin/python bench/dpo_throughput.py --tiny --steps 1 --sides alignpipe   # the code path only (tests)
Both train the same SmolLM2-135M-Instruct on the same generated IMDB preference pairs (prompt <= 64 tokens,
responses cut at 48), global batch 8, sigmoid DPO with beta 0.1, fp32, on all of this machine's cores:
alignpipe as the demo's trainer in Ray actors (`--zero-stage`/`--workers`, default one ZeRO-0 rank with every
core; `--workers 2 --zero-stage 2` for two ZeRO-2 ranks of one core each), TRL as one process.
Steady-state pairs/s excludes the first `--warmup` steps. Results go to bench/results/dpo_throughput.json
(`--out`). alignpipe's stage settings not named here are the schema's defaults (launcher.config.stage_config).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import StepTimer, add_common_args, base_model, finish_args, write_results
from launcher.config import stage_config  # noqa: E402  (benchlib puts the repository on sys.path)

MAX_PROMPT_TOKENS, MAX_RESPONSE_TOKENS = 64, 48


def make_pairs(model_dir: Path, count: int) -> list[dict]:
    """`count` preference pairs of the built-in IMDB dataset, as the preprocess stage makes them."""
    from stages import preprocess
    from runtime.models import load_tokenizer
    cfg = stage_config(preprocess, {"seed": 0, "data": {"max_prompt_tokens": MAX_PROMPT_TOKENS, "long_responses": "truncate",
                                                          "max_response_tokens": MAX_RESPONSE_TOKENS}}, "data")
    formatter = preprocess.Formatter(cfg, load_tokenizer(model_dir))
    raw = preprocess.read_rows("preference", cfg.preference | {"max_samples": 2 * count}, cfg, formatter)
    return [pair for r in raw if (pair := formatter.pair(r, cfg.preference))][:count]


def bench_alignpipe(model_dir: Path, pairs: list[dict], batch: int, steps: int, zero_stage: int,
                    workers: int) -> list[float]:
    import ray
    from stages import dpo
    from runtime import trainer
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp"))
    # The dpo stage's Config from the schema's defaults; set here only what the bench compares (TRL's side
    # below: batch, one epoch, sigmoid DPO with beta 0.1, learning rate 5e-6 without warmup) and the trainer layout.
    cfg = stage_config(dpo, {"seed": 0, "dpo": {"zero_stage": zero_stage, "num_workers": workers, "epochs": 1,
                                                 "batch_size": batch, "micro_batch_size": batch // 2,
                                                 "learning_rate": 5e-6, "warmup_steps": 0, "checkpoint_every": 0,
                                                 "loss": "dpo", "beta": 0.1}})
    timer = StepTimer()
    group = trainer.start_workers(dpo.DPOWorker, cfg, model_dir, steps, timer)
    timer.start()
    trainer.fit(group, cfg, pairs[:steps * batch], "alignpipe-dpo", timer)
    group.shutdown()
    ray.shutdown()
    return timer.step_seconds()


def bench_trl(model_dir: Path, pairs: list[dict], batch: int, steps: int) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer
    from runtime.models import load_causal_lm, load_tokenizer
    torch.set_num_threads(os.cpu_count())
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times[-1] = time.perf_counter() - times[-1]

    rows = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]} for p in pairs[:steps * batch]]
    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=batch,
                     max_steps=steps, learning_rate=5e-6, beta=0.1, loss_type=["sigmoid"],
                     max_length=MAX_PROMPT_TOKENS + MAX_RESPONSE_TOKENS, use_cpu=True, report_to=[], logging_steps=1,
                     save_strategy="no", seed=0, warmup_steps=0,
                     dataloader_num_workers=0, bf16=False, fp16=False)
    trainer = DPOTrainer(model=load_causal_lm(model_dir), ref_model=load_causal_lm(model_dir), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(model_dir),
                         callbacks=[Timer()])
    trainer.train()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "dpo_throughput", steps=8, warmup=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--workers", type=int, default=1, choices=[1, 2], help="alignpipe's DeepSpeed ranks")
    args = parser.parse_args()
    finish_args(parser, args)
    if args.only:
        pairs = make_pairs(args.model, args.steps * args.batch)
        times = bench_alignpipe(args.model, pairs, args.batch, args.steps, args.zero_stage, args.workers) \
            if args.only == "alignpipe" else bench_trl(args.model, pairs, args.batch, args.steps)
        print("STEP_TIMES " + json.dumps(times), flush=True)
        return
    import subprocess
    base_model(args.model, args.tiny)
    results = {}
    for side in args.sides:  # separate processes: neither inherits the other's threads or memory
        out = subprocess.run([sys.executable, __file__, "--only", side, "--model", str(args.model), "--steps",
                              str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                              "--zero-stage", str(args.zero_stage), "--workers", str(args.workers)],
                             capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("STEP_TIMES ")]
        if out.returncode != 0 or not line:
            sys.exit(f"{side} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
        times = json.loads(line[0].removeprefix("STEP_TIMES "))
        if len(times) != args.steps:
            sys.exit(f"{side} ran {len(times)} steps, not {args.steps}:\n{out.stdout[-3000:]}")
        steady = times[args.warmup:]
        results[side] = {"step_seconds": times, "steady_seconds_per_step": statistics.fmean(steady),
                         "pairs_per_second": args.batch / statistics.fmean(steady)}
        print(f"{side}: {results[side]['pairs_per_second']:.3f} pairs/s "
              f"({results[side]['steady_seconds_per_step']:.2f} s/step)", flush=True)
    results["setup"] = {"model": "tiny (schema model.tiny)" if args.tiny else "SmolLM2-135M-Instruct",
                        "batch": args.batch, "steps": args.steps, "sides": args.sides,
                        "alignpipe_trainer": f"{args.workers} rank(s), ZeRO-{args.zero_stage}",
                        "warmup_steps_excluded": args.warmup, "max_prompt_tokens": MAX_PROMPT_TOKENS,
                        "max_response_tokens": MAX_RESPONSE_TOKENS}
    write_results(args.out, results)
    if "alignpipe" in results and "trl" in results:
        print(f"ratio alignpipe/trl: "
              f"{results['alignpipe']['pairs_per_second'] / results['trl']['pairs_per_second']:.2f}")


if __name__ == "__main__":
    main()
