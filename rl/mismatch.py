"""The trainer/engine log-prob mismatch (--recompute-old-logp, --mismatch): one call before the
update (`Correction.apply`), nothing when both are off. The trainer recomputes the old policy's
log-probs, which replace the engine's as the ratio's denominator, and the engine's gap
r = trainer-old / engine is corrected by TIS, MIS or IcePop (rl/algos.py `mismatch_weights`:
the formulas and their papers)."""
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from rl import algos
from utils.errors import check_rules


@dataclass
class MismatchArgs:
    recompute_old_logp: bool = False
    """the trainer recomputes the old policy's log-probs before the update (decoupled PPO): the clip then
    acts on trainer/trainer ratios, and the engine's gap is left to --mismatch"""
    mismatch: Literal["none", "tis", "mis", "icepop"] = "none"
    """the trainer/engine log-prob mismatch, r = trainer-old / engine (implies --recompute-old-logp):
    tis: weight min(r, --mismatch-high) on each token's loss; mis: tokens (sequences) with r outside
    [--mismatch-low, --mismatch-high] leave the loss; icepop: weight r inside that range, 0 outside"""
    mismatch_level: Literal["token", "sequence", "geometric"] = "token"
    """tis, mis, icepop: r per token, per sequence (the product over its tokens) or their geometric mean"""
    mismatch_low: float = 0.5
    """mis, icepop: the lower bound on r"""
    mismatch_high: float = 2.0
    """tis: the truncation C; mis, icepop: the upper bound on r"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "mismatch_level": ("mismatch", lambda m: m != "none", "--mismatch tis, mis or icepop"),
        "mismatch_low": ("mismatch", lambda m: m in ("mis", "icepop"), "--mismatch mis or icepop"),
        "mismatch_high": ("mismatch", lambda m: m != "none", "--mismatch tis, mis or icepop")}

    def check(self):
        check_rules(self, [
            ("mismatch_low", 0 <= self.mismatch_low <= 1, "use a number in [0, 1], such as 0.5"),
            ("mismatch_high", 1 <= self.mismatch_high < math.inf, "use 1 or more, such as 2")])


class Correction:
    def __init__(self, cfg: MismatchArgs, actor):
        self.cfg, self.actor = cfg, actor
        self.on = cfg.recompute_old_logp or cfg.mismatch != "none"
        self.sums, self.maxes = {}, {}  # the last step's, for its metrics (none without --mismatch)

    def apply(self, batch, timer):
        """The trainer's old log-probs replace the engine's in `batch` (the engine's kept as
        engine_logp), and the correction's weight and mask go into it; its metric sums and maxima
        into `sums` and `maxes`."""
        if not self.on:
            return
        cfg = self.cfg
        with timer("old_logp"):
            batch["engine_logp"] = batch["old_logp"]
            batch["old_logp"] = self.actor.logprobs(batch)  # [N, T]
        if cfg.mismatch == "none":
            return
        mask = batch["loss_mask"]  # [N, T]
        weight, kept, r = algos.mismatch_weights(batch["old_logp"], batch["engine_logp"], mask, cfg.mismatch,
                                                 cfg.mismatch_level, cfg.mismatch_low, cfg.mismatch_high)
        batch["is_weight"], batch["loss_mask"] = weight, kept  # [N, T]
        if cfg.mismatch == "tis":
            touched = r > cfg.mismatch_high  # [N, T] truncated
        else:
            # [N, T] masked (mis) or zeroed (icepop)
            touched = (r < cfg.mismatch_low) | (r > cfg.mismatch_high)
        touched = touched & (mask > 0)
        kl = algos.kl_estimate(batch["engine_logp"], batch["old_logp"], "k3") * mask  # KL(engine || trainer)
        self.sums = {"mismatch_kl": kl.sum(), "mismatch_tokens": touched.sum(),
                     "mismatch_seqs": touched.any(-1).sum(), "mismatch_weight": (weight * mask).sum(),
                     "mismatch_count": mask.sum(), "mismatch_rows": (mask.sum(-1) > 0).sum()}
        self.maxes = {"mismatch_weight_max": (weight * mask).max()}

    def metrics(self, total: dict, peak: dict) -> dict:
        """How far the engine is from the trainer, and what was corrected, from the step's
        reduced sums and maxima ({} without --mismatch)."""
        if "mismatch_kl" not in total:
            return {}
        count, rows = max(1.0, total["mismatch_count"]), max(1.0, total["mismatch_rows"])
        return {"train/mismatch_kl": total["mismatch_kl"] / count,
                "train/mismatch_token_share": total["mismatch_tokens"] / count,
                "train/mismatch_seq_share": total["mismatch_seqs"] / rows,
                "train/mismatch_weight_mean": total["mismatch_weight"] / count,
                "train/mismatch_weight_max": peak["mismatch_weight_max"]}
