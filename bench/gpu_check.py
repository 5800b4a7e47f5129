"""One prepared GPU check (issue 3): bf16 GRPO steps on a random Qwen2.5-0.5B-shaped model (built
from a config, nothing downloaded), native-engine decode tokens/s at batch 64, and peak GPU
memory against the memory plan; the same steps with --compile (issue 20); then, where vLLM is
installed (issue 18), colocate GRPO steps on a vLLM engine (sleep during training, wake for the
update through the inproc weight transfer): the log-prob gap in bf16, the update seconds, and
the device memory in use with the engine awake and asleep; vLLM's nccl backend (disaggregate)
when there are two GPUs; and (issue 34) the GRPO step at bench/grpo_vs_trl.py's three model
sizes, native and vLLM engines, with its generate and train seconds. Meant for one call on a
lent H200, well under 8 minutes:

    python bench/gpu_check.py                 # on the GPU machine
    python bench/gpu_check.py --cpu-smoke     # the same code path, tiny shape, on CPU (CI-sized)

MFU divides model FLOPs by the device's dense bf16 rate (--peak-tflops, 790 for the H200 as
the device notes report). Train FLOPs = 6 * N * (prompt + completion tokens); decode FLOPs
= 2 * N per new token (+ attention), N = matmul weights incl. lm_head.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from assets.make import make_tokenizer
from engines.decode import SamplingParams
from engines.native import NativeEngine
from memory import trainer_gib
from models.config import ModelConfig
from models.decoder import flops_per_token
from models.hf import build, iter_checkpoint, read_config, save_model
from models.tokenizer import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--cpu-smoke", action="store_true")
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--peak-tflops", type=float, default=790.0)
ap.add_argument("--vllm-memory", default=None, help="internal: a vLLM engine's memory on this checkpoint")
ap.add_argument("--sizes", nargs="+", default=["256x4", "512x8", "1024x8"],
                help="HIDDENxLAYERS: bench/grpo_vs_trl.py's model sizes, timed here too (native and vLLM)")
PARTS = ["decode", "steps", "sizes", "vllm"]
ap.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS,
                help="what to run: decode tokens/s (CUDA graph and eager steps), the 0.5B GRPO steps (eager "
                     "and --compile), bench/grpo_vs_trl.py's sizes, vLLM")
args = ap.parse_args()


def vllm_memory(path: str):
    """In a process of its own: device memory in use with a vLLM engine awake, then asleep (level 2),
    and the seconds of one weight update (wake + inproc transfer)."""
    from engines.vllm_engine import VLLMEngine
    from utils import dist

    dist.init(timeout_s=300)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    engine = VLLMEngine(path, Tokenizer(path), dev, torch.bfloat16, max_model_len=256,
                        gpu_memory_utilization=0.3)

    def used() -> float:
        if dev != "cuda":
            return 0.0
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    weights = [(n, t.to(dev)) for n, t in iter_checkpoint(path)]
    engine.load_weights(iter(weights))  # warm-up
    awake = used()
    engine.release()
    asleep = used()
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    engine.version = 1
    engine.load_weights(iter(weights))
    if dev == "cuda":
        torch.cuda.synchronize()
    update_s = time.perf_counter() - t
    engine.close()
    print(json.dumps({"awake_gib": awake, "asleep_gib": asleep, "update_s": update_s}), flush=True)
    dist.exit_now(0)


if args.vllm_memory:
    vllm_memory(args.vllm_memory)
gpu = not args.cpu_smoke
device = "cuda" if gpu else "cpu"
shape = (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6)  # Qwen2.5-0.5B
         if gpu else dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32))
path = tempfile.mkdtemp()
eos = make_tokenizer(path)
cfg = ModelConfig(**shape, tie_word_embeddings=True, eos_token_id=eos)
t = time.time()
model = build(cfg, device)
model.init_weights(seed=0)
save_model(model, cfg, path, dtype=torch.bfloat16)
del model
print(f"checkpoint: {cfg.num_params() / 1e6:.0f}M params in {time.time() - t:.0f}s", flush=True)

# decode: batch 64 (8 prompts x 8 samples), 128 new tokens, EOS off; each step replayed as a CUDA
# graph (the engine's default on a GPU) and eager (NativeEngine.graphs emptied); their greedy tokens
roof = args.peak_tflops * 1e12
if "decode" in args.parts:
    eng = NativeEngine(cfg, Tokenizer(path), device, torch.bfloat16)
    eng.eos = torch.tensor([-1], device=device)
    eng.load_weights(iter_checkpoint(path))
    prompts = torch.randint(0, 200, (8, 32)).tolist()
    sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=128 if gpu else 16)
    greedy = SamplingParams(temperature=0, max_new_tokens=sp.max_new_tokens)
    dec_flops = sum(flops_per_token(cfg, 32 + i) for i in range(sp.max_new_tokens)) * 64
    decode = {}
    for graphs in ("CUDA graph", "eager"):
        eng.graphs = ("cuda",) if graphs == "CUDA graph" else ()
        eng.generate(prompts, sp, list(range(8)))  # warm-up
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = eng.generate(prompts, sp, list(range(8)))
        if gpu:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t
        decode[graphs] = (int(out.lengths.sum()), secs, eng.generate(prompts, greedy, [0] * 8))
    del eng
    print(f"\ndecode, batch 64, {sp.max_new_tokens} new tokens, bf16, {cfg.num_params() / 1e6:.0f}M params")
    print(f"| {'steps':<10} | {'tokens/s':>9} | {'MFU':>6} |\n|{'-' * 12}|{'-' * 11}|{'-' * 8}|")
    for graphs, (tokens, secs, _) in decode.items():
        print(f"| {graphs:<10} | {tokens / secs:9.0f} | {dec_flops / secs / roof:6.2%} |")
    g, e = decode["CUDA graph"][2], decode["eager"][2]
    alike = lambda x: f"{x.float().mean():.0%}"  # noqa: E731
    print(f"greedy (batch 8): rows alike {alike((g.tokens == e.tokens).all(-1))}, first tokens alike "
          f"{alike(g.tokens[:, 0] == e.tokens[:, 0])}, log-prob gap over the first 8 tokens "
          f"{(g.logprobs[:, :8] - e.logprobs[:, :8]).abs().max():.4f}", flush=True)

# GRPO steps in bf16 through the real script (one rank)
run = os.path.join(path, "run")
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "train_grpo.py",
       "--model", path, "--param-dtype", "bfloat16", "--engine", "native", "--steps", str(args.steps),
       "--prompts-per-step", "16", "--num-generations", "8", "--max-new-tokens", "128" if gpu else "16",
       "--micro-batch-size", "16", "--eval-every", "0", "--save-every", "0", "--no-save-final",
       "--lr", "1e-6", "--run-dir", run]
if "steps" in args.parts:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    if p.returncode:
        sys.exit(p.stdout[-2000:] + p.stderr[-4000:])
    rows = [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if not r.get("final")]
    rows = rows[1:]  # the first step is the warm-up
    train_s = sorted(r["perf/train_s"] for r in rows)[len(rows) // 2]
    gen_s = sorted(r["perf/generate_s"] for r in rows)[len(rows) // 2]
    response_len = sorted(r["rollout/response_len"] for r in rows)[len(rows) // 2]
    seq_tokens = 16 * 8 * (10 + response_len)  # ~10-token prompts
    train_flops = 3 * flops_per_token(cfg, 64) * seq_tokens  # forward + backward = 3 forwards
    peak = max(r["perf/peak_mem_gib"] for r in rows)
    print(f"\n{'GPU' if gpu else 'CPU smoke'}: {torch.cuda.get_device_name() if gpu else 'cpu'}, "
          f"{cfg.num_params() / 1e6:.0f}M params, bf16, GRPO steps of 16 x 8")
    print(f"| {'figure':<34} | {'value':>12} |\n|{'-' * 36}|{'-' * 14}|")
    print(f"| {'train step s (median, 128 seqs)':<34} | {train_s:12.3f} |")
    print(f"| {'train-step MFU':<34} | {train_flops / train_s / roof:12.2%} |")
    print(f"| {'generate s in the GRPO step':<34} | {gen_s:12.3f} |")
    print(f"| {'peak memory GiB (GPU; RSS on CPU)':<34} | {peak:12.2f} |")
    said = trainer_gib(p.stdout)
    added = max(r["perf/peak_mem_added_gib"] for r in rows)
    print(f"| {'memory plan GiB (memory.py)':<34} | {said:12.2f} |")
    print(f"| {'measured GiB over start-up':<34} | {added:12.2f} |")

    # --compile (issue 20): the same steps with each decoder block under torch.compile
    crun = os.path.join(path, "crun")
    ccmd = [*cmd[:cmd.index("--run-dir")], "--compile", "--run-dir", crun]
    p = subprocess.run(ccmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    if p.returncode:
        sys.exit(p.stdout[-2000:] + p.stderr[-4000:])
    crows = [r for r in map(json.loads, open(os.path.join(crun, "metrics.jsonl"))) if not r.get("final")]
    ctrain_s = sorted(r["perf/train_s"] for r in crows[1:])[len(crows[1:]) // 2]
    eager_first = json.loads(open(os.path.join(run, "metrics.jsonl")).readline())["perf/train_s"]
    first = f"{crows[0]['perf/train_s']:.1f} ({eager_first:.1f})"
    print(f"| {'--compile: first train s (eager)':<34} | {first:>12} |")
    print(f"| {'--compile: train step s (median)':<34} | {ctrain_s:12.3f} |")


def bench_size(size: str, engine: str) -> dict:
    """bench/grpo_vs_trl.py's step at one of its sizes (a random Qwen2 of HIDDENxLAYERS, vocabulary
    1024, tied head; 8 prompts x 8 samples x 64 new tokens, every group scored by a parity reward
    so that every row trains) in bf16 on one GPU: medians of the steps after the first."""
    hidden, layers = map(int, size.split("x"))
    spath = os.path.join(path, f"size-{size}")
    if not os.path.exists(os.path.join(spath, "config.json")):
        seos = make_tokenizer(spath, vocab_size=1024)
        scfg = ModelConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=hidden // 4, tie_word_embeddings=True, eos_token_id=seos)
        m = build(scfg, device)
        m.init_weights(seed=0)
        save_model(m, scfg, spath, dtype=torch.bfloat16)
        del m
    srun = os.path.join(spath, f"run-{engine}")
    scmd = [*cmd[:cmd.index("--model")], "--model", spath, "--param-dtype", "bfloat16", "--engine", engine,
            "--steps", str(args.steps), "--prompts-per-step", "8", "--num-generations", "8",
            "--max-new-tokens", "64", "--eval-every", "0", "--save-every", "0", "--no-save-final",
            "--lr", "1e-5", "--rewards", "bench.common:parity_reward", "--run-dir", srun]
    p = subprocess.run(scmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    if p.returncode:
        sys.exit(p.stdout[-2000:] + p.stderr[-4000:])
    rows = [r for r in map(json.loads, open(os.path.join(srun, "metrics.jsonl"))) if not r.get("final")][1:]
    med = lambda key: sorted(r[key] for r in rows)[len(rows) // 2]  # noqa: E731
    return {"params": read_config(spath).num_params(), "step": med("perf/step_s"),
            "gen": med("perf/generate_s"), "train": med("perf/train_s"),
            "mem": max(r["perf/peak_mem_gib"] for r in rows)}


import importlib.util  # noqa: E402

engines = ["native"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])
if "sizes" in args.parts:
    print(f"\nbench/grpo_vs_trl.py's sizes, one {'GPU' if gpu else 'CPU'}, bf16 (8 x 8 x 64; medians)")
    print(f"| {'model':<16} | {'engine':<6} | {'s/step':>7} | {'generate s':>10} | {'train s':>7} "
          f"| {'peak GiB':>8} |")
    print(f"|{'-' * 18}|{'-' * 8}|{'-' * 9}|{'-' * 12}|{'-' * 9}|{'-' * 10}|")
    for size in args.sizes if gpu else args.sizes[:1]:  # the smoke run: the smallest, to keep it short
        for engine in engines:
            r = bench_size(size, engine)
            model = f"{r['params'] / 1e6:.1f}M ({size})"
            print(f"| {model:<16} | {engine:<6} | {r['step']:7.3f} | {r['gen']:10.3f} "
                  f"| {r['train']:7.3f} | {r['mem']:8.2f} |", flush=True)


# vLLM (issue 18): colocate GRPO steps on a vLLM engine, its memory awake and asleep, and nccl when it can
if "vllm" not in args.parts:
    sys.exit(0)
if importlib.util.find_spec("vllm") is None:
    print("\nvLLM: not installed here, skipped (pip install -r requirements-vllm-gpu.txt)")
    sys.exit(0)
vrun = os.path.join(path, "vrun")
vcmd = [c if c != "native" else "vllm" for c in cmd]
vcmd[vcmd.index("--run-dir") + 1] = vrun
p = subprocess.run(vcmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
if p.returncode:
    sys.exit(p.stdout[-2000:] + p.stderr[-4000:])
vrows = [r for r in map(json.loads, open(os.path.join(vrun, "metrics.jsonl"))) if not r.get("final")][1:]
med = lambda key: sorted(r[key] for r in vrows)[len(vrows) // 2]  # noqa: E731
p = subprocess.run([sys.executable, os.path.abspath(__file__), "--vllm-memory", path], cwd=ROOT,
                   capture_output=True, text=True, timeout=300)
if p.returncode:
    sys.exit(p.stderr[-4000:])
mem = json.loads(p.stdout.strip().splitlines()[-1])
print(f"\nvLLM, colocate (inproc weight transfer{', sleep level 2 while training' if gpu else ''})")
print(f"| {'figure':<44} | {'value':>12} |\n|{'-' * 46}|{'-' * 14}|")
gap_max = max(r["train/logprob_gap_max"] for r in vrows)
print(f"| {'train/logprob_gap_max (bf16, worst step)':<44} | {gap_max:12.4f} |")
print(f"| {'train/logprob_gap_mean (median step)':<44} | {med('train/logprob_gap_mean'):12.5f} |")
print(f"| {'weight update s in the step (perf/sync_s)':<44} | {med('perf/sync_s'):12.3f} |")
print(f"| {'generate s in the GRPO step':<44} | {med('perf/generate_s'):12.3f} |")
print(f"| {'one update alone s (wake + transfer)':<44} | {mem['update_s']:12.3f} |")
print(f"| {'device GiB in use, engine awake':<44} | {mem['awake_gib']:12.2f} |")
print(f"| {'device GiB in use, engine asleep':<44} | {mem['asleep_gib']:12.2f} |")
if not gpu or torch.cuda.device_count() < 2:
    print(f"\nvLLM's nccl backend (disaggregate) needs two GPUs (NCCL refuses two ranks on one device); "
          f"this machine has {torch.cuda.device_count() if gpu else 0}: not run")
else:
    drun = os.path.join(path, "drun")
    one = vcmd.index("--nproc-per-node=1")
    dcmd = [*vcmd[:one], "--nproc-per-node=2", *vcmd[one + 1:], "--placement", "disaggregate",
            "--rollout-ranks", "1"]
    dcmd[dcmd.index("--run-dir") + 1] = drun
    p = subprocess.run(dcmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    if p.returncode:
        sys.exit(p.stdout[-2000:] + p.stderr[-4000:])
    drows = [r for r in map(json.loads, open(os.path.join(drun, "metrics.jsonl"))) if not r.get("final")][1:]
    sync_s = sorted(r["perf/sync_s"] for r in drows)[len(drows) // 2]
    print(f"\nvLLM, disaggregate over nccl: perf/sync_s {sync_s:.3f}, "
          f"train/logprob_gap_max {max(r['train/logprob_gap_max'] for r in drows):.4f}")
