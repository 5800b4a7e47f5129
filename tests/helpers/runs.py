"""Two runs whose float sums are ordered differently, compared: the one rule of the suite.

1 vs 2 ranks, other micro-batches (padding removal sorts rows by length), placements, a moved
layout, compiled vs eager, sharded vs whole: each pair computes the same sums in another order. A
GEMM kernel may sum a row in another order in another batch shape (MKL's AVX-512 kernels do;
MKL_CBWR=COMPATIBLE and ATEN_CPU_CAPABILITY=default pick other kernels on any CPU), and
utils/dist.py gives each rank os.cpu_count() // LOCAL_WORLD_SIZE intra-op threads, so 2 colocated
ranks and 3 disaggregated ones run on other thread counts. Such runs agree to rounding, not to the
bit, and what is compared must be what rounding cannot move far:

- metrics (`differences_within`): each float to FLOOR + REL of its scale, counts exactly;
- gradients before the optimizer (`assert_same_by_norm`): each tensor to a share of its own norm,
  never element by element (an element whose gradient cancels to ~0 is all noise);
- log-probs, values, scores: element by element to a tolerance of their size (one forward each,
  no cancellation to ~0);
- weights after Adam's first step (`assert_same_first_step`): only those whose step saturated,
  and most must have; never a later step's weights element by element (Adam divides a near-zero
  gradient's rounding noise by its own size, so such a weight moves anywhere in +-lr);
- whole models after many steps (`weights_apart`): the distance as a share of the update.

Never a fraction of elements of a small tensor. Two runs that make the same reductions in the same
order (a seeded rerun, a resume on the same ranks) are compared bit for bit instead
(utils.logger.differences with rel None, torch.equal). The tests that compare reordered runs carry
the `reordered` mark; .ci/arithmetic_orders.sh runs them under other kernels and thread counts.
"""
import torch

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
    from the same weights, so only their updates differ. Not per tensor: a tensor whose gradient
    is near 0 gets an update that is rounding noise normalised by Adam, noise over noise."""
    apart = sum((a[k] - b[k]).double().pow(2).sum() for k in a) ** 0.5
    moved = sum((a[k] - start[k]).double().pow(2).sum() for k in a) ** 0.5
    return float(apart / moved)


def assert_same_by_norm(a: dict, b: dict, rel: float = 1e-5):
    """Two runs' gradients (or log-probs) of one computation, tensor by tensor: ||a - b|| within
    `rel` of ||b||. Not element by element: a sum in another order moves by ~eps (1.2e-7) times the
    size of the terms summed, whatever the element's own value (which may cancel to ~0), and the
    tensor's norm is that size. Measured here: up to ~4e-7 of it (GEMMs of another order,
    MKL_CBWR=COMPATIBLE; 1 against 2 ranks); 1e-5 leaves 25x. A row lost, or counted twice, moves a
    gradient by its share of the batch (1/6 to 1/64 in these tests), 1000x over."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        x, y = a[k].double(), b[k].double()
        assert (x - y).norm() <= rel * y.norm(), (k, float((x - y).norm() / y.norm()))
    assert any(t.abs().max() > 0 for t in b.values())  # there was something to compare


def assert_same_first_step(a: dict, b: dict, before: dict, lr: float, share: float = 0.8):
    """Two first AdamW steps from `before` (dicts of weights) are one update. Adam's first step is
    lr * g / (|g| + eps), eps 1e-8: +-lr wherever |g| >> eps, and there the two must agree to rounding
    (1e-5 is 0.1% of the step; measured up to 1.7e-6). Where |g| is within ~20 eps of 0 (a gradient
    that cancels), the step is rounding noise divided by ~eps, and the same sums in another order
    (other ranks, or other micro-batches: tasks.data.forward_batches groups rows by length) move it
    anywhere in +-lr: those weights (10-13% in these tests) are not compared, and at least `share` of
    all weights must have taken the whole step, so that the check covers the model. A row lost or
    counted twice moves the gradient by a share of its size and flips the steps of the weights whose
    gradient was that close to 0, ~2e-2 apart."""
    assert a.keys() == b.keys()
    full = total = 0
    for k in a:
        full_step = ((a[k] - before[k]).abs() >= 0.95 * lr) & ((b[k] - before[k]).abs() >= 0.95 * lr)
        assert torch.allclose(a[k][full_step], b[k][full_step], rtol=0, atol=1e-5), \
            (k, (a[k] - b[k])[full_step].abs().max())
        full, total = full + int(full_step.sum()), total + full_step.numel()
    assert full > share * total, full / total  # most weights took a whole step: the check covers them


def record_grads(model, opt) -> list[dict]:
    """For a helper script under torchrun: each optimizer step's gradients, after clipping and
    before the step (an optimizer pre-hook; utils.optimizer_step clears them after), gathered whole
    on every rank ({name: fp32 tensor}, one dict a step). Every rank must step: the gathers are
    collectives."""
    steps = []

    def keep(*_):
        steps.append({name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
                      .float().clone() for name, p in model.named_parameters() if p.grad is not None})

    opt.register_step_pre_hook(keep)
    return steps
