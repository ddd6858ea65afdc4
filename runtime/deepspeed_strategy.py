"""DeepSpeed ZeRO training for one rank: device and process-group setup, engine, and Hugging Face export.

Subclasses (the per-stage Ray workers) implement `setup(cfg, rank)`, given the stage's Config, and `loss(batch)`;
this base owns everything else. On GPUs each rank uses the one GPU Ray gave it (Ray's CUDA_VISIBLE_DEVICES names only
that GPU, so it is device 0), NCCL between ranks, bf16 weights with fp32 master weights in DeepSpeed's optimizer
(`precision`). On CPU the backend is gloo, the weights fp32, their forwards under bf16 autocast where the CPU has
native bf16 (`precision` auto: runtime/models.resolved_precision; bf16 weights trained worse there: models._load), and
the optimizer is torch's fused AdamW (DeepSpeedCPUAdam would JIT-compile for minutes; the fused kernel steps
SmolLM2-135M in 0.14 s on 2 cores, the default per-tensor loop in 0.8 s). GPUs step the same torch AdamW: DeepSpeed's
FusedAdam would JIT-build a CUDA extension (nvcc) that GPU nodes often lack, so `offload_states` (rl.vllm.sleep) moves
its states itself.
"""
import dataclasses
import math
import os
import socket
from pathlib import Path

import torch

from runtime.lora import apply_lora, resolve_targets
from runtime.models import model_dtype, release_cached_memory, weights_dtype


def ds_config(zero_stage: int, micro_batch_size: int, grad_accum: int, world_size: int, max_grad_norm: float,
              bf16: bool = False, offload_optimizer: bool = False) -> dict:
    zero = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": bf16},  # DeepSpeed's optimizer then keeps fp32 master weights
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def inference_ds_config(zero_stage: int, bf16: bool) -> dict:
    """A frozen model's engine: no optimizer; under ZeRO-3 its weights stay sharded across the ranks."""
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int):
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def init_process_group(backend: str, rank: int, rendezvous: dict) -> None:
    """torch.distributed's default group, which DeepSpeed then adopts, on a store that rank 0 serves at the
    rendezvous address. Rank 0 hands the store a socket bound to that address: a TCPStore that binds its own (as
    DeepSpeed's env:// rendezvous makes it) listens on every interface (`::`), whatever host it is given."""
    from deepspeed.constants import default_pg_timeout
    host, port, world_size = rendezvous["master_addr"], rendezvous["master_port"], rendezvous["world_size"]
    listen_fd = socket.create_server((host, port)).detach() if rank == 0 else None  # the store closes it
    store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=default_pg_timeout,
                                       master_listen_fd=listen_fd)
    device_id = torch.device("cuda", 0) if backend == "nccl" and world_size > 1 else None  # as DeepSpeed binds it
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                         timeout=default_pg_timeout, device_id=device_id)


@dataclasses.dataclass(frozen=True)
class Rank:
    """What a worker's `setup` gets besides the stage's Config: its place in the group and what it trains."""
    rank: int
    rendezvous: dict
    num_threads: int
    model_dir: str
    total_steps: int


