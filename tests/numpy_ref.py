"""Independent float64 NumPy references, written from the DeepSeek / attention formulas.

Nothing here imports the code under test: dense attention with explicit masks, and MLA
without a cache and without weight absorption.
"""

from __future__ import annotations

import math

import numpy as np


def attention(q, k, v, mask, scale):
    """``q [Sq, N, D]``, ``k [Sk, N, D]``, ``v [Sk, N, Dv]``, ``mask [Sq, Sk]`` bool ->
    ``out [Sq, N, Dv]``, ``lse [Sq, N]`` (natural log; rows with no key: 0 and -inf)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("qnd,knd->nqk", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    denom = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(denom))[..., 0]
    p = e / np.where(denom > 0, denom, 1.0)
    return np.einsum("nqk,knd->qnd", p, v), lse.T


def ragged_mask(cu_q, cu_k, tq, tk, causal):
    """``[tq, tk]`` mask of ragged sequences; causal aligns queries to the end of the keys."""
    mask = np.zeros((tq, tk), bool)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        for i in range(q0, q1):
            last = k1 if not causal else k0 + (i - q0) + (k1 - k0) - (q1 - q0) + 1
            mask[i, k0 : max(k0, min(last, k1))] = True
    return mask


def ragged_attention(q, k, v, cu_q, cu_k, causal, scale):
    """``attention`` with ``ragged_mask``, computed sequence by sequence (the same result
    without the dense ``[Tq, Tk]`` scores): rows past ``cu_q[-1]`` get 0 and -inf."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = np.full(q.shape[:2], -np.inf)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        mask = ragged_mask([0, q1 - q0], [0, k1 - k0], q1 - q0, k1 - k0, causal)
        out[q0:q1], lse[q0:q1] = attention(q[q0:q1], k[k0:k1], v[k0:k1], mask, scale)
    return out, lse


def rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def yarn_inv_freq(dim, theta, factor, orig_max, beta_fast, beta_slow):
    """YaRN frequencies as in DeepSeek's reference code (yarn_find_correction_range)."""
    freq_extra = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    if factor == 1.0:
        return freq_extra
    freq_inter = freq_extra / factor

    def corr(rot):
        return dim * math.log(orig_max / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return freq_inter * ramp + freq_extra * (1 - ramp)


def rope(x, positions, inv_freq, mag, interleaved=True):
    """Rotates ``x [S, ..., R]`` as complex pairs (interleaved) or halves."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    z = x[..., 0::2] + 1j * x[..., 1::2] if interleaved else x[..., :half] + 1j * x[..., half:]
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq[None]
    rot = (mag * np.exp(1j * angle)).reshape(angle.shape[0], *(1,) * (x.ndim - 2), half)
    z = z * rot
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:] = z.real, z.imag
    return out


def mla_queries(p, dims, x, positions):
    """``q_nope [S, N, P]`` and rotated ``q_pe [S, N, R]`` of hidden states ``x [S, H]``."""
    x = np.asarray(x, np.float64)
    if "q_proj" in p:
        q = x @ p["q_proj"]
    else:
        q = rms_norm(x @ p["q_a_proj"], p["q_a_layernorm"], dims["eps"]) @ p["q_b_proj"]
    q = q.reshape(len(x), dims["N"], dims["P"] + dims["R"])
    q_pe = rope(q[..., dims["P"] :], positions, dims["inv_freq"], dims["mag"], dims["interleaved"])
    return q[..., : dims["P"]], q_pe


def mla_latents(p, dims, x, positions):
    """``kv_c [S, Lkv]`` and rotated ``k_pe [S, R]``: what the cache stores."""
    kv = np.asarray(x, np.float64) @ p["kv_a_proj_with_mqa"]
    kv_c = rms_norm(kv[:, : dims["Lkv"]], p["kv_a_layernorm"], dims["eps"])
    k_pe = rope(kv[:, dims["Lkv"] :], positions, dims["inv_freq"], dims["mag"], dims["interleaved"])
    return kv_c, k_pe


def mla_attend(p, dims, q_nope, q_pe, kv_c, k_pe, mask):
    """Non-absorbed MHA: keys ``[kv_c @ W_UK, k_pe]``, values ``kv_c @ W_UV``, then o_proj."""
    n, vd = dims["N"], dims["V"]
    kv_c = np.asarray(kv_c, np.float64)
    k_nope = np.einsum("tl,nlp->tnp", kv_c, p["W_UK"])
    v = np.einsum("tl,nlv->tnv", kv_c, p["W_UV"])
    k_pe = np.broadcast_to(np.asarray(k_pe, np.float64)[:, None], (len(kv_c), n, dims["R"]))
    k = np.concatenate([k_nope, k_pe], -1)
    q = np.concatenate([q_nope, q_pe], -1)
    o, _ = attention(q, k, v, mask, dims["scale"])
    return o.reshape(len(q), n * vd) @ p["o_proj"]


def mla(p, dims, x, positions):
    """Dense causal MLA of one whole sequence ``x [S, H]`` at ``positions [S]`` -> ``[S, H]``.

    ``p``: float64 weights ``[in, out]`` under the HF module names (``q_a_proj`` ...), but
    ``kv_b_proj`` as its per-head parts ``W_UK [N, Lkv, P]`` and ``W_UV [N, Lkv, V]``;
    ``dims``: N, P, R, V, Lkv, eps, scale, inv_freq, mag (rope magnitude), interleaved.
    """
    q_nope, q_pe = mla_queries(p, dims, x, positions)
    kv_c, k_pe = mla_latents(p, dims, x, positions)
    causal = np.tril(np.ones((len(x), len(x)), bool))
    return mla_attend(p, dims, q_nope, q_pe, kv_c, k_pe, causal)
