"""What a run needs per device, estimated from the model config and the flags before anything
loads: printed at start-up (train_grpo.py, train_ppo.py), checked against the measured peaks of
runs on CPU (tests/test_memory.py), and behind the launch recipes in docs/scale.md.

A rank holds some memory for the whole run and the rest one phase at a time (the engine drops
its weights before training: `release`), so its peak is held + the largest phase. In bytes, for
P parameters sharded by FSDP2 over d trainer ranks and p bytes per element of the param dtype:
- held: the fp32 master shards and Adam's two moments, 4 + 8 bytes per parameter over d; the
  reference, reward model and (on CPU) the distillation teacher's fp32 shards; PPO's critic's own shards and
  moments. With LoRA (L adapter parameters): the base and the adapters' shards, 4 (P + L) / d,
  moments for the adapters only, 8 L / d, and no reference (it is the actor with its adapters off).
- train: the gradient shards (4 P / d, LoRA 4 L / d; with a single micro-batch, the larger of them and the
  activations, which the backward frees as it makes the gradients), what FSDP2 holds unsharded
  in p (the root's own parameters: embeddings, head, final norm; and two decoder blocks, the
  current and the prefetched one), what one micro-batch's forward keeps for its backward (per
  token and layer, in p: the residual input, the normalised input and its scaled copy, twice (6
  h); q three times (projection, rotated half, after RoPE) and the attention output twice (5 q);
  k three times and v once (4 kv); the MLP's gate, its SiLU, up and their product (4 i):
  measured on CPU within 10% of what autograd keeps; LoRA's x A^T adds r per linear, left out),
  and the logits [tokens, V] in fp32 three times, at most three chunks of models.decoder.LOGITS_BUDGET
  (the head's log-probs run in chunks of rows: models.decoder.head_logprobs).
- generate: the engine's full copy of the weights in p; on CPU in fp32 the native engine's
  oneDNN-packed decode copy (`FusedDecoder.prepare`: the same size again); its KV cache
  [layers, rows, kv heads, prompt + new tokens, head dim] x 2 in p (finished rows leave it in
  place; episodes: the turn before's, kept with the part it shed, lives until its keys are copied
  into the next turn's prompt cache, up to 2x). vLLM on a GPU instead
  takes its `gpu_memory_utilization` share of the device. With LoRA the native engine keeps
  its base copy for the run (held), and generation adds the merged copy of the adapted weights.
- judge (GRPO, an engine judge): the same for the judge model, at its own phase.
- teacher (on an accelerator, where it leaves the device between steps: roles/teacher.py): its
  fp32 shards, at its own phase.
- sync_buffers (disaggregate): trainer 0's and each rollout rank's two reusable buckets for the
  weight broadcast, of which the weights touch min(2 x --sync-bucket-mb, their size in p).
- stream (--stream, a native engine; roles/stream.py): the rollout rank's pool has --stream-rows rows
  (else one step's samples of its trainers), and it holds, for the run, the weight versions received
  whole and not yet put in (trainers run at most K + 1 versions ahead of the pool's: K + 1 copies in
  p, K = --max-staleness) and, with evaluations on, a second engine for them (its weights, packed
  copy and KV cache for one trainer's held-out prompts; LoRA: a version is its adapters alone, and
  the evaluator has a base of its own). vLLM's worker takes the weights itself and evaluates in its
  own pool: neither.
"""
import re
from dataclasses import dataclass, field

import torch

from engines.make import engine_kind
from models import lora
from models.config import ModelConfig
from models.decoder import LOGITS_BUDGET
from models.hf import read_config

GIB = 2**30


@dataclass
class Workload:
    """What the flags make one rank do."""
    param_bytes: int  # 4 fp32, 2 bf16
    micro_batch: int  # completions per forward/backward
    prompt_len: int  # the longest prompt (at most --max-prompt-tokens)
    new_tokens: int  # --max-new-tokens
    rows: int  # completions one trainer trains per step (prompts per trainer x generations)
    gen_rows: int  # the most completions one engine call makes for one trainer (a step's or an eval's)
    reference: bool = False
    critic: ModelConfig | None = None
    reward_model: ModelConfig | None = None
    teacher: ModelConfig | None = None  # --teacher-model
    teacher_released: bool = False  # on an accelerator: its shards leave the device between steps
    judge: ModelConfig | None = None
    judge_len: int = 0  # the judge's prompt + its answer, in tokens
    vllm_share: float = 0.0  # vLLM on a GPU: its gpu_memory_utilization of device_bytes
    device_bytes: int = 0
    packed_decode: bool = True  # the native engine on CPU in fp32 keeps a packed copy
    bucket_bytes: int = 64 * 2**20  # --sync-bucket-mb (disaggregate)
    lora_params: int = 0  # LoRA's adapter parameters (models.lora.count); 0: the full model trains
    lora_merged: int = 0  # LoRA, native engine: the adapted weights' elements (models.lora.adapted)
    micro_batch_tokens: int = 0  # >0: packed micro-batches of at most this many tokens (models/packing.py)
    stream_rows: int = 0  # --stream: the rollout rank's pool rows (0: not streaming)
    stream_versions: int = 0  # --stream, native engine: weight versions held received, not yet put in
    stream_eval_rows: int = 0  # --stream, native engine, evaluations on: the evaluator engine's batch


