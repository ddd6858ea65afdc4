"""One SFT optimizer step on CPU: plain PyTorch vs DeepSpeed ZeRO-0/2, one rank with every core vs a rank per core.

    .venv/bin/python bench/deepspeed_step.py 0 1 --optimizer fused     # ZeRO-0, 1 rank (the demo's setup)
    .venv/bin/python bench/deepspeed_step.py 2 2 --optimizer foreach   # ZeRO-2, 2 ranks (the tests' setup)
    .venv/bin/python bench/deepspeed_step.py torch 2                   # plain PyTorch DDP, 2 ranks
    .venv/bin/python bench/deepspeed_step.py 0 1 --optimizer fused --lora-rank 8 --lora-targets q_proj,v_proj
SmolLM2-135M-Instruct, a global batch of 8 sequences (34 prompt + 24 response tokens, the demo's shape), loss on
the response tokens, torch AdamW; prints the forward, backward and optimizer seconds of 5 steps (rank 0).
Why the demo trains with one ZeRO-0 rank: docs/benchmarks.md.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GLOBAL_BATCH, PROMPT_TOKENS, RESPONSE_TOKENS, STEPS = 8, 34, 24, 5


def rank_main(rank: int, world: int, mode: str, optimizer_impl: str, model_dir: str, lora_rank: int,
              lora_targets: list[str]) -> None:
    import deepspeed
    from stages.deepspeed_strategy import DeepSpeedWorker, ds_config
    from stages.models import load_causal_lm, load_tokenizer, pad_prompt_response, response_logprobs
    # The stages' own process-group setup (gloo on CPU, no shared-memory comm build), outside Ray.
    DeepSpeedWorker().init_distributed(rank, {"master_addr": "127.0.0.1", "master_port": 29533, "world_size": world},
                                       max(1, os.cpu_count() // world))
    per_rank = GLOBAL_BATCH // world
    batch = pad_prompt_response([[5] * PROMPT_TOKENS] * per_rank, [[7] * RESPONSE_TOKENS] * per_rank,
                                load_tokenizer(model_dir).pad_token_id)

    def loss_of(model):
        logp, mask = response_logprobs(model, batch)
        return -logp.sum() / mask.sum()

    model = load_causal_lm(model_dir).train()
    if lora_rank:
        from stages.lora import apply_lora
        apply_lora(model, lora_rank, 2 * lora_rank, lora_targets, train_head=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                  **{optimizer_impl: True})
    if mode == "torch":
        engine = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        backward, step = (lambda loss: loss.backward()), (lambda: (optimizer.step(), optimizer.zero_grad()))
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=ds_config(int(mode), per_rank, 1, world, 1.0))
        backward, step = engine.backward, engine.step
    for i in range(STEPS):
        t0 = time.perf_counter()
        loss = loss_of(engine)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        if rank == 0:
            lora = f" LoRA r{lora_rank} {','.join(lora_targets)}" if lora_rank else ""
            print(f"{'torch' if mode == 'torch' else 'ZeRO-' + mode} x{world} {optimizer_impl}{lora} step {i}: "
                  f"forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, optimizer {t3 - t2:.2f} s, "
                  f"total {t3 - t0:.2f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["torch", "0", "1", "2"], help="plain PyTorch, or a DeepSpeed ZeRO stage")
    parser.add_argument("world", type=int, help="ranks (processes); the cores are split between them")
    parser.add_argument("--optimizer", choices=["foreach", "fused"], default="foreach")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    parser.add_argument("--lora-targets", default="q_proj,v_proj", help="comma-separated linear layer names")
    parser.add_argument("--model", type=Path, default=REPO / "results" / "bench" / "smollm2-135m-instruct")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        from stages.models import build_smollm2
        args.model.mkdir(parents=True, exist_ok=True)
        build_smollm2(args.model)
    mp.spawn(rank_main, args=(args.world, args.mode, args.optimizer, str(args.model), args.lora_rank,
                               args.lora_targets.split(",")), nprocs=args.world)


if __name__ == "__main__":
    main()
