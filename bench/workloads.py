"""The named workloads of the benchmarks, with their length statistics: what a step's prompts and
completions look like in tokens. 'arith' is the default run's task (answers of 2-6 tokens);
'carries' is the reasoning-shaped one (tasks/carries.py, issue 52): worked solutions of tens to
hundreds of tokens behind a shared system prompt. The completions measured are the tasks' reference
answers (arith: the answer; carries: the worked solution), and, with --samples, what the shipped
tiny models write: 8 samples of each of 256 held-out prompts at temperature 1 (the lengths a run's
rollouts have at its start).

    python bench/workloads.py [--rows 4000] [--samples]
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from assets.carries import sample_stats  # noqa: E402
from bench.common import print_table  # noqa: E402
from models.tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from tasks.carries import SYSTEM, carry_rows  # noqa: E402
from tasks.data import arith_rows  # noqa: E402


def prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


WORKLOADS = {  # name: (rows, the completion a right answer is)
    "arith": (lambda n: arith_rows("train", n_train=n), lambda r: r["answer"]),
    "carries": (lambda n: carry_rows("train", n_train=n), lambda r: r["solution"]),
}


def stats(lengths: list[int]) -> tuple:
    lengths = sorted(lengths)
    return (statistics.mean(lengths), statistics.median(lengths), lengths[int(0.95 * len(lengths))],
            lengths[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--samples", action="store_true", help="also sample assets/carries-tiny (~1 min)")
    a = ap.parse_args()
    table = []
    for name, (make, completion) in WORKLOADS.items():
        rows = make(a.rows)
        # a tokenizer of the task's own text, as assets/make.py trains
        with tempfile.TemporaryDirectory() as d:
            train_tokenizer([SYSTEM] + [prompt_text(r["prompt"]) + "\n" + completion(r) for r in rows], d)
            tok = Tokenizer(d)
            prompts = stats([len(tok.encode(prompt_text(r["prompt"]))) for r in rows])
            done = stats([len(tok.encode(completion(r))) for r in rows])
        table.append((name, f"{a.rows}", *(f"{x:.0f}" for x in prompts), *(f"{x:.0f}" for x in done),
                      f"{done[2] / done[1]:.1f}"))
    if a.samples:
        got = sample_stats(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                        "carries-tiny"))
        lengths = [got[k] for k in ("length_mean", "length_median", "length_p95", "length_max")]
        prompts = table[-1][2:6]  # the same prompts as the row above
        table.append(("carries, carries-tiny's samples", "256 x 8", *prompts, *(f"{x:.0f}" for x in lengths),
                      f"{lengths[2] / lengths[1]:.1f}"))
    print_table(("workload", "rows", "prompt mean", "median", "p95", "max", "completion mean", "median",
                 "p95", "max", "p95/median"), table)


if __name__ == "__main__":
    main()
