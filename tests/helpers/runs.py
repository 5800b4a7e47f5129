"""Two runs' metrics compared where their float sums may run in another order.

`utils.logger.differences` asks for bit-equal metrics: right for two runs that make the same
reductions in the same order (a seeded rerun, a resume on the same ranks). Two placements of
one experiment need not. A partial-placement sampler generates in --judge-chunk batches, a
colocated engine a whole wave at once, and a GEMM kernel may sum a row in another order in
another batch shape (MKL's AVX-512 kernels do; MKL_CBWR=COMPATIBLE does it on any CPU and turns
tests/test_dynamic_sampling.py's partial run 7.611648 against 7.611651 in train/grad_norm, as
the AVX-512 machine did). And utils/dist.py gives each rank os.cpu_count() // LOCAL_WORLD_SIZE
intra-op threads, so 2 colocated ranks and 3 disaggregated ones (or 1 and 2 ranks per node) run
on other thread counts, where a kernel may split its sums otherwise. The runs then agree to
rounding, not to the bit.
"""
from utils.logger import differences

# The comparison is utils.logger.differences(rel=REL), whose FLOOR covers the 6 logged decimals and
# whose NOISE keys (the log-prob gaps) are bounded, not compared. REL is relative to the quantity's
# scale, max(1, |value|): a logged mean's rounding error is relative to the terms it averages, ~1 for
# rewards (in [0, 1]), whitened advantages and ratios near 1, even where the mean cancels to ~0
# (pg_loss); larger quantities (a gradient norm, a length) scale it themselves. 1e-5 is ~80 float32
# eps (1.2e-7): room for last-bit noise to grow over a few Adam steps, and far below what a changed
# sample moves (a reward of these 16-sample steps by 1/16) or a wrong term.
REL = 1e-5


def differences_within(a: list[dict], b: list[dict], rel: float = REL) -> list[str]:
    """Two placements of one experiment: their metrics to rounding (utils.logger.differences)."""
    return differences(a, b, rel)


def weights_apart(a: dict, b: dict, start: dict) -> float:
    """How far two runs' final weights are apart as a share of how far training moved them,
    over the whole model: ||a - b|| / ||a - start||. The update is the scale: both runs start
    from the same weights, so only their updates differ. Not per tensor: a tensor whose exact
    gradient is 0 (k_proj's bias: it adds one constant to a query's logits, which softmax
    ignores) gets an update that is rounding noise normalised by Adam, noise over noise."""
    apart = sum((a[k] - b[k]).double().pow(2).sum() for k in a) ** 0.5
    moved = sum((a[k] - start[k]).double().pow(2).sum() for k in a) ** 0.5
    return float(apart / moved)
