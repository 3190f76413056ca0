"""The DPO loss (Direct Preference Optimization) of each preference pair, from summed response
log-probabilities under the policy being trained and under the frozen reference model.

Shapes: policy_chosen, policy_rejected, ref_chosen, ref_rejected (P,) -> losses (P,); saved
weight (P,). With the implicit reward margin

    z = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    losses = -log sigmoid(z) = log(1 + exp(-z))         (never overflowing: max(-z, 0) + log1p(exp(-|z|)))

Backward, with weight = sigmoid(-z) = 1 - sigmoid(z), saved by the forward:

    d policy_chosen   = -dlosses * beta * weight
    d policy_rejected = +dlosses * beta * weight

The reference log-probabilities are constants (the reference model is frozen): no gradient.
"""

import numpy as np

from nanoeuler_core.registry import ErrorInput, Sample, define_op


def check_pairs(*logprobs):
    """Raise ValueError unless the four log-probability arrays are (P,) vectors of one length
    (every backend calls this)."""
    shapes = {np.shape(x) for x in logprobs}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"dpo_loss: the four log-probability inputs must be (P,) vectors of one length, "
                         f"got shapes {[np.shape(x) for x in logprobs]}")


def forward(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta):
    check_pairs(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    z = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    losses = np.logaddexp(0.0, -z)
    weight = np.exp(-np.logaddexp(0.0, z))  # 1 / (1 + exp(z)) without overflow
    return losses, (weight,)


def backward(dlosses, saved, policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta):
    (weight,) = saved
    d_rejected = dlosses * beta * weight
    return -d_rejected, d_rejected, None, None


def sample_inputs(rng):
    # Summed log-probabilities of responses a few tokens long: negative, tens of nats.
    for p, beta, spread in ((1, 0.1, 5.0), (7, 0.5, 10.0), (33, 0.1, 30.0), (5, 2.0, 20.0)):
        policy_chosen, policy_rejected, ref_chosen, ref_rejected = -spread * rng.random((4, p))
        yield Sample((policy_chosen, policy_rejected, ref_chosen, ref_rejected), {"beta": beta},
                     grad_inputs=(0, 1), name=f"P{p}_beta{beta}")


def error_inputs(rng):
    for name, sizes in (("rejected_4_for_3", (3, 4, 3, 3)), ("ref_2d", (3, 3, (1, 3), 3))):
        logprobs = tuple(-10.0 * rng.random(n) for n in sizes)
        yield ErrorInput(Sample(logprobs, {"beta": 0.1}, name=name), match=r"must be \(P,\) vectors of one length")


OP = define_op(globals(), "DPO loss per preference pair from policy and reference sequence log-probabilities")
