"""torch.distributed plumbing: process group set-up, FSDP2 sharding, metric reduction,
point-to-point messages between roles and the bucketed weight broadcast."""
import contextlib
import datetime
import math
import os
import pickle
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from utils import errors


def init(timeout_s: float = 300) -> tuple[int, int, torch.device]:
    """Join the torchrun world (a world of 1 when run as a plain script). gloo on CPU, NCCL on
    GPU. The timeout makes a dead peer fail its collectives instead of hanging forever."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    alone = "MASTER_ADDR" not in os.environ  # plain `python train_grpo.py`: a world of one
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # ranks on one machine share its cores: one intra-op pool per rank, not per core (RL_THREADS
        # sets it: torchrun's own OMP_NUM_THREADS=1 cannot be told from a user's)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        threads = int(os.environ.get("RL_THREADS", 0)) or (os.cpu_count() or 1) // local_world
        torch.set_num_threads(max(1, threads))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # our own key prefix per torchrun restart: after a rank dies and torchrun restarts the
        # workers, no key of the failed attempt (e.g. a dead rank's address) can be read back
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
        if alone:
            # port 0: the OS picks a free one as the store binds it (a port chosen beforehand,
            # e.g. from the pid, was taken by another process in one suite run: EADDRINUSE)
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
        else:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=rank == 0 and not agent, timeout=timeout)
        store = dist.PrefixStore(f"rl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world, device


def close():
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int = 0):
    """End a torchrun worker without interpreter finalization. gloo's worker threads can still
    be releasing tensors while Python finalizes; one that then needs the GIL is torn down
    inside C++ and the process aborts (seen in gdb: SIGABRT in pt_gloo_runloop, in about 1
    of 10 runs that resumed from a checkpoint). Everything is written and closed before this."""
    close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def vision_blocks(model) -> list:
    """A Qwen2-VL's vision blocks (models/qwen2_vl.py); none for a text model."""
    visual = getattr(model, "visual", None)
    return list(visual.blocks) if visual is not None else []


def _units(model):
    """FSDP2's units in gather order: the root's own parameters (embeddings, final norm, head, a
    vision tower's patch embedding and merger), then each vision block, then each decoder block.
    Yields (module, hf-name prefix, which of its names are its own)."""
    yield model, "", lambda name: not name.startswith(("model.layers.", "visual.blocks."))
    for i, block in enumerate(vision_blocks(model)):
        yield block, f"visual.blocks.{i}.", lambda name: True
    for i, block in enumerate(model.model.layers):
        yield block, f"model.layers.{i}.", lambda name: True


def full_tensors(model, exact: bool = False):
    """(hf_name, full tensor), one FSDP2 unit at a time through FSDP's own unshard: one
    all-gather per decoder block (not one per tensor: 5x faster on the tiny model), in the
    training param dtype (bf16 under a bf16 MixedPrecisionPolicy), so the extra memory is one
    block. A tensor is valid only until the next one is asked for (the block's memory is then
    freed): copy it, as the engines do. exact=True gathers tensor by tensor in the stored
    (fp32 master) dtype instead, into tensors of their own, for exports. Every rank of the
    mesh must iterate in step (the gathers are collectives)."""
    for module, prefix, own in _units(model):
        if exact or not hasattr(module, "unshard"):
            for name, p in module.named_parameters():
                t = p.detach()
                if own(name):
                    yield prefix + name, (t.full_tensor() if hasattr(t, "full_tensor") else t)
            continue
        module.unshard()  # registers the unsharded parameters until reshard
        for name, p in module.named_parameters():
            if own(name):
                yield prefix + name, p.detach()
        module.reshard()


def weight_specs(model, param_dtype=None) -> list[tuple[str, tuple, torch.dtype]]:
    """(hf_name, full shape, dtype) of every parameter, in `full_tensors` order and dtype."""
    return [(prefix + name, tuple(p.shape), param_dtype if param_dtype and p.is_floating_point() else p.dtype)
            for module, prefix, own in _units(model) for name, p in module.named_parameters() if own(name)]


# ---- weight sync in buckets (disaggregate) ----