@dataclass
class Need:
    """One kind of rank: bytes held for the run, and bytes per phase (one phase at a time)."""
    held: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    def total(self) -> int:
        return sum(self.held.values()) + max((sum(p.values()) for p in self.phases.values()), default=0)


def activations_per_token(cfg: ModelConfig) -> int:
    """Elements one token's forward keeps for the backward, over all layers (see the docstring). A
    MoE model's sparse layer keeps, per token, its k experts' SwiGLU inputs and outputs (4 x
    moe_intermediate_size each), the copies of its hidden state gathered for them and their weighed
    outputs (2 x hidden each), and the router's logits and probabilities (2 x experts)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = []
    for i in range(cfg.num_hidden_layers):
        if cfg.moe is not None and cfg.moe.sparse(i):
            m = cfg.moe
            per_expert = 4 * m.moe_intermediate_size + 2 * cfg.hidden_size
            mlp = m.num_experts_per_tok * per_expert + 2 * m.num_experts
        else:
            mlp = 4 * cfg.intermediate_size
        per_layer.append(6 * cfg.hidden_size + 5 * q + 4 * kv + mlp)
    return sum(per_layer)


def kv_cache(cfg: ModelConfig, rows: int, length: int, p: int) -> int:
    return 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * length * cfg.head_dim * p


def training(cfg: ModelConfig, d: int, w: Workload, seq: int) -> dict[str, int]:
    """A training phase under FSDP2 over d ranks: gradients, gathered blocks, activations."""
    P = cfg.num_params()
    blocks = [cfg.layer_params(i) for i in range(cfg.num_hidden_layers)]  # a MoE model's differ
    root = P - sum(blocks)
    tokens = min(w.micro_batch, w.rows) * seq
    several = w.rows > w.micro_batch  # micro-batches in a step
    if w.micro_batch_tokens:  # packed: the budget, or one whole row past it (prompts counted in full)
        tokens = min(max(w.micro_batch_tokens, seq), tokens)
        several = several or w.rows * seq > tokens
    head = cfg.num_labels if cfg.scores else cfg.vocab_size
    logits = tokens * head * 4 if cfg.scores else min(tokens * head * 4, LOGITS_BUDGET)
    parts = {"gathered": (root + 2 * max(blocks)) * w.param_bytes, "logits": 3 * logits}
    trained = w.lora_params if w.lora_params and not cfg.scores else P  # a critic trains in full
    grads, kept = 4 * trained // d, tokens * activations_per_token(cfg) * w.param_bytes
    if several:  # earlier micro-batches' gradients wait while the next one's activations live
        parts.update(grads=grads, activations=kept)
    else:  # one micro-batch: its backward frees the activations as it makes the gradients
        parts["activations" if kept >= grads else "grads"] = max(kept, grads)
    return parts


def generation(cfg: ModelConfig, rows: int, length: int, w: Workload) -> dict[str, int]:
    """A generate phase: the engine's weights, its packed copy and KV cache (vLLM on a GPU: its share)."""
    if w.vllm_share:
        return {"vllm_pool": int(w.vllm_share * w.device_bytes)}
    weights = cfg.num_params() * w.param_bytes
    packed = weights if w.packed_decode and w.param_bytes == 4 else 0
    engine = w.lora_merged * w.param_bytes if w.lora_merged else weights  # LoRA: the base is held
    return {"engine": engine, "packed": packed, "kv": kv_cache(cfg, rows, length, w.param_bytes)}


