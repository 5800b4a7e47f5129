"""GRPO in one file: what `train_grpo.py` does with its default flags, written out to be read
top to bottom (CleanRL's ppo.py is the model). The full trainer is for running; this is for
learning what it runs.

    torchrun --standalone --nproc-per-node 2 teach_grpo.py --steps 5     # or --nproc-per-node 1

The default run: every rank trains and generates, taking turns (colocated), with the policy
sharded by FSDP2 over all ranks (gloo on CPU, NCCL on GPU) and sampled by the native engine; the
task is the built-in arithmetic, the policy the shipped tiny model (assets/arith-tiny), the reward
1 for a right answer and 0 otherwise. Each rank is the controller of its own share of every step
(G-Core's parallel controllers): it samples, scores and computes the advantages of its own
prompts; no rank gathers the batch. One step:

    sync weights -> (evaluate) -> rollout -> reward -> advantage -> update -> log

tests/test_teach.py runs this file and train_grpo.py for 5 steps on 1 and on 2 ranks and asserts
that their metrics and final weights are the same to the bit: what you read here is what the full
trainer does. The algorithm is GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1) with two of
DAPO's choices (Yu et al. 2025): the loss is a mean over all tokens of the batch, and the ratio's
clip is wider above than below. train_grpo.py adds what is left out here: other placements,
engines, advantages and losses, a KL term, LoRA, judges, checkpoints and resume, the NaN guard,
rewards that can fail; README.md's "Follow one sample" says where each step below lives there.
"""
import os
import time
from dataclasses import asdict, dataclass

import torch
import tyro
from torch.distributed.device_mesh import init_device_mesh

from engines.decode import SamplingParams
from engines.native import NativeEngine
from models.decoder import completion_logprobs
from models.hf import read_config, save_model
from models.packing import token_budget
from models.parallelize import load_sharded
from models.tokenizer import Tokenizer
from roles.reward import Reward
from tasks.data import (BUILTIN, dataset_columns, forward_batches, load_rows, make_batch, per_sample,
                        prompt_seed, step_prompts, take_rows, tokenize_rows)
from utils import dist
from utils.logger import Logger, Timer

MAX = torch.distributed.ReduceOp.MAX