def plan_buckets(specs, bucket_bytes: int) -> list[tuple[torch.dtype, int, list[tuple[str, int, int]]]]:
    """Cut the flattened parameters, in order, into buckets of at most `bucket_bytes`, one
    dtype per bucket (a dtype change closes the bucket). Returns (dtype, numel, pieces) per
    bucket, pieces (name, start, stop) being element ranges of the flattened tensor; a
    tensor larger than a bucket spans several. Sender and receivers compute the same plan
    from the same specs, so only the bucket payloads travel."""
    buckets, cur = [], None
    for name, shape, dtype in specs:
        numel, start = math.prod(shape), 0
        cap = max(1, bucket_bytes // dtype.itemsize)  # elements per bucket
        while start < numel:
            if cur is None or cur[0] != dtype or cur[1] == cap:
                cur = [dtype, 0, []]
                buckets.append(cur)
            take = min(numel - start, cap - cur[1])
            cur[2].append((name, start, start + take))
            cur[1] += take
            start += take
    return [tuple(b) for b in buckets]


def _buffers(bufs: dict, buckets, device) -> dict:
    """Two reusable buffers per dtype, as large as that dtype's largest bucket, kept in the
    caller's `bufs` across syncs: fresh memory per bucket costs more in page faults than the
    broadcast itself (measured on CPU: 0.2 s per 382 MiB, the raw broadcast 0.24 s)."""
    for dtype in {d for d, _, _ in buckets}:
        numel = max(n for d, n, _ in buckets if d == dtype)
        if dtype not in bufs or bufs[dtype][0].numel() < numel:
            bufs[dtype] = [torch.empty(numel, dtype=dtype, device=device) for _ in range(2)]
    return bufs


class OwnGroup:
    """A gloo group of its own, outside torch.distributed's world: the weight-transfer group of
    trainer 0 (rank 0, which hosts its store) and vLLM's workers, which live in processes that
    never join the torchrun world. Rank 0 makes it in two halves: `host` opens the store (its
    port, chosen by the OS, is then sent to the others), `join` waits for every rank."""

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.pg = None

    @classmethod
    def host(cls, world: int, timeout_s: float) -> "OwnGroup":
        store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, 0, world, timeout_s)

    @classmethod
    def connect(cls, address: str, port: int, rank: int, world: int, timeout_s: float) -> "OwnGroup":
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
        return cls(store, rank, world, timeout_s).join()

    @property
    def port(self) -> int:
        return self.store.port

    def join(self) -> "OwnGroup":
        """Blocks until every rank has joined (or the timeout passes)."""
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("weights", self.store), self.rank, self.world,
                                        datetime.timedelta(seconds=self.timeout_s))
        return self

    def broadcast(self, tensor, src: int):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)


def _poster(src: int, group):
    """buf -> an async broadcast of it from `src`, on a group of the world or an OwnGroup."""
    if isinstance(group, OwnGroup):
        return lambda buf: group.broadcast(buf, src)
    return lambda buf: dist.broadcast(buf, src=src, group=group, async_op=True)


