"""A Bradley-Terry reward model on preference pairs, FSDP2 under torchrun like the RL scripts.

    torchrun --standalone --nproc-per-node 2 train_rm.py      # the built-in task's pairs, offline
    torchrun --standalone --nproc-per-node 2 train_rm.py --dataset prefs.jsonl --prompt-column prompt

The reward model is --model's decoder with a one-score head (HF's ...ForSequenceClassification),
the head starting at zero: every score 0, every pair a tie. Each step, every rank scores its
share of the pairs' chosen and rejected sequences at their last non-pad token and takes the
Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) (Ouyang et al. 2022, eq. 1). The
result, in --out, is what the reward-model role of train_grpo.py and train_ppo.py reads
(`--rewards rm --reward-model DIR`); it shares --model's tokenizer.
"""
import math
import random
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch.distributed.device_mesh import init_device_mesh

from models.decoder import sequence_scores
from models.hf import checked_model, save_model
from models.parallelize import load_sharded
from models.tokenizer import Tokenizer
from rl.algos import bradley_terry_loss
from roles.actor import lr_factor
from flags import check_optimizer, parse, writable_dir
from tasks.data import BUILTIN, load_pairs, make_batch, rank_slice, step_indices, tokenize_pairs
from utils import dist
from utils.errors import UserError, check_applies, check_rules


@dataclass
class Args:
    model: str = "assets/arith-tiny"
    """the checkpoint to start from: its decoder, with a fresh zero score head (a causal checkpoint),
    or its own head (a ...ForSequenceClassification one)"""
    dataset: str = BUILTIN
    """'builtin:arith' (the right sum + EOS beats a wrong one + EOS), a local .jsonl/.json/.parquet
    file, or a hub dataset id"""
    chosen_column: str = "chosen"
    """dataset column holding the preferred answer (a string)"""
    rejected_column: str = "rejected"
    """dataset column holding the other answer (a string)"""
    prompt_column: str | None = None
    """dataset column holding the prompt (a string or chat messages, rendered with the chat template),
    put before both answers; none: the answers are whole texts"""
    eval_dataset: str | None = None
    """held-out pairs (same columns; a hub id's 'test' split); default: the built-in task's eval
    split, else --eval-fraction of --dataset"""
    eval_fraction: float = 0.05
    """own --dataset: this share of its pairs is held out, unless --eval-dataset is given (the built-in
    task has its own held-out split)"""
    eval_every: int = 50
    """held-out pair accuracy every this many steps (and at the start and the end; 0: start and end only)"""
    eval_pairs: int = 512
    """at most this many held-out pairs per evaluation"""
    steps: int = 150
    """optimizer steps"""
    batch_size: int = 64
    """pairs per step over all ranks (each rank scores batch_size / world of them)"""
    lr: float = 1e-3
    """AdamW learning rate (after warm-up; then it decays linearly to 0 at the last step). The default
    run's held-out pair accuracy after 150 steps: 0.79 at 3e-4, 0.85 at 1e-3, 0.82 at 2e-3"""
    warmup_steps: int = 10
    """linear learning-rate warm-up"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    max_tokens: int = 256
    """pairs whose prompt + longer answer is longer are skipped and counted"""
    log_every: int = 10
    """print the training loss and pair accuracy every this many steps"""
    seed: int = 0
    """seeds the data order and the held-out split"""
    out: str = "runs/rm"
    """the trained reward model goes here (HF format, loads as AutoModelForSequenceClassification)"""
    timeout_s: float = 300.0
    """a collective waiting longer than this fails (a dead rank must not hang the job)"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "eval_fraction": ("dataset", lambda d: d != BUILTIN, "a --dataset of your own (the built-in task has "
                          "its own held-out split)")}


def check_args(args: Args, world: int):
    """Every flag's range, before any process group or model load, with what to change."""
    check_rules(args, [  # (flag, holds, what is wrong and what to do: "use 1 or more")
        ("eval_fraction", 0 <= args.eval_fraction < 1, "use a share in [0, 1)"),
        ("eval_fraction", args.eval_fraction == 0.05 or args.eval_dataset is None,
         "it holds out a share of --dataset, and --eval-dataset is held out instead: drop one of the two"),
        ("eval_every", args.eval_every >= 0, "use 0 (start and end only) or a number of steps"),
        ("eval_pairs", args.eval_pairs >= 1, "use 1 or more"),
        ("batch_size", args.batch_size >= 1 and args.batch_size % world == 0,
         f"use a multiple of the {world} ranks, such as {[world * k for k in (8, 16, 32)]}"),
        ("max_tokens", args.max_tokens >= 2, "use 2 or more"),
        ("log_every", args.log_every >= 1, "use 1 or more"),
        ("timeout_s", 0 < args.timeout_s < math.inf, "use a positive number of seconds")])
    check_optimizer(args)  # --steps, --lr, --warmup-steps, --max-grad-norm: as GRPO's and PPO's
    check_applies(args)
    writable_dir(args.out, "--out")
    args.model = checked_model(args.model)  # a hub id (ORG/NAME) becomes its snapshot (computed at runtime)


def split_held_out(pairs, args: Args):
    """(train pairs, held-out pairs): --eval-dataset's, the built-in task's eval split, or else
    --eval-fraction of the dataset's pairs, drawn by --seed."""
    if args.eval_dataset is not None or args.dataset == BUILTIN:
        source = args.eval_dataset or BUILTIN
        return pairs, load_pairs(source, "test", args.chosen_column, args.rejected_column, args.prompt_column)
    pairs = list(pairs)
    random.Random(f"{args.seed}-held-out").shuffle(pairs)
    cut = int(len(pairs) * args.eval_fraction)
    if cut == len(pairs):
        raise UserError(f"--eval-fraction {args.eval_fraction} holds out every pair of {args.dataset!r}")
    return pairs[cut:], pairs[:cut]