@dataclass
class Args:
    model: str = "assets/arith-tiny"
    """the policy: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"""
    steps: int = 800
    """optimizer steps, one rollout batch each"""
    seed: int = 0
    """seeds the prompt order and every sample (per prompt, so results do not depend on the ranks)"""
    run_dir: str = "runs/teach_grpo"
    """metrics.jsonl, config.json and the final policy (final/, HF format) go here"""
    prompts_per_step: int = 64
    """prompts per step over all ranks (each rank takes prompts_per_step / ranks)"""
    num_generations: int = 8
    """completions per prompt: the group of GRPO's group-relative advantage"""
    max_new_tokens: int = 8
    """completion length limit"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use it too: the ratio compares like with like)"""
    lr: float = 3e-4
    """AdamW learning rate after the warm-up; it then decays linearly to 0 at the last step"""
    warmup_steps: int = 3
    """linear learning-rate warm-up"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    clip_low: float = 0.2
    """the ratio is clipped below at 1 - clip_low"""
    clip_high: float = 0.28
    """the ratio is clipped above at 1 + clip_high (DAPO's clip-higher)"""
    micro_batch_size: int = 256
    """completions per forward and backward on each rank (memory and speed; the result moves by rounding)"""
    micro_batch_tokens: int = 2048
    """tokens per forward and backward on each rank, each micro-batch packed into one sequence with each
    prompt once for all its samples (models/packing.py: the same log-probs to rounding); 0: rows, padded"""
    eval_every: int = 100
    """held-out accuracy every this many steps and at the end (0: never)"""
    eval_prompts: int = 256
    """held-out prompts per evaluation"""


def evaluate(engine, rows: list[dict], reward: Reward, args: Args, rank: int, world: int) -> dict:
    """Held-out accuracy: one sample per prompt at the training temperature, each rank its own
    slice, each sample seeded by its prompt's position (the same on any number of ranks)."""
    mine = rows[rank::world]
    seeds = [prompt_seed(args.seed, -1, rank + i * world) for i in range(len(mine))]
    params = SamplingParams(1, args.temperature, max_new_tokens=args.max_new_tokens)
    out = engine.generate([r["ids"] for r in mine], params, seeds)
    columns = {"answer": [r["answer"] for r in mine], "finish_reason": out.finish_reasons}
    correct = reward.score([r["prompt"] for r in mine], out.texts, columns)[0]  # [len(mine)]
    total = dist.reduce({"correct": correct.sum(), "count": len(mine)})  # over all ranks
    return {"eval/accuracy": total["correct"] / total["count"]}


if __name__ == "__main__":
    args = tyro.cli(Args)
    n = args.num_generations
    rank, world, device = dist.init()  # torchrun's world (gloo on CPU); a world of 1 as a plain script
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))  # FSDP2 shards over all ranks
    torch.manual_seed(args.seed)  # as train_grpo.py; nothing draws from it: samples are seeded per prompt

    # the data: the built-in task's prompts ("90+93=", answer "183"), rendered by the model's chat
    # template and tokenised (longer than 256 tokens: skipped); every rank holds them all and takes
    # its own slice of each step's
    tok = Tokenizer(args.model)
    rows = tokenize_rows(load_rows(BUILTIN, "train", "prompt", "answer"), tok, 256)[0]
    eval_rows = tokenize_rows(load_rows(BUILTIN, "test", "prompt", "answer"), tok, 256)[0][:args.eval_prompts]

    # the policy under FSDP2, torchtitan's order (models/parallelize.py): built on the meta device, each
    # decoder block sharded, then the root; each rank allocates and loads only its own shards.
    # Parameters and the gradient reduction stay in fp32 (MixedPrecisionPolicy)
    model = load_sharded(args.model, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99), fused=True)

    def lr_factor(s: int) -> float:  # linear warm-up, then linear decay to 0 at the last step
        return min(1.0, (s + 1) / max(1, args.warmup_steps)) * max(0.0, 1 - s / args.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    # the engine: a batched sampler with a KV cache, in this process (engines/native.py). Colocated,
    # it takes turns with training on this rank's device: weights in before it samples, out after
    engine = NativeEngine(read_config(args.model), tok, device)
    sampling = SamplingParams(n, args.temperature, max_new_tokens=args.max_new_tokens)
    reward = Reward(["accuracy"])  # 1.0 if the completion's last number is the answer, else 0.0
    log = Logger(args.run_dir, asdict(args), args.steps) if rank == 0 else None  # rank 0 logs
    if rank == 0:
        print(f"{world} rank(s), colocated, NativeEngine; {args.model}; {len(rows)} train prompts, "
              f"{len(eval_rows)} held out", flush=True)

    for step in range(args.steps):
        timer = Timer()  # seconds per phase, for the perf/ metrics
        # 1. sync: the engine gets the current policy, gathered whole from the FSDP2 shards one
        # block at a time (an all-gather per block, in which every rank takes part)
        with timer("sync"):
            engine.load_weights(dist.full_tensors(model))
        metrics = {}
        if args.eval_every and step % args.eval_every == 0:
            metrics = evaluate(engine, eval_rows, reward, args, rank, world)

        # 2. rollout: this rank's prompts of the step, n completions each, with the engine's
        # log-prob of each sampled token. Each prompt's samples are seeded by (seed, step, its
        # position in the step): the same completions on 1 rank or on 2
        prompts, seeds = step_prompts(rows, step, args.prompts_per_step, args.seed, rank, world)
        with timer("generate"):
            out = engine.generate([p["ids"] for p in prompts], sampling, seeds)  # N = len(prompts) * n rows
        engine.release()  # the engine drops its weights and cache: training gets the memory back

        # 3. reward: each completion against its prompt's answer
        columns = {**dataset_columns(prompts, n), "finish_reason": out.finish_reasons}  # one per completion
        rewards = reward.score(per_sample([p["prompt"] for p in prompts], n), out.texts, columns)[0]  # [N]

        # 4. advantage: GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath, section
        # 4.1.2, outcome supervision): each completion's reward minus the mean of its prompt's group
        # of n, divided by the group's std, the same at each of its tokens. The default divides, by
        # the unbiased std (as TRL and veRL; in float64 as rl/algos.py, for the same bits) plus
        # 1e-6; Dr. GRPO (Liu et al. 2025, train_grpo.py --no-scale-std) does not divide. A group
        # whose rewards agree (all right or all wrong) gets exactly 0: it carries no signal
        r = rewards.view(-1, n)  # [G, n] one row per prompt
        std = r.double().std(-1, keepdim=True).float()  # [G, 1]
        adv = (r - r.mean(-1, keepdim=True)) / (std + 1e-6)  # [G, n]

        # 5. the batch: one row per completion, the prompt left-padded, then the completion
        batch = make_batch(per_sample([p["ids"] for p in prompts], n), out.tokens, out.lengths, tok.pad_id,
                           device)  # input_ids, valid [N, P+T]; loss_mask [N, T]: 1 on completion tokens
        batch["old_logp"] = out.logprobs.to(device)  # [N, T] the engine's: the ratio's denominator
        batch["adv"] = adv.reshape(-1, 1).expand_as(batch["loss_mask"])  # [N, T] each token: its completion's

        # 6. update: one optimizer step on the step's batch. The loss is a sum over this rank's
        # tokens divided by norm, the tokens of all ranks / ranks: FSDP2 averages the gradients
        # over the ranks, so the result is the gradient of the mean over every token of the batch
        # (DAPO's token-level mean; GRPO's paper averages each completion first). No KL term to a
        # reference model: the default --kl-coef is 0 (GRPO's paper has one; DAPO drops it)
        train_start = time.perf_counter()
        tokens = dist.reduce({"tokens": batch["loss_mask"].sum()})["tokens"]  # over all ranks
        norm = tokens / world
        # a row of advantage 0 adds exactly nothing to the loss or its gradient (the loss below is
        # proportional to the advantage), so it is not run: the nonzero rows first, as many on each
        # rank as the rank with the most has, so that every rank runs as many FSDP2 collectives
        nonzero = (batch["adv"] != 0).any(-1)  # [N]
        K = max(1, int(dist.reduce({"rows": nonzero.sum()}, op=MAX)["rows"]))
        batch = take_rows(batch, torch.argsort((~nonzero).to(torch.uint8), stable=True)[:K])  # [K, ...]
        # micro-batches of rows back to back without padding, a group's prompt once (tasks/data.py)
        packed = token_budget(model, args.micro_batch_tokens)  # 0 for a Qwen2-VL model: rows
        micro = [mb for _, mb in forward_batches(batch, args.micro_batch_size, packed, mesh.get_group())]
        pg_sum, clipped_sum, gap_max = 0.0, 0, torch.zeros(())
        for i, mb in enumerate(micro):
            # gradients are reduce-scattered after the last micro-batch only (no traffic before it)
            model.set_requires_gradient_sync(i == len(micro) - 1)
            logp = completion_logprobs(model, mb, args.temperature)  # [m, T] the policy's, with grad
            mask, old_logp, a = mb["loss_mask"], mb["old_logp"], mb["adv"]  # [m, T] each
            # PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7), the clip range
            # [1 - clip_low, 1 + clip_high] (DAPO). With one optimizer step per batch the ratio is
            # 1 up to the engine's rounding, so the clip never binds: this is the policy gradient
            ratio = torch.exp(logp - old_logp)  # [m, T] pi / pi_old
            unclipped = ratio * a  # [m, T]
            clipped = ratio.clamp(1 - args.clip_low, 1 + args.clip_high) * a  # [m, T]
            pg = -torch.minimum(unclipped, clipped)  # [m, T] the pessimistic of the two, as a loss
            loss = (pg * mask).sum() / norm  # scalar
            loss.backward()
            pg_sum = pg_sum + (pg.detach() * mask).sum()
            clipped_sum = clipped_sum + ((clipped < unclipped) & (mask > 0)).sum()
            # the trainer's and the engine's log-probs of the same tokens: rounding apart (fp32)
            gap_max = torch.maximum(gap_max, ((logp.detach() - old_logp).abs() * mask).max())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        train_s = time.perf_counter() - train_start

        # 7. log: a few sums over the ranks, one all-reduce; rank 0 writes them (utils/logger.py)
        total = dist.reduce({"reward": rewards.sum(), "len": out.lengths.sum(), "pg": pg_sum, "rows": K,
                             "truncated": out.finish_reasons.count("length"), "clipped": clipped_sum,
                             "all_same": (r.max(-1).values == r.min(-1).values).sum()})
        peak = dist.reduce({"gap_max": gap_max, "train_s": train_s, "step_s": timer.elapsed(),
                            **timer.seconds}, op=MAX)  # the slowest rank's seconds
        if rank == 0:
            N = args.prompts_per_step * n  # completions over all ranks
            metrics.update({
                "rollout/reward": total["reward"] / N, "rollout/response_len": total["len"] / N,
                "rollout/truncated": total["truncated"] / N,  # cut off at max_new_tokens
                "rollout/groups_all_same": total["all_same"] / args.prompts_per_step,  # advantage 0
                "train/pg_loss": total["pg"] / tokens, "train/clip_frac": total["clipped"] / tokens,
                "train/grad_norm": float(grad_norm),  # before clipping
                "train/lr": sched.get_last_lr()[0],  # the next step's: the schedule has stepped
                "train/rows_trained": total["rows"] / N, "train/logprob_gap_max": peak["gap_max"],
                "perf/sync_s": peak["sync"], "perf/generate_s": peak["generate"],
                "perf/train_s": peak["train_s"], "perf/step_s": peak["step_s"],
                "perf/tokens_per_s": total["len"] / peak["step_s"]})
            log.log(step, metrics)

    # the end: the final policy to the engine for the last evaluation, then out as a HF checkpoint
    engine.load_weights(dist.full_tensors(model))
    final = evaluate(engine, eval_rows, reward, args, rank, world) if args.eval_every else {}
    engine.release()
    weights = [(name, t.cpu()) for name, t in dist.full_tensors(model, exact=True)]  # every rank gathers
    if rank == 0:
        log.log(args.steps - 1, {"final": True, **final})
        save_model(weights, model.config, os.path.join(args.run_dir, "final"), tokenizer_dir=args.model)
        log.close()
    dist.exit_now(0)  # leave without interpreter finalization (utils/dist.py says why)