class DeepSpeedWorker:
    """One rank of a DeepSpeed trainer, run as a Ray actor by `ActorGroup`."""
    TRAINS_HEAD = False  # does the model have a freshly initialised head that trains fully under LoRA?

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port free on it, where rank 0 serves the group's store (`init_process_group`)."""
        import ray
        address = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((address, 0))
            port = sock.getsockname()[1]
        return address, port

    def setup(self, cfg, rank: Rank) -> None:
        """Join the group's process group and build the engine (`build_engine`) from the stage's Config."""
        raise NotImplementedError

    def init_distributed(self, rank: int, rendezvous: dict, num_threads: int) -> None:
        import deepspeed
        torch.set_num_threads(num_threads)
        # LOCAL_RANK 0: Ray's CUDA_VISIBLE_DEVICES holds only the GPU(s) it gave this rank.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(rendezvous["world_size"]), LOCAL_RANK="0")
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        # Skip DeepSpeed's shared-memory comm op: on CPU it JIT-compiles for minutes and gloo is enough.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not torch.distributed.is_initialized():  # (a worker set up twice keeps its group)
            init_process_group(backend, rank, rendezvous)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        self.rank, self.world_size = rank, rendezvous["world_size"]

    def build_engine(self, cfg, rank: Rank, model_loader) -> None:
        """The DeepSpeed engine from the trainer keys of `cfg` (a TrainerConfig) and the model in rank.model_dir."""
        import deepspeed
        grad_accum = cfg.batch_size // (cfg.micro_batch_size * cfg.num_workers)
        self.dtype = model_dtype(cfg.precision)
        if cfg.offload_optimizer and not torch.cuda.is_available():
            raise ValueError("offload_optimizer moves optimizer states from GPU to CPU memory; on CPU set it to false")
        config = ds_config(cfg.zero_stage, cfg.micro_batch_size, grad_accum, self.world_size, cfg.max_grad_norm,
                           bf16=weights_dtype(self.dtype) == "bfloat16", offload_optimizer=cfg.offload_optimizer)
        torch.manual_seed(cfg.seed)
        if cfg.zero_stage == 3:
            # Keeps the HF config alive so from_pretrained partitions weights as they load (zero.Init): no rank ever
            # holds the whole model, and it loads in `precision`, never as a full fp32 copy.
            from transformers.integrations import HfDeepSpeedConfig
            self._hf_ds_config = HfDeepSpeedConfig(config)
        model = model_loader(rank.model_dir, self.dtype, cfg.attn_implementation)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.lora = cfg.lora_rank > 0
        if self.lora:
            targets = resolve_targets(model, cfg.lora_targets)
            trainable = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, targets, self.TRAINS_HEAD)
            print(f"[{type(self).__name__}] LoRA r{cfg.lora_rank} on {', '.join(targets)}: {trainable:,} of "
                  f"{sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters()):,} parameters train", flush=True)
        optimizer = torch.optim.AdamW(self.param_groups(model, cfg.learning_rate), lr=cfg.learning_rate,
                                      weight_decay=cfg.weight_decay, fused=True)
        scheduler = warmup_cosine(optimizer, cfg.warmup_steps, rank.total_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        self.zero_stage = cfg.zero_stage
        self.forward_micro_batch_size = cfg.forward_micro_batch_size

    def train_step(self, micro_batches: list) -> dict:
        """One optimizer step over this rank's micro-batches; returns the mean of each loss statistic."""
        totals: dict = {}
        for batch in micro_batches:
            loss, stats = self.loss(batch)  # stats: detached tensors, read once the step is done
            self.engine.backward(loss)
            self.engine.step()
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value) / len(micro_batches)
        totals["lr"] = self.scheduler.get_last_lr()[0]
        return totals

    def loss(self, batch) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def param_groups(self, model, learning_rate: float) -> list[dict]:
        """The optimizer's parameter groups; a subclass may give some parameters their own learning rate."""
        return [{"params": [p for p in model.parameters() if p.requires_grad], "lr": learning_rate}]

    def save_checkpoint(self, ckpt_dir: str, tag: str) -> None:
        """Model, optimizer and scheduler (DeepSpeed's own format, per rank) plus this rank's RNG states (CPU, and
        CUDA on GPUs)."""
        self.engine.save_checkpoint(ckpt_dir, tag=tag, save_latest=False)  # runtime/checkpoints.py keeps the pointer
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        torch.save(rng, Path(ckpt_dir) / tag / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {ckpt_dir}")
        rng = torch.load(Path(ckpt_dir) / tag / f"rng_rank{self.rank}.pt")
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def save_hf(self, out_dir: str, tokenizer_dir: str) -> None:
        """Write an HF `save_pretrained` directory (safetensors) from rank 0; all ranks must call it. The weights are
        walked one module at a time (weight_sync.hf_weights: under ZeRO-3 only that module's parameters are gathered,
        LoRA adapters folded into their layer) and rank 0 keeps a CPU copy of each: no rank ever holds the whole
        model on its device."""
        from runtime.weight_sync import hf_weights
        zero3 = self.zero_stage == 3
        state_dict = {}
        for name, tensor in hf_weights(self.engine.module, zero3):
            if self.rank == 0:  # a copy under ZeRO-3: the gathered tensor is freed with its module
                state_dict[name] = tensor.to("cpu", copy=zero3)
        if self.rank == 0:
            from runtime.models import load_tokenizer, record_remote_code, record_tokenizer_class, trusts_remote_code
            self.engine.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
            load_tokenizer(tokenizer_dir).save_pretrained(out_dir)
            record_remote_code(out_dir, trusts_remote_code(tokenizer_dir))
            record_tokenizer_class(out_dir)
        torch.distributed.barrier()

    def offload_states(self) -> None:
        """Free this rank's GPU memory while vLLM generates (rl.vllm.sleep, ZeRO-3): the gradient buffers, the fp32
        master weights and the optimizer's states go to CPU memory; the bf16 weights stay (the weight sync reads
        them). DeepSpeed's offload_states moves master weights and optimizer states only for its own FusedAdam (a
        CUDA build); the trainers step torch's AdamW, so those two are moved here."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
        pin = torch.cuda.is_available()  # page-locked for fast copies; DeepSpeed's CPU accelerator cannot pin
        self.engine.offload_states(include=[OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer],
                                   pin_memory=pin)
        self.offloaded = []
        if not self.engine.zero_use_cpu_optimizer():  # offload_optimizer: they are in CPU memory already
            for tensor in self.optimizer_tensors():
                host = torch.empty_like(tensor, device="cpu", pin_memory=pin).copy_(tensor)
                self.offloaded.append((tensor, tensor.device))
                tensor.data = host  # the same tensor object: the optimizer keeps its references
        release_cached_memory()

    def reload_states(self) -> None:
        """Undo offload_states before the trainer's next forward."""
        self.engine.reload_states()
        for tensor, device in self.offloaded:
            tensor.data = tensor.data.to(device)
        self.offloaded = []

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """ZeRO-3's fp32 master weights (the flat partitions the inner torch optimizer steps) and that optimizer's
        states (Adam's moments and step counts)."""
        zero = self.engine.optimizer
        states = [value for state in zero.optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
        return list(zero.fp32_partitioned_groups_flat) + states