def pair_batch(pairs, pad_id: int, device):
    """n pairs -> a tasks.data.Batch of 2n rows in make_batch's layout (left-padded prompt,
    right-padded answer, as the reward-model role gets the policy's samples): chosen, then rejected."""
    answers = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
    T = max(map(len, answers))
    tokens = torch.tensor([a + [pad_id] * (T - len(a)) for a in answers])  # [2n, T]
    lengths = torch.tensor([len(a) for a in answers])  # [2n]
    return make_batch([p["ids"] for p in pairs] * 2, tokens, lengths, pad_id, device)


def pair_scores(model, pairs, pad_id: int, device):
    """The reward of each pair's chosen and rejected sequence -> ([n], [n])."""
    scores = sequence_scores(model, pair_batch(pairs, pad_id, device))  # [2n]
    return scores[:len(pairs)], scores[len(pairs):]  # [n], [n]


def ranked_right(chosen, rejected):
    """Pairs ranked right: a tie counts half (the fresh zero head ties every pair: 0.5, chance)."""
    return (chosen > rejected).sum() + 0.5 * (chosen == rejected).sum()


@torch.no_grad()
def evaluate(model, pairs, per_rank: int, pad_id: int, device, rank: int, world: int) -> float:
    """Held-out pair accuracy. Every rank scores an equal share in equal chunks: the FSDP
    gathers of each forward are collective."""
    mine = pairs[rank::world]
    total = 0.0
    for s in range(0, len(mine), per_rank):
        total += ranked_right(*pair_scores(model, mine[s:s + per_rank], pad_id, device))
    return dist.reduce({"right": total})["right"] / (len(mine) * world)


if __name__ == "__main__":
    args = parse(Args, check_args)
    tok = Tokenizer(args.model)
    rank, world, device = dist.init(args.timeout_s)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))  # one role: every rank trains
    t0 = time.perf_counter()

    # data: every rank tokenises the same pairs and takes its own slice of each step
    pairs = load_pairs(args.dataset, "train", args.chosen_column, args.rejected_column, args.prompt_column)
    pairs, held_out = split_held_out(pairs, args)
    pairs, skipped = tokenize_pairs(pairs, tok, args.max_tokens)
    held_out, eval_skipped = tokenize_pairs(held_out, tok, args.max_tokens) if held_out else ([], 0)
    held_out = held_out[:min(len(held_out), args.eval_pairs) // world * world]  # an equal share per rank
    if not held_out:
        raise UserError("no held-out pairs to measure the reward model on: pass --eval-dataset, or a larger "
                        f"--eval-fraction (it needs at least {world}, one per rank)")

    # the reward model: the decoder with one score per sequence. HF reads that score at the last
    # token that is not the pad id, so we train on that same token (an EOS equal to the pad id
    # is then skipped, as transformers skips it)
    model = load_sharded(args.model, mesh, device, value_head=True)
    cfg = replace(model.config, pad_token_id=tok.pad_id)
    model.config = cfg
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(args.warmup_steps, args.steps, s))
    per_rank = args.batch_size // world
    if rank == 0:
        print(f"{world} rank(s); reward model from {args.model} ({cfg.num_params() / 1e6:.2f}M params); "
              f"{len(pairs)} train pairs ({skipped} over --max-tokens skipped), {len(held_out)} held out "
              f"({eval_skipped} skipped)", flush=True)
    acc = evaluate(model, held_out, per_rank, tok.pad_id, device, rank, world)
    if rank == 0:
        print(f"step    0/{args.steps}  eval/pair_acc {acc:.3f}", flush=True)

    sums = {"loss": 0.0, "right": 0.0, "pairs": 0}  # since the last progress line, this rank's
    for step in range(args.steps):
        # score this rank's share; FSDP averages the gradients over the ranks, so the sum over
        # the share divided by the share's size gives the mean over the whole batch
        mine = rank_slice(step_indices(len(pairs), step, args.batch_size, args.seed), rank, world)
        chosen, rejected = pair_scores(model, [pairs[i] for i in mine], tok.pad_id, device)  # [n], [n]
        loss = bradley_terry_loss(chosen, rejected)  # [n]
        (loss.sum() / per_rank).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):  # the same on every rank: the norm is global
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

        # log: rank 0 prints the interval's mean loss and pair accuracy over all ranks
        sums["loss"] += loss.detach().sum()
        sums["right"] += ranked_right(chosen.detach(), rejected.detach())
        sums["pairs"] += per_rank
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            total = dist.reduce(sums)
            sums = {"loss": 0.0, "right": 0.0, "pairs": 0}
            if rank == 0:
                print(f"step {done:4d}/{args.steps}  train/loss {total['loss'] / total['pairs']:.4f}  "
                      f"train/pair_acc {total['right'] / total['pairs']:.3f}  train/grad_norm "
                      f"{float(grad_norm):.3f}  train/lr {sched.get_last_lr()[0]:.2e}  "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
        if (args.eval_every and done % args.eval_every == 0) or done == args.steps:
            acc = evaluate(model, held_out, per_rank, tok.pad_id, device, rank, world)
            if rank == 0:
                print(f"step {done:4d}/{args.steps}  eval/pair_acc {acc:.3f}", flush=True)

    # every rank joins the per-tensor gathers; rank 0 writes the HF checkpoint
    weights = [(name, t.cpu()) for name, t in dist.full_tensors(model, exact=True)]
    if rank == 0:
        save_model(weights, cfg, args.out, tokenizer_dir=args.model)
        print(f"wrote {args.out} (held-out pair accuracy {acc:.3f}, {time.perf_counter() - t0:.0f}s)",
              flush=True)
    dist.exit_now(0)
