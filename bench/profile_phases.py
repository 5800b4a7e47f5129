"""Where a GRPO step's generate and train phases spend their time: torch.profiler's top operators.

    python bench/profile_phases.py                     # the 19M bench model (512x8), batch 64
    python bench/profile_phases.py --hidden 256 --layers 4 --top 8
    python bench/profile_phases.py --micro-batch 16   # also: padding removal on rows of varied length

One process, the bench's shape (8 prompts x 8 samples x 64 new tokens, vocabulary 1024, EOS off
so every row is full length): the native engine's `generate`, then one training step's compute
on the same rows, the trained model's completion log-probs (models.decoder.completion_logprobs),
a policy-gradient loss and its backward, without FSDP (on one rank FSDP2 adds no collective).
Each phase runs once to warm up, then once under the profiler; the table lists the operators with
the most self CPU time and their share of the phase's wall time. The same script runs on an older
commit (it uses only APIs that have not changed) to give a before/after pair.

With --micro-batch M, the training step runs again on the same rows cut to random lengths 1..T
(as when completions end at EOS), in micro-batches of M rows: sliced in order (tasks.data
micro_batches) against tasks.data.forward_batches (rows by length, each micro-batch cut to the
columns its rows use); alternating rounds, medians.
"""
import argparse
import statistics
import tempfile
import time

import torch
from common import matmul_gflops, qwen2_checkpoint
from torch.profiler import ProfilerActivity, profile

from engines.decode import SamplingParams
from engines.native import NativeEngine
from models.decoder import completion_logprobs, flops_per_token
from models.hf import iter_checkpoint, load_model, read_config
from models.tokenizer import Tokenizer
from tasks.data import forward_batches, make_batch, micro_batches

ap = argparse.ArgumentParser()
ap.add_argument("--hidden", type=int, default=512)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--n", type=int, default=8, help="samples per prompt (batch = prompts * n)")
ap.add_argument("--prompt-len", type=int, default=12)
ap.add_argument("--new-tokens", type=int, default=64)
ap.add_argument("--top", type=int, default=10, help="operators listed per phase")
ap.add_argument("--micro-batch", type=int, default=0, help="also time padding removal (0: no)")
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()

path = tempfile.mkdtemp()
qwen2_checkpoint(path, hidden=args.hidden, layers=args.layers)
cfg = read_config(path)
engine = NativeEngine(cfg, Tokenizer(path))
engine.eos = torch.tensor([-1])  # no EOS: every row makes --new-tokens tokens, as in the bench
engine.load_weights(iter_checkpoint(path))
model = load_model(path)
B, T = args.prompts * args.n, args.new_tokens
prompts = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len),
                        generator=torch.Generator().manual_seed(0)).tolist()
sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=T)


def generate():
    return engine.generate(prompts, sp, seeds=list(range(args.prompts)))


out = generate()
rows = [p for p in prompts for _ in range(args.n)]
batch = make_batch(rows, out.tokens, out.lengths, pad_id=0)
adv = torch.randn(B, 1).expand(B, T)  # [B, T] one advantage per row, as GRPO's


def train():
    logp = completion_logprobs(model, batch, 1.0)  # [B, T]
    loss = -(logp * adv * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def profiled(fn):
    fn()  # warm-up: packing, allocator, first-call costs
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        fn()
        wall = time.perf_counter() - t
    return wall, prof.key_averages()


roof = matmul_gflops()
L = args.prompt_len + T  # bench/grpo_vs_trl.py's FLOPs: each new token over its context; the trainer's
flops = {"generate": B * sum(flops_per_token(cfg, args.prompt_len + t) for t in range(T)),
         "train": 3 * B * L * flops_per_token(cfg, L // 2)}  # forward and backward over every position
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, batch {B} x {T} new tokens, "
      f"fp32 matmul roof {roof:.0f} GFLOP/s, {torch.get_num_threads()} threads")
for name, fn in (("generate", generate), ("train", train)):
    wall, ops = profiled(fn)
    share = flops[name] / wall / 1e9 / roof
    print(f"\n{name}: {wall:.3f} s ({share:.0%} of the roof)")
    print(f"{'operator':<40} {'self s':>8} {'of wall':>8} {'calls':>7}")
    for op in sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]:
        s = op.self_cpu_time_total / 1e6
        print(f"{op.key[:40]:<40} {s:>8.3f} {s / wall:>8.1%} {op.count:>7}")

if args.micro_batch:
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(1))
    varied = make_batch(rows, out.tokens * (torch.arange(T) < lengths[:, None]), lengths, pad_id=0)
    varied["adv"] = adv

    def train_on(mbs):
        for mb in mbs:
            logp = completion_logprobs(model, mb, 1.0)  # [n, T']
            (-(logp * mb["adv"] * mb["loss_mask"]).sum() / varied["loss_mask"].sum()).backward()
        model.zero_grad(set_to_none=True)

    ways = {"sliced in order": lambda: micro_batches(varied, args.micro_batch),
            "by length, cut": lambda: (mb for _, mb in forward_batches(varied, args.micro_batch))}
    times = {name: [] for name in ways}
    for name, mbs in ways.items():
        train_on(mbs())  # warm-up
    for _ in range(args.rounds):
        for name, mbs in ways.items():
            t = time.perf_counter()
            train_on(mbs())
            times[name].append(time.perf_counter() - t)
    print(f"\ntrain on rows of lengths 1..{T} (mean {lengths.float().mean():.1f}), micro-batches of "
          f"{args.micro_batch}, median of {args.rounds}")
    print(f"{'micro-batches':<18} {'train s':>8} {'tokens run':>11}")
    for name, mbs in ways.items():
        tokens = sum(mb["input_ids"].numel() for mb in mbs())
        print(f"{name:<18} {statistics.median(times[name]):>8.3f} {tokens:>11}")
