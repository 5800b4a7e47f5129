"""The decode step under torch.compile over a static KV cache (gpt-fast's pattern) against the
native engine's eager step (engines/decode.py FusedDecoder.decode: oneDNN-packed weights, the
cache's filled length only), on the same random Qwen2, batch 64, 12-token prompts, 64 new tokens.

    python bench/decode_compiled.py                        # 19M params (hidden 512, 8 layers)
    python bench/decode_compiled.py --hidden 256 --layers 4
    python bench/decode_compiled.py --device cuda --dtype bfloat16   # on a GPU: CUDA graphs too

The static step attends over the whole cache with an additive mask (a -inf bias past the fill level)
and writes each new key and value at a position held in a tensor, so its shapes never change and it
compiles once (fullgraph, dynamic=False). Three rows: the eager step, the static step eager, and the
static step compiled (inductor), medians of --reps alternating runs, with each one's share of this
machine's matmul roof (fp32 on the CPU; on a GPU the run's dtype, a 8192^3 matmul). On a GPU the
compiled step also replays as one CUDA graph (mode "reduce-overhead", the cache marked as a static
address so that the graph may write it): the launch overhead a compiled step removes.
"""
import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from common import matmul_gflops, print_table, qwen2_checkpoint, sync

from engines.native import NativeEngine
from models.decoder import KVCache, flops_per_token
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--hidden", type=int, default=512)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--device", default="cpu")
ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
args = ap.parse_args()
dev, dtype = args.device, getattr(torch, args.dtype)

path = tempfile.mkdtemp()
qwen2_checkpoint(path, hidden=args.hidden, layers=args.layers)
cfg = read_config(path)
eng = NativeEngine(cfg, Tokenizer(path), dev, dtype)
eng.load_weights(iter_checkpoint(path))
B, P, T = 64, 12, 64
dec = eng.decoder
dec.prepare(rows=B)
H, KV, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
G, L = H // KV, P + T
# the static step's weights: plain tensors (inductor takes no oneDNN-packed ones), each RMSNorm folded in
weights = [(wqkv * ln1.weight, bqkv, wo, bo, wgu * ln2.weight, wd)
           for ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd, _ in dec.layers]
head = dec.lm_head * dec.norm.weight


def static_step(tok, pos, write, bias, kc, vc):
    """tok, pos [B]; write [1] the cache slot; bias [B, 1, L] additive; kc, vc [layers, B, KV, L, D]."""
    freqs = pos[:, None].float() * dec.inv_freq  # [B, D/2]
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None].to(dtype)  # [B, 1, D]
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None].to(dtype)
    h = F.embedding(tok, dec.embed)  # [B, h]
    bias = bias.expand(B, KV, L).reshape(B * KV, 1, L)
    for i, (wqkv, bqkv, wo, bo, wgu, wd) in enumerate(weights):
        qkv = F.linear(F.rms_norm(h, h.shape[-1:], None, eps), wqkv, bqkv).view(B, H + 2 * KV, D)
        qk = qkv[:, :H + KV] * cos + qkv[:, :H + KV].roll(D // 2, -1) * sin
        kc[i].index_copy_(2, write, qk[:, H:, None])
        vc[i].index_copy_(2, write, qkv[:, H + KV:, None])
        s = torch.baddbmm(bias, qk[:, :H].reshape(B * KV, G, D), kc[i].reshape(B * KV, L, D).transpose(1, 2),
                          alpha=D ** -0.5)  # [B*KV, G, L]
        h = h + F.linear(torch.bmm(s.softmax(-1), vc[i].reshape(B * KV, L, D)).view(B, H * D), wo, bo)
        gate, up = F.linear(F.rms_norm(h, h.shape[-1:], None, eps), wgu).chunk(2, -1)
        h = h + F.linear(F.silu(gate) * up, wd)
    return F.linear(F.rms_norm(h, h.shape[-1:], None, eps), head)  # [B, V]


compiled_step = torch.compile(static_step, fullgraph=True, dynamic=False)
graphed_step = torch.compile(static_step, fullgraph=True, dynamic=False, mode="reduce-overhead")


def eager(_=None):
    cache = KVCache(cfg, B, L, dev, dtype)
    cache.pos = P
    bias = torch.zeros(B, 1, L, device=dev, dtype=dtype)
    tok, pos = torch.randint(0, cfg.vocab_size, (B,), device=dev), torch.full((B,), P, device=dev)
    with torch.inference_mode():
        for t in range(T - 1):
            dec.decode(tok, pos, bias[:, :, :P + t + 1], cache)
            pos += 1


def static(step):
    kc = torch.zeros(cfg.num_hidden_layers, B, KV, L, D, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    if step is graphed_step:  # a CUDA graph may write an input only if its address never changes
        torch._dynamo.mark_static_address(kc)
        torch._dynamo.mark_static_address(vc)
    bias = torch.full((B, 1, L), float("-inf"), device=dev, dtype=dtype)
    bias[:, :, :P] = 0
    tok, pos = torch.randint(0, cfg.vocab_size, (B,), device=dev), torch.full((B,), P, device=dev)
    write = torch.tensor([P], device=dev)
    with torch.inference_mode():
        for t in range(T - 1):
            bias[:, :, P + t] = 0
            step(tok, pos, write, bias, kc, vc)
            pos += 1
            write += 1


gpu = torch.device(dev).type == "cuda"
runs = {"eager step (the engine's)": (eager, None), "static step, eager": (static, static_step),
        "static step, compiled": (static, compiled_step)}
if gpu:
    runs["static step, compiled + CUDA graph"] = (static, graphed_step)
compile_s = {}
for name, (fn, step) in runs.items():  # the first run of each: the compile, and warm-up for the others
    t = time.perf_counter()
    fn(step)
    sync(dev)
    compile_s[name] = time.perf_counter() - t
times = {name: [] for name in runs}
for _ in range(args.reps):
    for name, (fn, step) in runs.items():
        sync(dev)
        t = time.perf_counter()
        fn(step)
        sync(dev)
        times[name].append(time.perf_counter() - t)
flops = sum(flops_per_token(cfg, P + t) for t in range(1, T)) * B
roof = matmul_gflops(8192, device=dev, dtype=dtype) if gpu else matmul_gflops()
firsts = ", ".join(f"{name} {s:.1f} s" for name, s in compile_s.items() if "compiled" in name)
print(f"\nQwen2 {cfg.num_params() / 1e6:.1f}M params, batch {B}, {T - 1} decode steps, {args.dtype} on "
      f"{torch.cuda.get_device_name() if gpu else 'cpu'}; matmul roof {roof:.0f} GFLOP/s; "
      f"first run (the compile): {firsts}\n")
medians = {name: statistics.median(ts) for name, ts in times.items()}
print_table(("decode step", "median s", "GFLOP/s", "roof"),
            [(name, f"{m:.3f}", f"{flops / m / 1e9:.1f}", f"{flops / m / 1e9 / roof:.0%}")
             for name, m in medians.items()])
