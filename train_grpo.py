"""GRPO with FSDP2 and parallel controllers.

    torchrun --standalone --nproc-per-node 2 train_grpo.py          # the built-in task, offline
    torchrun --standalone --nproc-per-node 3 train_grpo.py --placement disaggregate --rollout-ranks 1 \
        --max-staleness 1                                # 2 trainers + 1 rollout rank, overlapped

Every rank runs this same script and is the controller of its own share of each step's
prompts (G-Core's parallel controllers): it generates, scores and computes its groups'
advantages itself; no rank ever gathers the batch. Only FSDP2's collectives (weight
all-gather, gradient reduce-scatter), the weight sync and the metric reductions are
collective. With --placement disaggregate the rollout ranks run `roles.rollout.serve`
instead, and each trainer talks to its own rollout rank point to point.
"""
import os
import resource
import signal
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro

import placement
from roles.actor import Actor
from roles.reference import Reference
from roles.reward import Reward
from roles.rollout import RemoteEngine, SamplingParams, make_engine, serve
from utils import algos, checkpoint, dist
from utils.data import (BUILTIN, Tokenizer, load_rows, make_batch, micro_batches, prompt_seed, rank_slice,
                        step_indices, tokenize_rows)
from utils.logger import Logger
from utils.model import read_config, save_model


