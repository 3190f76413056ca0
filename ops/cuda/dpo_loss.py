"""The DPO loss on the GPU. See ops/dpo_loss.py for the math. One thread per pair."""

import math

from numba import cuda, float64

from nanoeuler_ops.cuda import runtime
from nanoeuler_ops.dpo_loss import check_pairs

THREADS = 128


@cuda.jit(cache=True)
def _forward(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, losses, weight):
    # policy_chosen, policy_rejected, ref_chosen, ref_rejected (P,) -> losses (P,), weight (P,)
    # float64 per pair, as on the CPU: differences of large log-probabilities lose digits in float32.
    p = cuda.grid(1)
    if p < losses.shape[0]:
        z = beta * ((float64(policy_chosen[p]) - ref_chosen[p]) - (float64(policy_rejected[p]) - ref_rejected[p]))
        losses[p] = max(-z, 0.0) + math.log1p(math.exp(-abs(z)))
        weight[p] = 1.0 / (1.0 + math.exp(z))  # sigmoid(-z); exp(z) = inf for large z gives 0, as it should


@cuda.jit(cache=True)
def _backward(dlosses, weight, beta, d_chosen, d_rejected):
    # dlosses (P,), weight (P,) -> d_chosen (P,), d_rejected (P,)
    p = cuda.grid(1)
    if p < weight.shape[0]:
        g = dlosses[p] * beta * weight[p]
        d_chosen[p] = -g
        d_rejected[p] = g


def forward(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta):
    check_pairs(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    P = policy_chosen.shape[0]
    losses = runtime.empty((P,), policy_chosen.dtype)
    weight = runtime.empty((P,), policy_chosen.dtype)
    runtime.launch(_forward, runtime.blocks_for(P, THREADS), THREADS,
                   policy_chosen, policy_rejected, ref_chosen, ref_rejected, float(beta), losses, weight)
    return losses, (weight,)


def backward(dlosses, saved, policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta):
    (weight,) = saved
    P = weight.shape[0]
    d_chosen = runtime.empty((P,), weight.dtype)
    d_rejected = runtime.empty((P,), weight.dtype)
    runtime.launch(_backward, runtime.blocks_for(P, THREADS), THREADS, dlosses, weight, float(beta),
                   d_chosen, d_rejected)
    return d_chosen, d_rejected, None, None
