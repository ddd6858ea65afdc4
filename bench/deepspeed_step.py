"""One SFT optimizer step on CPU: plain PyTorch vs DeepSpeed ZeRO-0/2, one rank with every core vs a rank per core.

    .venv/bin/python bench/deepspeed_step.py 0 1 --optimizer fused     # ZeRO-0, 1 rank (the demo's setup)
    .venv/bin/python bench/deepspeed_step.py 2 2 --optimizer foreach   # ZeRO-2, 2 ranks (the tests' setup)
    .venv/bin/python bench/deepspeed_step.py torch 2                   # plain PyTorch DDP, 2 ranks
    .venv/bin/python bench/deepspeed_step.py 0 1 --optimizer fused --lora-rank 8 --lora-targets q_proj,v_proj
    .venv/bin/python bench/deepspeed_step.py 2 2 --tiny --steps 1 --out /tmp/ds.json   # the code path only (tests)
SmolLM2-135M-Instruct, a global batch of 8 sequences (34 prompt + 24 response tokens, the demo's shape), loss on
the response tokens, torch AdamW; prints the forward, backward and optimizer seconds of 5 steps (`--steps`, rank 0)
and with `--out` writes them as JSON. The optimizer and LoRA settings are the sft stage's Config from the schema's
defaults (launcher.config.stage_config) with the batch, ranks, ZeRO stage and LoRA options set here.
Why the demo trains with one ZeRO-0 rank: docs/benchmarks.md.
"""
import argparse
import dataclasses
import os
import socket
import time
import types
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchlib import base_model, default_model, write_results
from launcher.config import stage_config  # noqa: E402  (benchlib puts the repository on sys.path)

GLOBAL_BATCH, PROMPT_TOKENS, RESPONSE_TOKENS = 8, 34, 24


def rank_main(rank: int, world: int, mode: str, optimizer_impl: str, model_dir: str, cfg, steps: int,
              master_port: int, out: Path | None) -> None:
    import deepspeed
    from runtime.deepspeed_strategy import DeepSpeedWorker, ds_config
    from runtime.logprobs import pad_prompt_response, response_logprobs
    from runtime.models import load_causal_lm, load_tokenizer
    # The stages' own process-group setup (gloo on CPU, no shared-memory comm build), outside Ray.
    DeepSpeedWorker().init_distributed(rank, {"master_addr": "127.0.0.1", "master_port": master_port,
                                              "world_size": world}, max(1, os.cpu_count() // world))
    per_rank = cfg.micro_batch_size
    batch = pad_prompt_response([[5] * PROMPT_TOKENS] * per_rank, [[7] * RESPONSE_TOKENS] * per_rank,
                                load_tokenizer(model_dir).pad_token_id)

    def loss_of(model):
        logp, mask = response_logprobs(model, batch)
        return -logp.sum() / mask.sum()

    model = load_causal_lm(model_dir).train()
    if cfg.lora_rank:
        from runtime.lora import apply_lora
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, train_head=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay, **{optimizer_impl: True})
    if mode == "torch":
        engine = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        backward, step = (lambda loss: loss.backward()), (lambda: (optimizer.step(), optimizer.zero_grad()))
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=ds_config(int(mode), per_rank, 1, world, cfg.max_grad_norm))
        backward, step = engine.backward, engine.step
    timings = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = loss_of(engine)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        timings.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "total": t3 - t0})
        if rank == 0:
            lora = f" LoRA r{cfg.lora_rank} {','.join(cfg.lora_targets)}" if cfg.lora_rank else ""
            print(f"{'torch' if mode == 'torch' else 'ZeRO-' + mode} x{world} {optimizer_impl}{lora} step {i}: "
                  f"forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, optimizer {t3 - t2:.2f} s, "
                  f"total {t3 - t0:.2f} s", flush=True)
    if rank == 0 and out is not None:
        write_results(out, {"steps": timings, "setup": {
            "mode": "torch" if mode == "torch" else f"ZeRO-{mode}", "ranks": world, "optimizer": optimizer_impl,
            "lora_rank": cfg.lora_rank, "lora_targets": cfg.lora_targets if cfg.lora_rank else None,
            "global_batch": GLOBAL_BATCH, "prompt_tokens": PROMPT_TOKENS, "response_tokens": RESPONSE_TOKENS,
            "model": str(model_dir)}})
    # Every rank leaves the group together: a rank whose peer exits first can abort in gloo's teardown.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["torch", "0", "1", "2"], help="plain PyTorch, or a DeepSpeed ZeRO stage")
    parser.add_argument("world", type=int, help="ranks (processes); the cores are split between them")
    parser.add_argument("--optimizer", choices=["foreach", "fused"], default="foreach")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    parser.add_argument("--lora-targets", default="q_proj,v_proj", help="comma-separated linear layer names")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", type=Path, help="base model directory (built there if missing; default "
                        "results/bench/smollm2-135m-instruct, with --tiny results/bench/tiny)")
    parser.add_argument("--tiny", action="store_true", help="the schema's tiny random model instead of SmolLM2: "
                        "checks the bench's code path (tests/test_benches.py), measures nothing")
    parser.add_argument("--out", type=Path, help="also write rank 0's step times to this JSON file")
    args = parser.parse_args()
    if GLOBAL_BATCH % args.world:
        parser.error(f"world {args.world} must divide the global batch of {GLOBAL_BATCH}")
    from stages import sft
    # lora_alpha, learning rate, weight decay and gradient clipping: the sft stage's, from the schema's defaults.
    trainer = {"zero_stage": 0 if args.mode == "torch" else int(args.mode), "num_workers": args.world,
               "batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // args.world, "lora_rank": args.lora_rank}
    if args.lora_rank:
        trainer["lora_targets"] = args.lora_targets.split(",")
    # The ranks get its fields as a plain namespace: they need not import the stage (nor Ray).
    cfg = types.SimpleNamespace(**dataclasses.asdict(stage_config(sft, {"seed": 0, "sft": trainer})))
    model = base_model(args.model or default_model(args.tiny), args.tiny)
    with socket.socket() as sock:  # a free rendezvous port, so that runs never collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(args.world, args.mode, args.optimizer, str(model), cfg, args.steps, port, args.out),
             nprocs=args.world)


if __name__ == "__main__":
    main()