@contextlib.contextmanager
def one_thread():
    """torch's CPU ops on one thread: after each parallel copy its idle OpenMP threads spin for
    a while, taking the cores that gloo's send and receive threads need (measured on 2 cores:
    a 382 MiB bucketed broadcast in 0.35 s with them, 0.13 s without; the raw broadcast 0.08 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def broadcast_buckets(weights, buckets, src: int, group, device, bufs: dict):
    """Sender side: copy the (name, tensor) stream, in plan order, into a bucket buffer and
    broadcast it; the next bucket is filled while the previous one is on the wire (two
    buffers). Extra memory: two buckets plus the tensor being copied."""
    weights, bufs, post = iter(weights), _buffers(bufs, buckets, device), _poster(src, group)
    flat, in_flight = None, None
    for i, (dtype, numel, pieces) in enumerate(buckets):
        buf, off = bufs[dtype][i % 2][:numel], 0
        for piece, start, stop in pieces:
            if start == 0:
                name, tensor = next(weights)
                if name != piece:
                    raise RuntimeError(f"weight stream out of order: got {name}, the bucket plan expects "
                                       f"{piece}")
                flat = tensor.detach().reshape(-1)
            with one_thread():  # not the stream's own work (an FSDP gather, say)
                buf[off:off + stop - start].copy_(flat[start:stop])
            off += stop - start
        work = post(buf)
        if in_flight is not None:
            in_flight.wait()  # the buffer it used is filled again only after this
        in_flight = work
    if in_flight is not None:
        in_flight.wait()
    if next(weights, None) is not None:
        raise RuntimeError("the weight stream has more tensors than the bucket plan")


def measured(weights, stats: dict):
    """The (name, tensor) stream, adding the seconds spent producing it and its bytes to `stats`."""
    while True:
        t = time.perf_counter()
        item = next(weights, None)
        stats["sync_gather_s"] += time.perf_counter() - t
        if item is None:
            return
        stats["sync_bytes"] += item[1].numel() * item[1].element_size()
        yield item


class KeptBuffers:
    """Receive memory for a consumer that keeps the received tensors for a while (vLLM's
    layerwise reload holds each layer's weights until the layer is complete), reused across
    syncs: a buffer is handed out again only once no tensor references its memory any more
    (its storage's use count is back to the pool's own). Fresh memory each sync cost more in
    page faults than the broadcast itself (on CPU: 382 MiB in 0.25 s, the raw broadcast 0.1 s).
    Holds at most what was alive at once (two buckets in flight, the tensors the consumer
    kept, tensors spanning buckets), by (dtype, numel): the same plan asks for the same sizes."""

    def __init__(self, device):
        self.device, self.free = device, {}

    @staticmethod
    def _users(buf) -> int:
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)

    def take(self, dtype, numel: int):
        pool = self.free.setdefault((dtype, numel), [])
        for buf, alone in pool:
            if self._users(buf) == alone:
                return buf[:]  # a view: it holds the memory (its use count) until it is dropped
        buf = torch.empty(numel, dtype=dtype, device=self.device)
        pool.append((buf, self._users(buf)))
        return buf[:]


def receive_buckets(buckets, shapes: dict, src: int, group, device, bufs):
    """Receiver side: yields (name, full tensor) as soon as its last piece has arrived, so the
    engine loads bucket by bucket while the next bucket is being received (two in flight). With
    `bufs` a dict, the tensors are views of a buffer that is reused two buckets later: copy each
    before asking for the next. With `bufs` a KeptBuffers, each bucket lands in memory that no
    earlier tensor still uses, so the tensors stay valid for a consumer that keeps them (vLLM's
    layerwise reload) without a copy. A tensor spanning buckets is assembled in memory of its own."""
    partial, post, landing, direct = {}, _poster(src, group), {}, set()
    kept = bufs if isinstance(bufs, KeptBuffers) else None
    if kept is None:
        bufs = _buffers(bufs, buckets, device)
    own = kept.take if kept else lambda dtype, numel: torch.empty(numel, dtype=dtype, device=device)

    def assembled(name, dtype):
        if name not in partial:
            partial[name] = own(dtype, math.prod(shapes[name]))
        return partial[name]

    def receive(i):
        dtype, numel, pieces = buckets[i]
        name, start, stop = pieces[0]
        if len(pieces) == 1 and stop - start < math.prod(shapes[name]):  # a slice of a tensor spanning
            direct.add(i)  # buckets: straight into its place, no copy
            landing[i] = assembled(name, dtype)[start:stop]
        else:
            landing[i] = own(dtype, numel) if kept else bufs[dtype][i % 2][:numel]
        return post(landing[i])

    works = [receive(i) for i in range(min(2, len(buckets)))]
    for i, (dtype, numel, pieces) in enumerate(buckets):
        works[i].wait()
        buf, off = landing.pop(i), 0
        for name, start, stop in pieces:
            total, chunk = math.prod(shapes[name]), buf[off:off + stop - start]
            off += stop - start
            if start == 0 and stop == total:
                yield name, chunk.view(shapes[name])
                continue
            if i not in direct:
                with one_thread():
                    assembled(name, dtype)[start:stop] = chunk
            if stop == total:
                yield name, partial.pop(name).view(shapes[name])
        del buf, chunk
        if i + 2 < len(buckets):
            works.append(receive(i + 2))  # with a dict: into this bucket's buffer, its tensors copied out


# ---- a sharded state as a stream of whole tensors and back (placement.reshard: a move in process) ----

@dataclass
class Slot:
    """Where a tensor sits in a state outline: its place in the stream, its shape, and its
    DTensor placements (FSDP2: Shard(0); None for a plain tensor, such as Adam's step count)."""
    index: int
    shape: tuple
    dtype: torch.dtype
    placements: tuple | None


def outline(value, tensors: list, seen: dict | None = None):
    """A nested dict with each tensor replaced by its Slot, the tensors appended to `tensors` in
    walk order (one that appears twice, a tied head, once); everything else (numbers, lists,
    strings) stays: it pickles, the tensors do not."""
    seen = {} if seen is None else seen
    if isinstance(value, dict):
        return {k: outline(v, tensors, seen) for k, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) not in seen:
        tensors.append(value)
        placements = tuple(value.placements) if isinstance(value, DTensor) else None
        seen[id(value)] = Slot(len(tensors) - 1, tuple(value.shape), value.dtype, placements)
    return seen[id(value)]


def slots(shape) -> list[Slot]:
    """An outline's Slots, in stream order, each once."""
    found = {}

    def walk(node):
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, Slot):
            found.setdefault(node.index, node)

    walk(shape)
    return [found[i] for i in sorted(found)]


def filled(shape, tensors: dict):
    """The outline with each Slot replaced by tensors[its index]."""
    if isinstance(shape, dict):
        return {k: filled(v, tensors) for k, v in shape.items()}
    return tensors[shape.index] if isinstance(shape, Slot) else shape


def own_part(full: torch.Tensor, slot: Slot, mesh, device) -> torch.Tensor:
    """This rank's part of a full tensor on `mesh`: its slice by the Slot's placements as a DTensor
    (sliced here, no traffic: every rank holds `full`), or a copy of a plain tensor."""
    full = full.to(device)
    if slot.placements is None:
        return full.clone()
    local = distribute_tensor(full, mesh, slot.placements, src_data_rank=None).to_local().clone()
    return DTensor.from_local(local, mesh, slot.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def destroy_groups(groups):
    """Destroy the groups among `groups` that this rank is a member of, the default group aside (a
    mesh over the whole world is built on it)."""
    for group in groups:
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER, dist.group.WORLD):
            dist.destroy_process_group(group)


# ---- messages between roles (disaggregate): pickled objects over point-to-point send/recv ----
# The peers are ranks of this same job (trusted), and the payloads are small: prompts,
# sampling settings, samples. Weights never go this way.

def isend_obj(obj, dst: int, group=None) -> list:
    """Non-blocking send; keep the returned handles (they hold the buffers) and `wait_all`
    them once the peer has surely received (gloo's sends report completion only in wait)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    return [(dist.isend(size, dst, group=group), size), (dist.isend(data, dst, group=group), data)]


def recv_obj(src: int, group=None):
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return pickle.loads(data.numpy().tobytes())


def recv_or_fail(src: int, awaited: str, group=None):
    """`recv_obj`, or one RuntimeError that names the peer and what was awaited: a peer that died
    closes its connections (at once), one that hangs runs past the group's timeout."""
    try:
        return recv_obj(src, group)
    except RuntimeError as e:
        raise RuntimeError(f"rank {src} stopped answering while this rank waited for {awaited}: it died or "
                           f"hung (see its output above). This rank stops too. {errors.newest_checkpoint()} "
                           f"({str(e)[:200]})") from e


def wait_all(handles: list) -> list:
    for work, _ in handles:
        work.wait()
    return []


def peak_memory_gib(device) -> float:
    """Peak GPU memory allocated on a GPU, else this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


_memory_start = [0.0]  # the peak before the models loaded (the interpreter, torch, the data)


def mark_memory_start(device):
    """Called once, before any model loads: what the run adds is measured from here."""
    _memory_start[0] = peak_memory_gib(device)


def memory_added_gib(device) -> float:
    """The peak this run's models and steps added (the memory plan estimates this)."""
    return peak_memory_gib(device) - _memory_start[0]


def reduce(values: dict, op=dist.ReduceOp.SUM, group=None) -> dict[str, float]:
    """Reduce each metric over ranks with one all_reduce; returns Python floats (log time only)."""
    names = sorted(values)
    t = torch.tensor([float(values[k]) for k in names], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)
    return dict(zip(names, t.tolist()))