@dataclass
class Args:
    model: str = "assets/arith-tiny"
    """local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"""
    dataset: str = BUILTIN
    """'builtin:arith', a local .jsonl/.json/.parquet file, or a hub dataset id"""
    prompt_column: str = "prompt"
    """dataset column holding the prompt (a string or a list of chat messages)"""
    answer_column: str | None = "answer"
    """dataset column holding the reference answer (none: reward functions get no answer)"""
    eval_dataset: str | None = None
    """held-out prompts; default: the built-in task's eval split, or a hub id's 'test' split"""
    eval_every: int = 25
    """evaluate the held-out reward every this many steps (0: never)"""
    eval_prompts: int = 256
    """at most this many held-out prompts per evaluation"""
    steps: int = 250
    """optimizer steps (one rollout batch each)"""
    prompts_per_step: int = 64
    """prompts per step over all trainer ranks (each takes prompts_per_step / trainers)"""
    num_generations: int = 8
    """completions per prompt: the group of GRPO's group-relative advantage"""
    max_new_tokens: int = 8
    """completion length limit"""
    max_prompt_tokens: int = 256
    """longer prompts are skipped and counted"""
    temperature: float = 1.0
    """sampling temperature (also applied to the trainer's log-probs)"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    rewards: tuple[str, ...] = ("accuracy",)
    """reward terms: accuracy, format, or module:function (fn(prompts, completions, **columns))"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward term (default: all 1)"""
    reward_timeout_s: float = 60.0
    """a reward function call running longer scores 0 for its samples (counted in reward/failures)"""
    code_timeout_s: float = 5.0
    """the code reward's wall-clock limit per completion (sandboxed process)"""
    code_memory_mb: int = 512
    """the code reward's memory limit per completion"""
    scale_std: bool = True
    """divide group advantages by the group's reward std (GRPO); off = Dr. GRPO"""
    lr: float = 3e-4
    """AdamW learning rate (after warm-up)"""
    warmup_steps: int = 3
    """linear learning-rate warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    max_skipped_steps: int = 10
    """a step whose gradients are NaN/inf is skipped and counted; after this many the run stops"""
    clip_low: float = 0.2
    """PPO ratio clip below: 1 - clip_low"""
    clip_high: float = 0.28
    """PPO ratio clip above: 1 + clip_high (DAPO's clip-higher)"""
    kl_coef: float = 0.0
    """KL penalty to the reference policy (0: no reference model is built)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman 2020)"""
    loss_agg: Literal["token", "sequence"] = "token"
    """token: every token weighs the same (DAPO); sequence: mean per completion first (GRPO)"""
    minibatches: int = 1
    """optimizer steps per rollout batch (>1: later ones are off-policy; the ratio and clip handle it)"""
    micro_batch_size: int = 64
    """completions per forward/backward on each rank"""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 MixedPrecisionPolicy param dtype (bf16 on GPU; gradients reduce in fp32)"""
    engine: Literal["auto", "native", "vllm"] = "auto"
    """generation engine: auto = vLLM on GPU when installed, else native (see README for vLLM on CPU)"""
    placement: Literal["colocate", "disaggregate"] = "colocate"
    """colocate: every rank trains and generates, taking turns; disaggregate: --rollout-ranks ranks
    only generate while the others only train"""
    rollout_ranks: int = 0
    """disaggregate: the last K ranks generate (each serves (world - K) / K trainers)"""
    max_staleness: int = 0
    """disaggregate: generate up to this many steps ahead while training, so samples are up to this
    many policy versions old (0: on-policy, the same run as colocate)"""
    sync_bucket_mb: float = 64.0
    """disaggregate: weights are gathered and broadcast to the rollout ranks in buckets of this size"""
    seed: int = 0
    """seeds init, data order and sampling (per prompt: results do not depend on the ranks)"""
    run_dir: str = "runs/grpo"
    """metrics.jsonl, config.json and the final model (final/, HF format) go here"""
    save_final: bool = True
    """write the trained policy as a HF checkpoint to run_dir/final at the end"""
    save_every: int = 50
    """save the sharded training state (DCP) every this many steps, and on SIGTERM (0: SIGTERM only)"""
    keep_last: int = 2
    """complete checkpoints to keep"""
    resume: str = "restart"
    """restart: continue from run_dir's newest complete checkpoint when torchrun restarted the job
    (--max-restarts), else start afresh; auto: continue from it whenever there is one; none; or a path"""
    save_hf_every: int = 0
    """also export a HF checkpoint (run_dir/hf/step_N) every this many steps (0: off)"""
    track: bool = False
    """log to wandb (pip install wandb)"""
    wandb_project: str = "rl-trainer"
    """wandb project name"""
    timeout_s: float = 300.0
    """a collective waiting longer than this fails (a dead rank must not hang the job)"""


def export_hf(actor, path, rank, tokenizer_dir):
    """Every rank joins the per-tensor gathers; rank 0 writes a HF checkpoint."""
    weights = [(name, t.cpu()) for name, t in actor.full_weights(exact=True)]
    if rank == 0:
        save_model(weights, actor.config, path, tokenizer_dir=tokenizer_dir)


def step_prompts(rows, step, args, rank, dp):
    """This rank's rows of `step` and their sampling seeds: per (seed, step, position in the
    step's batch), never per rank, so that the samples do not depend on the placement."""
    batch_idx = step_indices(len(rows), step, args.prompts_per_step, args.seed)
    mine = rank_slice(list(enumerate(batch_idx)), rank, dp)
    return [rows[i] for _, i in mine], [prompt_seed(args.seed, step, pos) for pos, _ in mine]


def evaluate(engine, scorer, rows, args, rank, dp, group):
    """Held-out accuracy: one sample per prompt at the training temperature, seeded per prompt."""
    mine = rows[rank::dp]
    params = SamplingParams(1, args.temperature, args.top_p, args.top_k, args.max_new_tokens)
    out = engine.generate([r["ids"] for r in mine], params, [prompt_seed(args.seed, -1, rank + i * dp)
                                                             for i in range(len(mine))])
    correct = scorer.score([r["prompt"] for r in mine], out.texts, {
        "answer": [r["answer"] for r in mine], "finish_reason": out.finish_reasons})[0]
    return dist.reduce({"correct": correct.sum(), "count": len(mine)}, group=group)


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:  # a wrong --model stops every rank here, before any process group, with what to change
        cfg, tok = read_config(args.model), Tokenizer(args.model)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--model: {e}") from None
    rank, world, device = dist.init(args.timeout_s)
    plan = placement.plan(args.placement, rank, world, device, args.prompts_per_step, args.rollout_ranks,
                          args.max_staleness, args.timeout_s)
    torch.manual_seed(args.seed)
    param_dtype = getattr(torch, args.param_dtype)
    max_len = args.max_prompt_tokens + args.max_new_tokens
    if plan.role == "rollout":  # disaggregate: this rank only generates, in its own loop, until told to stop
        t = time.perf_counter()
        engine = make_engine(args.engine, args.model, cfg, tok, device, param_dtype, max_len, args.seed,
                             own_process=True)  # a vLLM of its own world: the trainers do not join its groups
        if rank == plan.layout.dp:  # the first rollout rank
            print(f"rollout ranks: {type(engine).__name__}, ready in {time.perf_counter() - t:.0f}s", flush=True)
        serve(engine, plan.trainers, plan.sync_group, plan.requests, device)
        engine.close()
        dist.exit_now(0)
    dp, group = plan.dp, plan.group  # the trainer ranks (all ranks in colocate)

    # data: every rank tokenises the same rows and later takes its own slice of each step
    rows, skipped = tokenize_rows(load_rows(args.dataset, "train", args.prompt_column, args.answer_column, args.seed),
                                  tok, args.max_prompt_tokens)
    eval_source = args.eval_dataset or (BUILTIN if args.dataset == BUILTIN else None)
    if eval_source is None and not os.path.exists(args.dataset):
        eval_source = args.dataset  # a hub id: its test split
    eval_rows = []
    if eval_source and args.eval_every:
        eval_rows = tokenize_rows(load_rows(eval_source, "test", args.prompt_column, args.answer_column, args.seed),
                                  tok, args.max_prompt_tokens)[0][:args.eval_prompts]

    # roles
    actor = Actor(args.model, plan.mesh, device, args.lr, args.warmup_steps, args.weight_decay,
                  args.max_grad_norm, param_dtype)
    ref = Reference(args.model, plan.mesh, device, param_dtype) if args.kl_coef > 0 else None
    reward = Reward(args.rewards, args.reward_weights, args.reward_timeout_s, args.code_timeout_s, args.code_memory_mb)
    reward_eval = Reward(["accuracy"])
    if args.placement == "disaggregate":  # this rank's rollout rank, behind the engine interface
        engine = RemoteEngine(plan.peer, actor.weight_specs(), int(args.sync_bucket_mb * 2**20), plan.sync_group,
                              plan.requests, rank == 0, device)
    else:
        engine = make_engine(args.engine, args.model, actor.config, tok, device, param_dtype, max_len, args.seed)
    sampling = SamplingParams(args.num_generations, args.temperature, args.top_p, args.top_k, args.max_new_tokens)

    # resume: the sharded state of the newest complete checkpoint (a partial one is skipped)
    start = 0
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    path, partial = checkpoint.find(args.run_dir) if args.resume == "auto" or args.resume == "restart" and restarted \
        else (None, [])
    if args.resume not in ("auto", "restart", "none"):
        path = args.resume
    elif not path and rank == 0 and checkpoint.find(args.run_dir)[0]:
        print(f"{args.run_dir} holds checkpoints of an earlier run: starting afresh (--resume auto continues it)",
              flush=True)
    if partial and rank == 0:
        print(f"ignoring incomplete checkpoint(s): {partial}", flush=True)
    if path:
        start = checkpoint.load(path, actor, rank)["step"]  # steps done
        if rank == 0:
            print(f"resumed from {path}: continuing at step {start + 1}", flush=True)
    stop = {"sigterm": False}  # torchrun (or a scheduler) asks us to stop: save, then exit
    signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))
    log = Logger(args.run_dir, asdict(args), args.steps, args.track, args.wandb_project, start) if rank == 0 else None
    if rank == 0:
        print(f"{world} rank(s), {args.placement} ({dp} trainer(s)), {type(engine).__name__}; model {args.model} "
              f"({actor.config.num_params() / 1e6:.2f}M params); {len(rows)} train prompts ({skipped} over "
              f"--max-prompt-tokens skipped), {len(eval_rows)} eval",
              flush=True)

    per_rank = args.prompts_per_step // dp
    skipped_steps, stopped = 0, False  # stopped: some rank was asked to stop (SIGTERM)
    in_flight, submitted = {}, start  # step -> (this rank's rows, request): rollouts sent ahead of training
    for step in range(start, args.steps + 1):  # the extra step only evaluates the final policy
        t_step = time.perf_counter()
        metrics = {}
        # weight sync: the policy after `step` updates goes to this rank's engine (colocate) or is
        # broadcast in buckets to the rollout ranks (disaggregate), once they have answered every
        # request sent ahead (they serve in order)
        t = time.perf_counter()
        engine.collect()
        wait_s = time.perf_counter() - t
        sync = placement.sync(actor, engine, version=step)
        t = time.perf_counter()
        if args.eval_every and eval_rows and (step % args.eval_every == 0 or step == args.steps):
            e = evaluate(engine, reward_eval, eval_rows, args, rank, dp, group)
            metrics["eval/accuracy"] = e["correct"] / e["count"]
        eval_s = time.perf_counter() - t
        if step == args.steps:
            placement.release(engine)
            if rank == 0:
                log.log(step - 1, {"final": True, **metrics})
            break

        # rollout: this rank's prompts only. With --max-staleness S the prompts of up to S steps ahead
        # go out too, so that the rollout ranks generate them while this rank trains; their samples are
        # then up to S versions old, and the ratio to the engine's log-probs corrects for it
        t = time.perf_counter()
        while submitted <= min(step + args.max_staleness, args.steps - 1):
            ahead, seeds = step_prompts(rows, submitted, args, rank, dp)
            in_flight[submitted] = ahead, engine.submit([r["ids"] for r in ahead], sampling, seeds)
            submitted += 1
        local, request = in_flight.pop(step)
        out = engine.result(request)
        gen_s = time.perf_counter() - t  # colocate: generating; disaggregate: waiting for the samples
        placement.release(engine)
        prompts = [r["ids"] for r in local]

        t_busy = time.perf_counter()
        # reward and group advantages, all local to this controller
        n = args.num_generations
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731 (per prompt -> per sample)
        columns = {k: rep([r.get(k) for r in local]) for k in local[0] if k not in ("prompt", "text", "ids")}
        rewards, parts, failures = reward.score(rep([r["prompt"] for r in local]), out.texts,
                                                {**columns, "finish_reason": out.finish_reasons})
        adv = algos.group_advantages(rewards.view(per_rank, n), args.scale_std).view(-1)  # [N]

        batch = make_batch(rep(prompts), out.tokens, out.lengths, tok.pad_id, device)
        batch.update(behaviour=out.logprobs.to(device), adv=adv.to(device))
        t = time.perf_counter()
        if ref:
            batch["ref"] = ref.logprobs(batch, args.temperature, args.micro_batch_size)
        ref_s = time.perf_counter() - t

        # update: each minibatch's loss is normalised by its token (or sequence) count over all ranks
        minis = list(micro_batches(batch, -(-len(rewards) // args.minibatches)))
        counts = dist.reduce(group=group, values={"tokens": batch["mask"].sum(), "seqs": len(rewards), **{
            f"norm{i}": m["mask"].sum() if args.loss_agg == "token" else len(m["adv"]) for i, m in enumerate(minis)}})
        t = time.perf_counter()
        sums, maxes = {}, {}
        for i, mini in enumerate(minis):
            s, m = actor.train_step(
                mini, temperature=args.temperature, clip_low=args.clip_low, clip_high=args.clip_high,
                kl_coef=args.kl_coef, kl_estimator=args.kl_estimator, loss_agg=args.loss_agg,
                norm=counts[f"norm{i}"] / dp, micro_batch_size=args.micro_batch_size)
            sums = {k: sums.get(k, 0) + v for k, v in s.items()}
            maxes = {k: torch.maximum(torch.as_tensor(maxes.get(k, v)), torch.as_tensor(v)) for k, v in m.items()}
        train_s = time.perf_counter() - t
        busy_s = time.perf_counter() - t_busy  # the trainer role's own work: reward, reference, update

        # where the time went, per role. The trainer role waits while samples are made (colocate: this
        # rank makes them; disaggregate: its rollout rank does). `device_idle` is the seconds in which
        # this rank's device (and, disaggregate, its share of its rollout rank's) had nothing to do
        step_s = time.perf_counter() - t_step
        if args.placement == "disaggregate":
            roll = engine.take_stats()  # the rollout rank's seconds since the last step
            roll_busy, roll_idle = roll["busy_s"] + roll["sync_s"], roll["idle_s"]
            device_idle = wait_s + gen_s + eval_s + roll_idle * plan.layout.rollout / dp
        else:
            roll_busy = gen_s + eval_s
            roll_idle = step_s - roll_busy
            device_idle = max(0.0, step_s - roll_busy - busy_s - sync["sync_s"])  # waits on other ranks only

        # metrics: one sum-reduce and one max-reduce over the trainers; rank 0 prints and writes them
        groups = rewards.view(per_rank, n)
        total = dist.reduce(group=group, values={
            **sums, **{f"reward/{k}": v.sum() for k, v in parts.items()}, "reward": rewards.sum(),
            "failures": failures, "len": out.lengths.sum(), "truncated": out.finish_reasons.count("length"),
            "all_same": (groups.max(-1).values == groups.min(-1).values).sum(), "staleness": step - out.version,
            "trainer_busy": busy_s, "trainer_idle": wait_s + gen_s + eval_s, "rollout_busy": roll_busy,
            "rollout_idle": roll_idle, "device_idle": device_idle})
        mem = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30  # GPU memory, else RSS
        peak = dist.reduce({**maxes, "gen_s": gen_s, "ref_s": ref_s, "train_s": train_s, **sync, "mem_gib": mem,
                            "step_s": step_s, "staleness": step - out.version, "sigterm": stop["sigterm"]},
                           op=torch.distributed.ReduceOp.MAX, group=group)
        skipped_steps += int(peak["skipped"])
        if rank == 0:
            N, T = counts["seqs"], counts["tokens"]
            metrics.update({
                "rollout/reward": total["reward"] / N, "rollout/response_len": total["len"] / N,
                "rollout/truncated": total["truncated"] / N, "rollout/groups_all_same": total["all_same"] / (N / n),
                **{f"rollout/{k}": v / N for k, v in total.items() if k.startswith("reward/")},
                "reward/failures": total["failures"],
                "train/pg_loss": total["pg_loss"] / T, "train/kl": total["kl"] / T,
                "train/clip_frac": total["clipped_tokens"] / T, "train/grad_norm": peak["grad_norm"],
                "train/lr": actor.sched.get_last_lr()[0], "train/skipped_steps": skipped_steps,
                "train/logprob_gap_mean": total["gap_sum"] / total["tokens"], "train/logprob_gap_max": peak["gap_max"],
                "train/rows_trained": total["rows"] / N,  # the rest had advantage 0 (and no KL term): skipped
                "perf/generate_s": peak["gen_s"], "perf/reference_s": peak["ref_s"], "perf/train_s": peak["train_s"],
                "perf/sync_s": peak["sync_s"], "perf/sync_bytes": peak["sync_bytes"], "perf/step_s": peak["step_s"],
                "perf/tokens_per_s": total["len"] / peak["step_s"], "perf/peak_mem_gib": peak["mem_gib"],
                "perf/sync_gather_s": peak["sync_gather_s"],
                # per role, mean over trainer ranks (rollout: over the rollout ranks serving them)
                **{f"placement/{k}_s": total[k] / dp for k in ("trainer_busy", "trainer_idle", "rollout_busy",
                                                               "rollout_idle")},
                "placement/idle_share": total["device_idle"] / (world * peak["step_s"]),
                "placement/staleness_max": peak["staleness"], "placement/staleness_mean": total["staleness"] / dp,
            })
            log.log(step, metrics)
        if skipped_steps > args.max_skipped_steps:
            raise SystemExit(f"stopping: {skipped_steps} steps had NaN/inf gradients (--max-skipped-steps "
                             f"{args.max_skipped_steps}); lower --lr or check the rewards and the data. The last "
                             f"complete checkpoint is in {args.run_dir}/checkpoints")
        if args.save_hf_every and (step + 1) % args.save_hf_every == 0:
            export_hf(actor, os.path.join(args.run_dir, "hf", f"step_{step + 1}"), rank, args.model)
        if peak["sigterm"] or (args.save_every and (step + 1) % args.save_every == 0):
            saved = checkpoint.save(args.run_dir, step + 1, actor, args.keep_last, rank)
            if rank == 0 and saved["error"]:
                print(f"checkpoint after step {step + 1} FAILED ({saved['error']}); the previous one "
                      f"({checkpoint.find(args.run_dir)[0]}) is intact; training goes on", flush=True)
            elif rank == 0:
                print(f"saved {saved['path']} in {saved['seconds']:.2f}s", flush=True)
            if peak["sigterm"]:
                stopped = True
                break
    if args.save_final and not stopped:  # the same on every rank (reduced): the export is collective
        export_hf(actor, os.path.join(args.run_dir, "final"), rank, args.model)
    if rank == 0:
        log.close()
    engine.close()  # before the process group: vLLM built its own groups on it
    dist.exit_now(0)
