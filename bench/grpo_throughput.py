"""GRPO step throughput: alignpipe's rl stage machinery vs TRL's GRPOTrainer, same model/data/batch.

    make bench-grpo       # or: .venv/bin/python bench/grpo_throughput.py --steps 4
    .venv/bin/python bench/grpo_throughput.py --tiny --steps 1 --sides alignpipe   # the code path only (tests)
Both run GRPO on SmolLM2-135M-Instruct with the same IMDB-opening prompts, 4 prompts x 4 samples per step,
32 new tokens, the same reward function (config/rewards/sentiment.py), batch 16, fp32, on all of this
machine's cores. alignpipe: the demo's policy trainer (`--zero-stage`/`--workers`, default one ZeRO-0 rank
with every core), a reference actor and a vLLM engine as Ray actors, weights synced to vLLM every step.
TRL: one process, generation with transformers' generate.
Steady-state seconds per step exclude the first `--warmup` steps; results in bench/results/grpo_throughput.json
(`--out`). alignpipe's stage settings not named here are the schema's defaults (launcher.config.stage_config).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO, StepTimer, add_common_args, base_model, finish_args, write_results
from launcher.config import stage_config  # noqa: E402  (benchlib puts the repository on sys.path)

PROMPTS, SAMPLES, NEW_TOKENS, MAX_PROMPT_TOKENS = 4, 4, 32, 64
CORES = os.cpu_count()
REWARD_FILE = REPO / "config" / "rewards" / "sentiment.py"


def prompts(model_dir: Path, count: int) -> list[dict]:
    """`count` RL prompts of the built-in IMDB dataset, as the preprocess stage makes them."""
    from stages import preprocess
    from runtime.models import load_tokenizer
    cfg = stage_config(preprocess, {"seed": 0, "data": {"max_prompt_tokens": MAX_PROMPT_TOKENS,
                                                          "max_response_tokens": NEW_TOKENS}}, "data")
    formatter = preprocess.Formatter(cfg, load_tokenizer(model_dir))
    raw = preprocess.read_rows("prompts", cfg.prompts | {"max_samples": 2 * count}, cfg, formatter)
    rows = [row for r in raw if (row := formatter.prompt_row(r, cfg.prompts, "prompts"))][:count]
    return [{"id": i, **r} for i, r in enumerate(rows)]


def bench_alignpipe(model_dir: Path, rows: list[dict], steps: int, zero_stage: int, workers: int) -> list[float]:
    import ray
    from stages import rl
    from runtime import experience
    from runtime.models import load_tokenizer
    from runtime.rl_actors import Roles
    ray.init(num_cpus=CORES, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp"),
             logging_level="WARNING")
    # The rl stage's Config for variant grpo from the schema's defaults; set here only what the bench compares
    # and the trainer layout.
    cfg = stage_config(rl, {"seed": 0, "rl": {"estimator": "group_norm", "rollout_batch_size": PROMPTS,
                                              "n_samples": SAMPLES, "max_new_tokens": NEW_TOKENS, "batch_size": 16,
                                              "micro_batch_size": 4, "reward": str(REWARD_FILE.relative_to(REPO)),
                                              "normalize_reward": False, "steps": steps,
                                              # TRL's GRPO: the KL to the reference (beta 0.01) is a loss term
                                              "kl_in_reward": False, "kl_coef": 0.01,
                                              "zero_stage": zero_stage, "num_workers": workers}})
    tokenizer = load_tokenizer(model_dir)
    for r in rows:
        r["prompt_ids"] = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
    # The rule's inputs (workflow/rules/rl.smk): the policy to start from and, with a reward file, that file.
    roles = Roles(cfg, {"model": model_dir, "reward_file": REWARD_FILE}, steps, CORES,
                  MAX_PROMPT_TOKENS + NEW_TOKENS + 8, StepTimer())
    sync_dir = Path(tempfile.mkdtemp(prefix="sync-"))
    times = []
    for s in range(steps):
        batch = rows[s * PROMPTS:(s + 1) * PROMPTS]
        phases = {}
        t0 = time.perf_counter()
        samples = experience.generate(roles, batch, SAMPLES, cfg, s * 1000, cfg.temperature)
        phases["generate"] = time.perf_counter() - t0
        experience.make_experience(roles, cfg, samples, cfg.kl_coef, {"mean": 0.0, "std": 1.0})
        phases["make_experience"] = time.perf_counter() - t0 - sum(phases.values())
        rl.train_on(roles.policy, cfg, samples, random.Random(s))
        phases["train"] = time.perf_counter() - t0 - sum(phases.values())
        rl.sync_weights(roles, sync_dir, model_dir)
        phases["weight_sync"] = time.perf_counter() - t0 - sum(phases.values())
        times.append(time.perf_counter() - t0)
        print("PHASES " + json.dumps(phases), flush=True)
    ray.shutdown()
    return times


def bench_trl(model_dir: Path, rows: list[dict], steps: int) -> list[float]:
    import importlib.util
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from runtime.models import load_causal_lm, load_tokenizer
    torch.set_num_threads(CORES)
    spec = importlib.util.spec_from_file_location("reward", REWARD_FILE)
    reward_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward_module)

    def sentiment_reward(prompts, completions, **kw):
        return reward_module.reward_fn(prompts, completions, None)

    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times[-1] = time.perf_counter() - times[-1]

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=PROMPTS * SAMPLES,
                      num_generations=SAMPLES, max_completion_length=NEW_TOKENS, max_steps=steps,
                      learning_rate=1e-6, beta=0.01, use_cpu=True, report_to=[], logging_steps=1,
                      save_strategy="no", seed=0, bf16=False, fp16=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=load_causal_lm(model_dir), reward_funcs=sentiment_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
                          processing_class=load_tokenizer(model_dir), callbacks=[Timer()])
    trainer.train()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "grpo_throughput", steps=5, warmup=1)
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--workers", type=int, default=1, help="alignpipe's policy ranks (DeepSpeed)")
    args = parser.parse_args()
    finish_args(parser, args)
    if args.only:
        rows = prompts(args.model, args.steps * PROMPTS)
        times = bench_alignpipe(args.model, rows, args.steps, args.zero_stage, args.workers) \
            if args.only == "alignpipe" else bench_trl(args.model, rows, args.steps)
        print("STEP_TIMES " + json.dumps(times), flush=True)
        return
    base_model(args.model, args.tiny)
    results = {}
    for side in args.sides:  # separate processes: neither inherits the other's threads or memory
        out = subprocess.run([sys.executable, __file__, "--only", side, "--model", str(args.model), "--steps",
                              str(args.steps), "--warmup", str(args.warmup), "--zero-stage", str(args.zero_stage),
                              "--workers", str(args.workers)], capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("STEP_TIMES ")]
        if out.returncode != 0 or not line:
            sys.exit(f"{side} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
        times = json.loads(line[0].removeprefix("STEP_TIMES "))
        if len(times) != args.steps:
            sys.exit(f"{side} ran {len(times)} steps, not {args.steps}:\n{out.stdout[-3000:]}")
        steady = statistics.fmean(times[args.warmup:])
        results[side] = {"step_seconds": times, "steady_seconds_per_step": steady,
                         "samples_per_second": PROMPTS * SAMPLES / steady}
        phases = [json.loads(l.removeprefix("PHASES ")) for l in out.stdout.splitlines() if l.startswith("PHASES ")]
        if phases:  # alignpipe's steady seconds per phase
            results[side]["phase_seconds"] = {k: statistics.fmean(p[k] for p in phases[args.warmup:])
                                              for k in phases[0]}
        print(f"{side}: {steady:.2f} s/step, {PROMPTS * SAMPLES / steady:.3f} samples/s", flush=True)
    results["setup"] = {"model": "tiny (schema model.tiny)" if args.tiny else "SmolLM2-135M-Instruct",
                        "prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES, "sides": args.sides,
                        "alignpipe_policy": f"{args.workers} rank(s), ZeRO-{args.zero_stage}",
                        "max_new_tokens": NEW_TOKENS, "steps": args.steps, "warmup_steps_excluded": args.warmup}
    write_results(args.out, results)

if __name__ == "__main__":
    main()
