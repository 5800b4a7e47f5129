"""How often the judge (roles/judge.py) agrees with the accuracy rule on the built-in task's
held-out problems: its score (k verdicts at temperature 1.0, averaged) > 0 read as "correct".

    .venv/bin/python bench/judge_agreement.py                 # assets/judge-tiny, k = 8 (~1 min)

Rows: (a) each eval problem's right answer and one wrong sum (tasks.data.wrong_answer), half
and half; (a') the mix the tiny judge is trained on (near misses, extra digits, trailing junk),
half right; (b) what the policy assets/arith-tiny writes on the eval split (temperature 1.0, 8
new tokens), right or wrong as it comes. "on right" / "on wrong": agreement among the
completions the rule marks right / wrong.
"""
import argparse
import random
import time

import common  # noqa: F401 (puts the repo on sys.path)
import torch

from assets.make import judge_candidate
from engines.decode import SamplingParams
from engines.native import NativeEngine
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from roles.judge import make_judge
from tasks.data import arith_rows, wrong_answer
from tasks.rewards import accuracy

ap = argparse.ArgumentParser()
ap.add_argument("--judge", default="assets/judge-tiny")
ap.add_argument("--policy", default="assets/arith-tiny")
ap.add_argument("--samples", type=int, default=8, help="k judge samples per completion")
ap.add_argument("--policy-samples", type=int, default=4, help="policy completions per eval problem")
ap.add_argument("--chunk", type=int, default=128, help="completions per judge call")
args = ap.parse_args()
torch.set_num_threads(1)

rows = arith_rows("eval")
rng = random.Random("bench-judge")
balanced = []
for r in rows:
    balanced.append((r["prompt"], r["answer"], r["answer"]))
    balanced.append((r["prompt"], wrong_answer(r["answer"], rng), r["answer"]))
mix = []
for r in rows:
    for right in (True, False):
        mix.append((r["prompt"], judge_candidate(r["answer"], right, rng), r["answer"]))

tok = Tokenizer(args.policy)
policy = NativeEngine(read_config(args.policy), tok)
policy.load_weights(iter_checkpoint(args.policy))
out = policy.generate([tok.encode(*tok.render(r["prompt"])) for r in rows],
                      SamplingParams(args.policy_samples, 1.0, max_new_tokens=8), list(range(len(rows))))
sampled = [(rows[i // args.policy_samples]["prompt"], text, rows[i // args.policy_samples]["answer"])
           for i, text in enumerate(out.texts)]
policy.release()

judge = make_judge(args.judge, "native", "cpu", torch.float32, 2048, 0, None, args.samples, 1.0, 4, 0)
judge.load()


def measure(cases):
    """(agreement, on right, on wrong, unparsed share, judge seconds per 100 completions)."""
    prompts, completions, answers = (list(x) for x in zip(*cases))
    right = torch.tensor(accuracy(prompts, completions, answers)) > 0  # [N]
    scores, unparsed = [], 0
    t = time.perf_counter()
    for s in range(0, len(cases), args.chunk):
        part = slice(s, s + args.chunk)
        seeds = list(range(s, s + len(completions[part])))
        score, bad = judge.score(prompts[part], completions[part], {"answer": answers[part]}, seeds)
        scores.append(score)
        unparsed += bad
    seconds = time.perf_counter() - t
    agree = (torch.cat(scores) > 0) == right  # [N]
    return (agree.float().mean(), agree[right].float().mean(), agree[~right].float().mean(),
            unparsed / (len(cases) * args.samples), 100 * seconds / len(cases), right.float().mean())


print(f"\njudge {args.judge}, k = {args.samples} verdicts at temperature 1.0, score > 0 = correct; "
      f"native engine, fp32, 1 thread\n")
print(f"| {'completions':<38} | {'n':>4} | {'rule: right':>11} | {'agreement':>9} | {'on right':>8} | "
      f"{'on wrong':>8} | {'unparsed':>8} | {'s / 100':>7} |")
print(f"|{'-' * 40}|{'-' * 6}|{'-' * 13}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 9}|")
for name, cases in (("(a) right vs wrong_answer, eval split", balanced),
                    ("(a') training mix (malformed), eval", mix),
                    (f"(b) {args.policy} samples, T=1.0", sampled)):
    agree, on_right, on_wrong, unparsed, per_100, base = measure(cases)
    print(f"| {name:<38} | {len(cases):>4} | {base:>11.1%} | {agree:>9.1%} | {on_right:>8.1%} | "
          f"{on_wrong:>8.1%} | {unparsed:>8.1%} | {per_100:>7.2f} |")