def estimate(cfg: ModelConfig, mode: str, dp: int, rollout: int, w: Workload) -> dict[str, Need]:
    """Each kind of rank's need: {"trainer": ...} and, disaggregated, {"rollout": ...} (a rollout
    rank generates for dp / rollout trainers at once)."""
    seq = w.prompt_len + w.new_tokens
    P = cfg.num_params()
    L = w.lora_params
    trainer = Need({"weights": 4 * (P + L) // dp, "adam": 8 * (L or P) // dp},
                   {"train": training(cfg, dp, w, seq)})
    if w.reference and not L:  # LoRA's reference is the actor with its adapters off
        trainer.held["reference"] = 4 * P // dp
    if w.reward_model is not None:
        trainer.held["reward_model"] = 4 * w.reward_model.num_params() // dp
    if w.teacher is not None:
        shards = 4 * w.teacher.num_params() // dp
        if w.teacher_released:
            trainer.phases["teacher"] = {"teacher": shards}
        else:
            trainer.held["teacher"] = shards
    if w.critic is not None:
        C = w.critic.num_params()
        trainer.held.update({"critic": 4 * C // dp, "critic_adam": 8 * C // dp})
        trainer.phases["critic train"] = training(w.critic, dp, w, seq)
    if w.judge is not None:
        trainer.phases["judge"] = generation(w.judge, w.rows, w.judge_len, w)  # a step's completions
    engine_base = {"engine_base": P * w.param_bytes} if w.lora_merged else {}  # LoRA, native engine
    if mode != "disaggregate":
        trainer.phases["generate"] = generation(cfg, w.gen_rows, seq, w)
        trainer.held.update(engine_base)
        return {"trainer": trainer}
    buffers = min(2 * w.bucket_bytes, P * w.param_bytes)  # trainer 0 sends, rollout ranks take buckets
    trainer.held["sync_buffers"] = buffers
    rows = w.stream_rows or w.gen_rows * dp // rollout  # for all its trainers at once (--stream: its pool)
    generate = generation(cfg, rows, seq, w)
    rollout_rank = Need({"sync_buffers": buffers, **engine_base}, {"generate": generate})
    if w.stream_versions:  # LoRA: after the base, a version is its adapters alone
        rollout_rank.held["staged"] = w.stream_versions * (L or P) * w.param_bytes
    if w.stream_eval_rows:  # LoRA: with a base of its own
        evaluator = {**generation(cfg, w.stream_eval_rows, seq, w), **engine_base}
        rollout_rank.held["evaluator"] = sum(evaluator.values())
    return {"trainer": trainer, "rollout": rollout_rank}


def describe(plan: dict[str, Need]) -> str:
    """One line: each kind of rank's total, what it holds, and its phases (the largest counts);
    in GiB, or MiB for a run under 1 GiB."""
    unit, size = ("GiB", GIB) if max(n.total() for n in plan.values()) >= GIB else ("MiB", 2**20)

    def parts(named: dict[str, int]) -> str:
        return ", ".join(f"{k} {v / size:.2f}" for k, v in named.items() if v >= size / 200) or "< 0.01"

    kinds = []
    for kind, need in plan.items():
        phases = "; ".join(f"{name}: {parts(p)}" for name, p in need.phases.items())
        held = f"{parts(need.held)} + " if need.held else ""
        kinds.append(f"{kind} {need.total() / size:.2f} = {held}the largest of ({phases})")
    return f"memory plan per device (estimate, {unit}) | " + " | ".join(kinds)


def for_run(args, cfg: ModelConfig, mode: str, dp: int, rollout: int, device, prompt_len: int, eval_rows: int,
            critic: str | None = None) -> str:
    """The start-up line for a train script's flags (GRPO and PPO share these names); prompt_len:
    the longest prompt of the data, eval_rows: the held-out prompts generated at each eval."""
    rows = args.prompts_per_step // dp * args.num_generations
    judge_args = getattr(args, "judge", None)  # train_grpo.py's
    judge = judge_args.judge_model if judge_args else None
    native = engine_kind(args.sampling.engine, device) == "native"
    gpu_vllm = not native and device.type == "cuda"
    value = read_config(critic) if critic else None  # a value model: one score per token
    value = value if value is None or value.scores else value.with_score_head(1)
    w = Workload(param_bytes=2 if args.compute.param_dtype == "bfloat16" else 4,
                 micro_batch=args.micro_batch_size, micro_batch_tokens=args.micro_batch_tokens,
                 prompt_len=prompt_len,
                 new_tokens=args.sampling.max_new_tokens, rows=rows,
                 gen_rows=max(rows, -(-eval_rows // dp)), reference=args.kl_coef > 0, critic=value,
                 reward_model=read_config(args.reward.reward_model) if args.reward.reward_model else None,
                 judge=read_config(judge) if judge else None,
                 teacher=read_config(teacher) if (teacher := args.distill.teacher_model) else None,
                 teacher_released=device.type != "cpu",  # as roles/teacher.py decides
                 judge_len=prompt_len + args.sampling.max_new_tokens + 512  # the judge template's own words
                 + (judge_args.judge_max_new_tokens if judge_args else 0),
                 vllm_share=0.5 if gpu_vllm else 0.0, bucket_bytes=int(args.placement.sync_bucket_mb * 2**20),
                 device_bytes=torch.cuda.get_device_properties(device).total_memory if gpu_vllm else 0,
                 lora_params=lora.count(cfg, args.lora),
                 lora_merged=lora.adapted(cfg, args.lora) if native else 0)
    stream = getattr(args, "stream", None)  # train_grpo.py's
    if stream is not None and stream.stream:
        w.stream_rows = stream.stream_rows or rows * dp // rollout
        if native:
            w.stream_versions = args.placement.max_staleness + 1
            w.stream_eval_rows = -(-eval_rows // dp) if args.data.eval_every else 0
    return describe(estimate(cfg, mode, dp, rollout, w))


def trainer_gib(printed: str) -> float:
    """The trainer ranks' total, in GiB, from a run's output holding `describe`'s line."""
    unit, total = re.search(r"estimate, (GiB|MiB)\) \| trainer ([0-9.]+) =", printed).groups()
    return float(total) / (1024 if unit == "MiB" else 1)
