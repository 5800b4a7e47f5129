"""Weight sync of disaggregated placement for a ~100M-parameter random model: seconds per
bucket size, split into the gather from the FSDP2 shards (both trainers) and the bucketed
broadcast-and-load into the rollout rank's engine, against one raw `dist.broadcast` of the
same bytes; then the whole `placement.sync` (gather + broadcast + load, pipelined) as a run
does it. 2 trainer ranks + 1 rollout rank, CPU, gloo.

    torchrun --standalone --nproc-per-node 3 bench/weight_sync.py [--reps 3] [--buckets-mb 1 4 16 64 256 1024]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import placement  # noqa: E402
from assets.make import random_checkpoint
from engines.native import NativeEngine
from models.hf import read_config
from models.tokenizer import Tokenizer
from roles.actor import Actor  # noqa: E402
from roles.rollout import RemoteEngine, serve  # noqa: E402
from utils import dist  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--buckets-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
a = ap.parse_args()

rank, world, device = dist.init(timeout_s=900)
plan = placement.plan("disaggregate", rank, world, device, prompts_per_step=world - 1, rollout_ranks=1,
                      timeout_s=900)
holder = [tempfile.mkdtemp() if rank == 0 else None]
tdist.broadcast_object_list(holder)
path = os.path.join(holder[0], "rand-100m")
if rank == 0:
    random_checkpoint(path, vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
tdist.barrier()
sync_group, med = plan.weight_group, statistics.median


def timed(fn):
    tdist.barrier(group=sync_group)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


cfg = read_config(path)
if plan.role == "rollout":
    engine = NativeEngine(cfg, Tokenizer(path), device)
    specs = dist.recv_obj(0)
    shapes = {n: s for n, s, _ in specs}
    total = sum(torch.Size(s).numel() * d.itemsize for _, s, d in specs)
    flat = torch.empty(total // 4, dtype=torch.float32)
    results, bufs = {}, {}
    for mb in a.buckets_mb:
        buckets = dist.plan_buckets(specs, int(mb * 2**20))
        receive = lambda: dist.receive_buckets(buckets, shapes, 0, sync_group, device, bufs)  # noqa: E731
        recv = [timed(lambda: [None for _ in receive()]) for _ in range(a.reps)]
        load = [timed(lambda: engine.load_weights(receive())) for _ in range(a.reps)]
        results[mb] = (med(recv), med(load), len(buckets))
    raw = [timed(lambda: tdist.broadcast(flat, src=0, group=sync_group)) for _ in range(a.reps)]
    dist.wait_all(dist.isend_obj((results, med(raw)), 0))
    serve(plan, engine)  # the end-to-end part: placement.sync as a run does it
else:
    actor = Actor(path, plan.mesh, device, lr=1e-5, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0)
    specs = actor.weight_specs()
    total = sum(torch.Size(s).numel() * d.itemsize for _, s, d in specs)
    gather = []
    for _ in range(a.reps):
        tdist.barrier(group=plan.trainer_group)
        t = time.perf_counter()
        for _ in actor.full_weights():
            pass
        gather.append(time.perf_counter() - t)
    full = [(n, t.clone()) for n, t in actor.full_weights()]  # gathered once for the broadcast-only timings
    if rank == 0:
        dist.wait_all(dist.isend_obj(specs, world - 1))
        flat, bufs = torch.empty(total // 4, dtype=torch.float32), {}
        for mb in a.buckets_mb:
            buckets = dist.plan_buckets(specs, int(mb * 2**20))
            for _ in range(2 * a.reps):  # receive-only, then receive-and-load
                timed(lambda: dist.broadcast_buckets(full, buckets, 0, sync_group, device, bufs))
        for _ in range(a.reps):
            timed(lambda: tdist.broadcast(flat, src=0, group=sync_group))
        results, raw = dist.recv_obj(world - 1)
    del full
    e2e = {}
    for mb in a.buckets_mb:
        engine = RemoteEngine(plan, specs, int(mb * 2**20))
        e2e[mb] = med([placement.sync(plan, actor, engine, version=i)["sync_s"] for i in range(a.reps)])
    engine.close()
    if rank == 0:
        gb = total / 1e9
        print(f"\n{cfg.num_params() / 1e6:.1f}M params, {total / 2**20:.0f} MiB fp32; 2 trainers (FSDP2) "
              f"+ 1 rollout rank, CPU, gloo; median of {a.reps}")
        print(f"gather from FSDP2 shards (one block at a time, FSDP unshard): {med(gather):.3f} s")
        print(f"raw dist.broadcast of {total / 2**20:.0f} MiB in one call: {raw:.3f} s "
              f"= {gb / raw:.2f} GB/s\n")
        print(f"| {'bucket MiB':>10} | {'buckets':>7} | {'bcast s':>7} | {'bcast+load s':>12} "
              f"| {'GB/s':>5} | {'vs raw':>6} | {'sync s (run)':>12} |")
        print(f"|{'-' * 12}|{'-' * 9}|{'-' * 9}|{'-' * 14}|{'-' * 7}|{'-' * 8}|{'-' * 14}|")
        for mb in a.buckets_mb:
            recv, load, n = results[mb]
            print(f"| {mb:>10g} | {n:>7} | {recv:7.3f} | {load:12.3f} | {gb / load:5.2f} "
                  f"| {raw / load:6.0%} | {e2e[mb]:12.3f} |")
        print("\nbcast: broadcast of pre-gathered weights, received but not loaded; bcast+load: received and "
              "loaded into the native engine as each bucket lands; vs raw: the raw broadcast's rate over "
              "bcast+load's; sync s (run): placement.sync as train_grpo.py runs it (gather, broadcast and "
              "load pipelined)")
        shutil.rmtree(holder[0], ignore_errors=True)
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
