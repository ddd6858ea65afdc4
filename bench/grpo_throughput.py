"""GRPO step throughput: alignpipe's rl stage machinery vs TRL's GRPOTrainer, same model/data/batch/lengths.

    make bench-grpo       # or: .venv/bin/python bench/grpo_throughput.py   (9 steps, the first excluded)
    .venv/bin/python bench/grpo_throughput.py --sides alignpipe,alignpipe-async,alignpipe-packed   # no TRL
    .venv/bin/python bench/grpo_throughput.py --tiny --steps 2 --sides alignpipe-async   # tests/test_benches.py
Both run GRPO on SmolLM2-135M-Instruct, fp32 (or both bf16: `--precision bf16`), on all of this machine's cores, and do the same work per step:
- the same prompts in the same steps: the IMDB-opening prompts in order, step s gets prompts 4s..4s+3 (TRL with
  shuffle_dataset=False), 4 samples each, temperature and top_p the rl stage's (1.0, 1.0 by default);
- every response exactly 32 new tokens (issue #16: with responses ending at EOS a step's time followed its response
  lengths, and one invocation's TRL steps ranged 16-41 s): alignpipe's vLLM samples with `ignore_eos` (no stop
  token), TRL's `generate` with `min_new_tokens` = `max_new_tokens` (EOS never sampled); each side checks that
  every response it trained on had exactly 32 tokens, and the results give their min and max (`response_tokens`);
- the same reward function (config/rewards/sentiment.py); KL to the reference as a loss term (beta 0.01);
- one optimizer step of 16 samples per rollout, in micro-batches of 4 (alignpipe's micro_batch_size 4; TRL
  per_device_train_batch_size 4 x gradient_accumulation_steps 4), so neither needs the old policy's log-probs;
- no gradient checkpointing (TRL 1.16 defaults to it; the rl stage's schema default is off).
Not equal: how each does it. alignpipe: the demo's policy trainer (`--zero-stage`/`--workers`, default one ZeRO-0
rank with every core), a reference actor and a vLLM engine as Ray actors, vLLM sampling, the trainer's weights
handed to vLLM in memory after every step (`runtime.rl_actors.Roles.sync_weights`). TRL: one process, sampling with transformers'
`generate` from the training model (nothing to sync), its own reference pass. vLLM may sample EOS inside a response
and go on (the tokens are computed either way); TRL suppresses it. Prompt padding: alignpipe right-pads
prompt+response, TRL left-pads prompts to the batch's longest.
A step's time is the wall time of one rollout-and-train step (TRL: between consecutive step ends, benchlib); the
results (bench/results/grpo_throughput.json, `--out`) give each side's steady mean, median, min and max over the
steps after `--warmup`, and alignpipe's seconds per phase (generate, make_experience, train, weight_sync) with the
weight sync's own statistics. alignpipe's stage settings not named here are the schema's defaults
(launcher.config.stage_config).
Two more alignpipe sides do the same work with one setting of the rl stage changed: `alignpipe-async`
(async_rollouts 1: step s+1's rollout generated in a thread while step s makes experience and trains, as the stage
does; its `generate` phase is the time the step waits for it) and `alignpipe-packed` (packing: the policy's and the
reference's forwards without padding). And `trl-defaults`: TRL as its GRPOConfig defaults (bf16 autocast, gradient
checkpointing), what a TRL user gets without asking; run by default only on a CPU with native bf16.
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import (REPO, TRL_DEFAULTS, StepTimer, add_common_args, base_model, describe, emit, finish_args, machine,
                      print_training_rate, run_side, side_results, steady_stats, tagged, training_gflops, trl_defaults,
                      trl_step_timer, write_results)
from launcher.config import stage_config  # noqa: E402  (benchlib puts the repository on sys.path)

PROMPTS, SAMPLES, NEW_TOKENS, MAX_PROMPT_TOKENS, MICRO_BATCH = 4, 4, 32, 64, 4
CORES = os.cpu_count()
REWARD_FILE = REPO / "config" / "rewards" / "sentiment.py"
PHASES = ("generate", "make_experience", "train", "weight_sync")
# alignpipe's sides and the rl settings each changes from the first; then TRL's
ALIGNPIPE_SIDES = {"alignpipe": {}, "alignpipe-async": {"async_rollouts": 1}, "alignpipe-packed": {"packing": True}}
SIDES = (*ALIGNPIPE_SIDES, "trl", TRL_DEFAULTS)


def prompts(model_dir: Path, count: int) -> list[dict]:
    """`count` RL prompts of the built-in IMDB dataset, as the preprocess stage makes them."""
    from stages import preprocess
    from runtime.models import load_tokenizer
    cfg = stage_config(preprocess, {"seed": 0, "data": {"max_prompt_tokens": MAX_PROMPT_TOKENS,
                                                          "prompts": {"path": "builtin:imdb"},
                                                          "max_response_tokens": NEW_TOKENS}}, "data")
    formatter = preprocess.Formatter(cfg, load_tokenizer(model_dir))
    raw = preprocess.read_rows("prompts", cfg.prompts | {"max_samples": 2 * count}, cfg, formatter)
    rows = [row for r in raw if (row := formatter.prompt_row(r, cfg.prompts, "prompts"))][:count]
    if len(rows) < count:
        sys.exit(f"only {len(rows)} prompts for {count}: fewer --steps")
    return [{"id": i, **r} for i, r in enumerate(rows)]


def rl_config(steps: int, zero_stage: int, workers: int, changed: dict | None = None):
    """The rl stage's Config for variant grpo from the schema's defaults, with what the bench compares, the
    trainer layout set here and an alignpipe side's `changed` settings; TRL's side takes its sampling settings and
    learning rate from it too."""
    from stages import rl
    return stage_config(rl, {"seed": 0, "rl": {"estimator": "group_norm", "rollout_batch_size": PROMPTS,
                                               "n_samples": SAMPLES, "max_new_tokens": NEW_TOKENS,
                                               "batch_size": PROMPTS * SAMPLES, "micro_batch_size": MICRO_BATCH,
                                               "reward": str(REWARD_FILE.relative_to(REPO)),
                                               "normalize_reward": False, "steps": steps,
                                               # TRL's GRPO: the KL to the reference (beta 0.01) is a loss term
                                               "kl_in_reward": False, "kl_coef": 0.01,
                                               "zero_stage": zero_stage, "num_workers": workers} | (changed or {})})


def check_lengths(side: str, lengths: list[int]) -> None:
    """Every response exactly NEW_TOKENS tokens, or the two sides did not do the same work."""
    emit("RESPONSE_TOKENS", {"min": min(lengths), "max": max(lengths), "responses": len(lengths)})
    if min(lengths) != NEW_TOKENS or max(lengths) != NEW_TOKENS:
        sys.exit(f"{side}: responses of {min(lengths)}-{max(lengths)} tokens, not all exactly {NEW_TOKENS}")


def bench_alignpipe(model_dir: Path, rows: list[dict], steps: int, zero_stage: int, workers: int,
                    side: str = "alignpipe", precision: str = "fp32") -> list[float]:
    import ray
    from stages import rl
    from runtime import experience
    from runtime.models import load_tokenizer
    from runtime.rl_actors import Roles
    ray.init(num_cpus=CORES, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp"),
             logging_level="WARNING")
    cfg = rl_config(steps, zero_stage, workers, ALIGNPIPE_SIDES[side] | {"precision": precision})
    if getattr(cfg, "gradient_checkpointing", False):
        sys.exit("the rl stage's schema now checkpoints gradients: TRL's side runs without (set it here)")
    tokenizer = load_tokenizer(model_dir)
    for r in rows:
        r["prompt_ids"] = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
    # The rule's inputs (workflow/rules/rl.smk): the policy to start from and, with a reward file, that file.
    roles = Roles(cfg, {"model": model_dir, "reward_file": REWARD_FILE}, steps, CORES,
                  MAX_PROMPT_TOKENS + NEW_TOKENS + 8, StepTimer())
    generate = lambda s: experience.generate(roles, rows[s * PROMPTS:(s + 1) * PROMPTS], SAMPLES, cfg, s * 1000,
                                             cfg.temperature, ignore_eos=True)
    pool = ThreadPoolExecutor(1) if cfg.async_rollouts else None
    times, lengths, ahead = [], [], None
    for s in range(steps):
        t0 = time.perf_counter()
        samples = ahead.result() if ahead else generate(s)
        phases = {"generate": time.perf_counter() - t0}
        ahead = pool.submit(generate, s + 1) if pool and s + 1 < steps else None  # as stages/rl.py does
        experience.make_experience(roles, cfg, samples, cfg.kl_coef, {"mean": 0.0, "std": 1.0})
        phases["make_experience"] = time.perf_counter() - t0 - sum(phases.values())
        rl.train_on(roles.policy, cfg, samples, random.Random(s))
        phases["train"] = time.perf_counter() - t0 - sum(phases.values())
        if ahead:
            ahead.result()  # the engines are done with the old weights
            phases["generate"] += time.perf_counter() - t0 - sum(phases.values())
        roles.sync_weights()
        phases["weight_sync"] = time.perf_counter() - t0 - sum(phases.values())
        times.append(time.perf_counter() - t0)
        lengths += [len(r) for r in samples.response_ids]
        emit("PHASES", phases)
        # the positions the training step's forward needs
        emit("TRAINED_TOKENS", SAMPLES * sum(len(r["prompt_ids"]) for r in rows[s * PROMPTS:(s + 1) * PROMPTS])
             + sum(len(r) for r in samples.response_ids))
    ray.shutdown()
    check_lengths("alignpipe", lengths)
    return times


def bench_trl(model_dir: Path, rows: list[dict], steps: int, zero_stage: int, workers: int,
              precision: str = "fp32", own_defaults: bool = False) -> list[float]:
    import importlib.util
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from runtime.models import load_causal_lm, load_tokenizer
    torch.set_num_threads(CORES)
    cfg = rl_config(steps, zero_stage, workers)
    spec = importlib.util.spec_from_file_location("reward", REWARD_FILE)
    reward_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward_module)
    lengths, batches = [], []

    def sentiment_reward(prompts, completions, completion_ids, **kw):
        lengths.extend(len(ids) for ids in completion_ids)  # what TRL trains on: after its cut at the first EOS
        batches.append(sorted(set(prompts)))
        return reward_module.reward_fn(prompts, completions, None)

    times = []
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=MICRO_BATCH,
                      gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO_BATCH, num_generations=SAMPLES,
                      max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
                      temperature=cfg.temperature, top_p=cfg.top_p, shuffle_dataset=False,
                      max_steps=steps, learning_rate=cfg.learning_rate,
                      beta=cfg.kl_coef, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                      dataloader_num_workers=0, **trl_defaults(own_defaults, precision))
    trainer = GRPOTrainer(model=load_causal_lm(model_dir), reward_funcs=sentiment_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
                          processing_class=load_tokenizer(model_dir), callbacks=[trl_step_timer(times)])
    trainer.train()
    expected = [sorted({r["prompt"] for r in rows[s * PROMPTS:(s + 1) * PROMPTS]}) for s in range(steps)]
    if batches != expected:
        sys.exit("trl: its steps' prompts are not alignpipe's (prompts 4s..4s+3 in step s)")
    check_lengths("trl", lengths)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "grpo_throughput", steps=9, warmup=1, sides=SIDES)
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--workers", type=int, default=1, help="alignpipe's policy ranks (DeepSpeed)")
    args = parser.parse_args()
    finish_args(parser, args)
    if args.only:
        rows = prompts(args.model, args.steps * PROMPTS)
        if args.only.startswith("trl"):
            emit("STEP_TIMES", bench_trl(args.model, rows, args.steps, args.zero_stage, args.workers, args.precision,
                                         own_defaults=args.only == TRL_DEFAULTS))
        else:
            emit("STEP_TIMES", bench_alignpipe(args.model, rows, args.steps, args.zero_stage, args.workers, args.only,
                                               args.precision))
        return
    base_model(args.model, args.tiny)
    results = {"machine": machine()}
    for side in args.sides:
        times, lines = run_side(__file__, side, ["--model", str(args.model), "--steps", str(args.steps), "--warmup",
                                                 str(args.warmup), "--zero-stage", str(args.zero_stage),
                                                 "--workers", str(args.workers), "--precision", args.precision],
                                 args.steps)
        result = results[side] = side_results(times, args.warmup, "samples_per_second", PROMPTS * SAMPLES)
        result["response_tokens"] = tagged(lines, "RESPONSE_TOKENS")[0]
        print(describe(side, result, "samples_per_second", "samples"), flush=True)
        if phases := tagged(lines, "PHASES"):  # alignpipe's seconds per phase, every step
            steady = phases[args.warmup:]
            result["phase_step_seconds"] = phases
            result["phase_seconds"] = {k: statistics.fmean(p[k] for p in steady) for k in PHASES}
            result["weight_sync_seconds"] = steady_stats([p["weight_sync"] for p in phases], args.warmup)
            sync = result["weight_sync_seconds"]
            print(f"{side} steady s/step per phase: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                    result["phase_seconds"].items()), flush=True)
            print(f"{side} weight sync: mean {sync['mean']:.3f} s/step (median {sync['median']:.3f}, "
                  f"min {sync['min']:.3f}, max {sync['max']:.3f})", flush=True)
            result["train_gflops"] = training_gflops(args.model, sum(tagged(lines, "TRAINED_TOKENS")[args.warmup:]),
                                                     sum(p["train"] for p in steady))
            print_training_rate(side, result["train_gflops"], results["machine"])
    results["setup"] = {"model": "tiny (schema model.tiny)" if args.tiny else "SmolLM2-135M-Instruct",
                        "prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES, "micro_batch": MICRO_BATCH,
                        "sides": args.sides, "alignpipe_policy": f"{args.workers} rank(s), ZeRO-{args.zero_stage}",
                        "max_new_tokens": NEW_TOKENS,
                        "response_tokens": f"exactly {NEW_TOKENS}: alignpipe vLLM ignore_eos, TRL min_new_tokens",
                        "gradient_checkpointing": False, "steps": args.steps, "warmup_steps_excluded": args.warmup,
                        "precision": args.precision}
    write_results(args.out, results)
    for side, other in [(s, "alignpipe") for s in ALIGNPIPE_SIDES if s != "alignpipe"] + [("alignpipe", "trl"),
                                                                                          ("alignpipe", TRL_DEFAULTS)]:
        if side in results and other in results:
            a, t = results[side]["steady_step_seconds"], results[other]["steady_step_seconds"]
            print(f"speed-up {side} vs {other}: {t['mean'] / a['mean']:.2f}x by mean s/step, "
                  f"{t['median'] / a['median']:.2f}x by median", flush=True)


if __name__ == "__main__":
    main()
