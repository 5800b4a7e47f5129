"""One prepared GPU check (issue 3): bf16 GRPO steps on a random Qwen2.5-0.5B-shaped model
(built from a config, nothing downloaded), native-engine decode tokens/s at batch 64, and
peak GPU memory. Meant for one call on a lent H200, well under 8 minutes:

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
from utils.engines import NativeEngine, SamplingParams  # noqa: E402
from utils.data import Tokenizer  # noqa: E402
from utils.model import ModelConfig, build, flops_per_token, iter_checkpoint, save_model  # noqa: E402
from utils.tiny import make_tokenizer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--cpu-smoke", action="store_true")
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--peak-tflops", type=float, default=790.0)
args = ap.parse_args()
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

# decode: batch 64 (8 prompts x 8 samples), 128 new tokens, EOS off
eng = NativeEngine(cfg, Tokenizer(path), device, torch.bfloat16)
eng.eos = torch.tensor([-1], device=device)
eng.load_weights(iter_checkpoint(path))
prompts = torch.randint(0, 200, (8, 32)).tolist()
sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=128 if gpu else 16)
eng.generate(prompts, sp, list(range(8)))  # warm-up
if gpu:
    torch.cuda.synchronize()
t = time.perf_counter()
out = eng.generate(prompts, sp, list(range(8)))
if gpu:
    torch.cuda.synchronize()
dec_s = time.perf_counter() - t
dec_tokens = int(out.lengths.sum())
dec_flops = sum(flops_per_token(cfg, 32 + i) for i in range(sp.max_new_tokens)) * 64
del eng

# GRPO steps in bf16 through the real script (one rank)
run = os.path.join(path, "run")
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "train_grpo.py",
       "--model", path, "--param-dtype", "bfloat16", "--engine", "native", "--steps", str(args.steps),
       "--prompts-per-step", "16", "--num-generations", "8", "--max-new-tokens", "128" if gpu else "16",
       "--micro-batch-size", "16", "--eval-every", "0", "--save-every", "0", "--no-save-final", "--lr", "1e-6",
       "--run-dir", run]
p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
if p.returncode:
    sys.exit(p.stdout[-2000:] + p.stderr[-4000:])
rows = [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if not r.get("final")][1:]  # 1st: warm-up
train_s = sorted(r["perf/train_s"] for r in rows)[len(rows) // 2]
gen_s = sorted(r["perf/generate_s"] for r in rows)[len(rows) // 2]
seq_tokens = 16 * 8 * (10 + sorted(r["rollout/response_len"] for r in rows)[len(rows) // 2])  # ~10-token prompts
train_flops = 3 * flops_per_token(cfg, 64) * seq_tokens  # forward + backward = 3 forwards
peak = max(r["perf/peak_mem_gib"] for r in rows)
roof = args.peak_tflops * 1e12
print(f"\n{'GPU' if gpu else 'CPU smoke'}: {torch.cuda.get_device_name() if gpu else 'cpu'}, "
      f"{cfg.num_params() / 1e6:.0f}M params, bf16")
print(f"| {'figure':<34} | {'value':>12} |\n|{'-' * 36}|{'-' * 14}|")
print(f"| {'decode tokens/s (batch 64)':<34} | {dec_tokens / dec_s:12.0f} |")
print(f"| {'decode MFU':<34} | {dec_flops / dec_s / roof:12.2%} |")
print(f"| {'train step s (median, 128 seqs)':<34} | {train_s:12.3f} |")
print(f"| {'train-step MFU':<34} | {train_flops / train_s / roof:12.2%} |")
print(f"| {'generate s in the GRPO step':<34} | {gen_s:12.3f} |")
print(f"| {'peak memory GiB (GPU; RSS on CPU)':<34} | {peak:12.2f} |")
