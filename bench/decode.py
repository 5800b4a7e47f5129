"""Native engine decode tokens/s against transformers' `generate`, same checkpoint, same batch.

    python bench/decode.py                      # 2.6M-param Qwen2, batch 64, 64 new tokens
    python bench/decode.py --hidden 512 --layers 8   # 19M params
    python bench/decode.py --model DIR          # any local HF checkpoint

Runs alternate (ours, HF, ours, HF, ...) and report medians, since these machines are
noisy. EOS is disabled on both sides so every row makes exactly --new-tokens tokens. The
third row times the native decode steps' matmuls alone: the ceiling on the speedup of any
decoder that runs the same GEMMs (the rest of the step would have to cost nothing).
"""
import argparse
import statistics
import tempfile
import time

import torch
from common import matmul_gflops, qwen2_checkpoint

from engines.decode import SamplingParams, _linear
from engines.native import NativeEngine
from models.decoder import flops_per_token
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None)
ap.add_argument("--hidden", type=int, default=256, help="the random model's size, without --model")
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--n", type=int, default=8, help="samples per prompt (batch = prompts * n)")
ap.add_argument("--prompt-len", type=int, default=12)
ap.add_argument("--new-tokens", type=int, default=64)
ap.add_argument("--reps", type=int, default=5)
args = ap.parse_args()

import transformers  # noqa: E402

path = args.model or tempfile.mkdtemp()
if args.model is None:
    hf = qwen2_checkpoint(path, hidden=args.hidden, layers=args.layers)
else:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
cfg = read_config(path)
tok = Tokenizer(path)
eng = NativeEngine(cfg, tok)
eng.eos = torch.tensor([-1])  # no EOS: fixed-length decode on both sides
eng.load_weights(iter_checkpoint(path))
B, T = args.prompts * args.n, args.new_tokens
g = torch.Generator().manual_seed(0)
prompts = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len), generator=g)
sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=T)


def ours():
    out = eng.generate(prompts.tolist(), sp, seeds=list(range(args.prompts)))
    assert out.tokens.shape == (B, T)


def theirs():
    with torch.no_grad():
        out = hf.generate(prompts.repeat_interleave(args.n, 0), max_new_tokens=T, min_new_tokens=T,
                          do_sample=True, temperature=1.0, top_k=0, pad_token_id=0,
                          attention_mask=torch.ones(B, args.prompt_len, dtype=torch.long))
    assert out.shape == (B, args.prompt_len + T)


def matmuls_alone():
    """The native decode steps' matmuls and nothing else (same weights, shapes and calls; every
    other op free): a floor for any decoder built from these GEMMs on this machine."""
    h, I = cfg.hidden_size, cfg.intermediate_size
    x, xi = torch.randn(B, h), torch.randn(B, I)
    for _ in range(T - 1):
        for _, wqkv, bqkv, wo, bo, _, wgu, wd, _ in eng.decoder.step_layers:
            _linear(x, wqkv, bqkv), _linear(x, wo, bo, add=x), _linear(x, wgu), _linear(xi, wd, add=x)
        _linear(x, eng.decoder.step_head[1])


runs = (("native engine", ours), ("transformers generate", theirs), ("decode matmuls alone", matmuls_alone))
times = {name: [] for name, _ in runs}
ours(), theirs()  # warm-up
for _ in range(args.reps):
    for name, fn in runs:
        t = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t)
roof = matmul_gflops()
flops = sum(flops_per_token(cfg, args.prompt_len + t) for t in range(T)) * B  # decode only
print(f"\nQwen2 {cfg.num_params() / 1e6:.2f}M params, batch {B}, prompt {args.prompt_len}, {T} new tokens, "
      f"torch threads {torch.get_num_threads()}, fp32 matmul roof {roof:.0f} GFLOP/s\n")
print(f"| {'engine':<22} | {'median s':>8} | {'tokens/s':>9} | {'GFLOP/s':>7} | {'MFU':>5} |")
print(f"|{'-' * 24}|{'-' * 10}|{'-' * 11}|{'-' * 9}|{'-' * 7}|")
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"| {name:<22} | {m:8.3f} | {B * T / m:9.0f} | {flops / m / 1e9:7.1f} "
          f"| {flops / m / 1e9 / roof:5.1%} |")
hf = statistics.median(times["transformers generate"])
print(f"\nnative / transformers tokens/s: {hf / statistics.median(times['native engine']):.2f}x; "
      f"the decode matmuls alone would give {hf / statistics.median(times['decode matmuls alone']):.2f}x")
