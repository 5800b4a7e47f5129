"""The teacher of on-policy distillation (--teacher-model): the student samples, a stronger frozen
model scores every sampled token, and the per-token reverse KL between them is a training signal
(Agarwal et al. 2024, "On-Policy Distillation of Language Models"; Qwen3 technical report, 2025;
Thinking Machines, "On-Policy Distillation", 2025). The teacher is the reference role's machinery
(roles/reference.py: sharded by FSDP2 over the trainer ranks, frozen, log-probs only) on another
checkpoint with the policy's tokenizer. On an accelerator its shards leave the device between
steps (`Reference.release`: a host copy made once, the storages freed), so the engine's generation
and the training phase never hold it; on CPU, where device memory is host memory, it stays.

One call in the step loop, after the batch is made (`Teacher.score`: batch["teacher_logp"]);
nothing when --teacher-model is not given. The signal itself is the algorithm's (rl/algos.py
`distill_advantage`): train_grpo.py adds it to the advantage, train_ppo.py to the per-token reward.
"""
import math
from dataclasses import dataclass
from typing import ClassVar

from models.hf import checked_model
from models.tokenizer import check_same_tokenizer
from roles.reference import Reference
from utils.errors import check_rules


@dataclass
class DistillArgs:
    teacher_model: str | None = None
    """on-policy distillation: a frozen teacher (HF checkpoint dir or hub id, the policy's tokenizer)
    scores each sampled token; coef x (log teacher - log policy) joins the advantage (PPO: the per-token
    reward). --reward-weights 0 trains on it alone (docs/distill.md)"""
    distill_coef: float = 1.0
    """--teacher-model: the weight of the per-token reverse-KL term (G-OPD's lambda). GRPO's reward
    advantage is in units of its group's std, so this sets the mix of the two"""
    APPLIES: ClassVar = {"distill_coef": ("teacher_model", lambda t: t is not None, "a --teacher-model")}

    def check(self):
        check_rules(self, [("distill_coef", 0 < self.distill_coef < math.inf,
                            "use a positive weight such as 1")])

    def check_model(self, model: str):
        """The teacher's checkpoint (a hub id becomes its snapshot), and its tokenizer the policy's."""

        if self.teacher_model:
            self.teacher_model = checked_model(self.teacher_model, "--teacher-model")
            check_same_tokenizer(self.teacher_model, "--teacher-model", model, "the teacher scores the "
                                 "policy's token ids")

    def alone(self, reward) -> bool:
        """Distillation alone: a teacher, and every reward weighted 0 (rewards still logged)."""
        return bool(self.teacher_model) and bool(reward.reward_weights) and not any(reward.reward_weights)


class Teacher:
    """The teacher's log-probs of each step's sampled tokens, and the distillation metrics."""

    def __init__(self, cfg: DistillArgs, plan, device, param_dtype, temperature: float, micro_batch: int,
                 releases: bool | None = None, micro_batch_tokens: int = 0):
        self.cfg = cfg
        self.model = None
        if cfg.teacher_model:
            releases = device.type != "cpu" if releases is None else releases  # tests release on CPU
            self.model = Reference(cfg.teacher_model, plan.mesh, device, param_dtype, temperature,
                                   micro_batch, releases, micro_batch_tokens)

    def score(self, batch, timer):
        """batch["teacher_logp"] [N, T]: the teacher's log-probs of the completion tokens (at the
        sampling temperature, as the policy's)."""
        if self.model is not None:
            with timer("teacher"):
                batch["teacher_logp"] = self.model.logprobs(batch)  # [N, T]

    def sums(self, batch) -> dict:
        """This rank's sums for the step's metrics; the script's `advantages` left the term it added
        in batch["distill"] and the rest of the signal (the reward's advantage, or PPO's per-token
        reward) in batch["distill_rest"]. {} when off."""
        if self.model is None:
            return {}
        mask = batch["loss_mask"]  # [N, T]
        return {"distill_kl": ((batch["old_logp"] - batch["teacher_logp"]) * mask).sum(),
                "teacher_logp": (batch["teacher_logp"] * mask).sum(),
                "distill_abs": (batch["distill"].abs() * mask).sum(),
                "distill_rest_abs": (batch["distill_rest"].abs() * mask).sum(), "distill_tokens": mask.sum()}

    @staticmethod
    def metrics(total: dict, peak: dict) -> dict:
        """The per-token reverse KL to the teacher (k1, on the policy's own tokens), the teacher's
        mean log-prob of them, the distillation term's share of the signal, the teacher's seconds."""
        if "distill_kl" not in total:
            return {}
        tokens, both = max(1.0, total["distill_tokens"]), total["distill_abs"] + total["distill_rest_abs"]
        return {"distill/reverse_kl": total["distill_kl"] / tokens,
                "distill/teacher_logp": total["teacher_logp"] / tokens,
                "distill/share": total["distill_abs"] / both if both else 0.0,
                "perf/teacher_s": peak["teacher_s"]}
