"""The DPO loss on the CPU. See ops/dpo_loss.py for the math."""

import math

import numpy as np
from numba import njit, prange

from nanoeuler_ops.dpo_loss import check_pairs


@njit(parallel=True, cache=True)
def _forward(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, losses, weight):
    # policy_chosen, policy_rejected, ref_chosen, ref_rejected (P,) -> losses (P,), weight (P,)
    # Each pair in float64: the difference of differences of log-probabilities tens of nats large
    # would lose digits in float32.
    P = losses.shape[0]
    for p in prange(P):
        z = beta * ((np.float64(policy_chosen[p]) - ref_chosen[p]) - (np.float64(policy_rejected[p]) - ref_rejected[p]))
        losses[p] = max(-z, 0.0) + math.log1p(math.exp(-abs(z)))
        weight[p] = 1.0 / (1.0 + math.exp(z))  # sigmoid(-z); exp(z) = inf for large z gives 0, as it should


@njit(parallel=True, cache=True)
def _backward(dlosses, weight, beta, d_chosen, d_rejected):
    # dlosses (P,), weight (P,) -> d_chosen (P,), d_rejected (P,)
    P = weight.shape[0]
    for p in prange(P):
        g = dlosses[p] * beta * weight[p]
        d_chosen[p] = -g
        d_rejected[p] = g


def forward(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta):
    check_pairs(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = np.empty_like(policy_chosen)
    weight = np.empty_like(policy_chosen)
    _forward(policy_chosen, policy_rejected, ref_chosen, ref_rejected, float(beta), losses, weight)
    return losses, (weight,)


def backward(dlosses, saved, policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta):
    (weight,) = saved
    d_chosen = np.empty_like(weight)
    d_rejected = np.empty_like(weight)
    _backward(dlosses, weight, float(beta), d_chosen, d_rejected)
    return d_chosen, d_rejected, None, None
