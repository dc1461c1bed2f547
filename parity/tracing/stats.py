"""Per-position summaries of a carrier: statistics, the 64-number fingerprint, top-k logits.

The fingerprint is a fixed +-1 projection (splitmix64 signs) so cosine and rel-L2 can be estimated without
full vectors; a C engine computes it with the 10-line function in docs/trace-format.md.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from parity.contract.checkpoints import per_stream
from parity.contract.errors import TraceError

FP_DIM = 64                        # fingerprint length
FP_SEED = 0x7634706172697479       # "v4parity" in ASCII
_GOLDEN = 0x9E3779B97F4A7C15       # splitmix64 increment
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x: np.ndarray) -> np.ndarray:
    """z = x + golden; z = (z ^ z>>30) * m1; z = (z ^ z>>27) * m2; z ^ z>>31 (all mod 2^64).

    x: uint64 [...] -> uint64 [...]
    """
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=8)
def sign_matrix(n: int) -> np.ndarray:
    """s(k, i) = +1 if the top bit of splitmix64(seed + k*n + i) is 0, else -1.

    n -> float64 [64, n] (read-only; cached per n)
    """
    idx = (np.uint64(FP_SEED) + np.arange(FP_DIM * n, dtype=np.uint64)).reshape(FP_DIM, n)
    top = splitmix64(idx) >> np.uint64(63)
    s = 1.0 - 2.0 * top.astype(np.float64)
    s.setflags(write=False)
    return s


def fingerprint(x: np.ndarray) -> np.ndarray:
    """fp[k] = (1/sqrt(64)) * sum_i s(k, i) * x[i] over the flattened (stream-major) vector.

    x: [n, ...] -> float32 [n, 64]; computed in float64. E[fp(a).fp(b)] = a.b, so fingerprint
    cosines and norms estimate the vectors' (Johnson-Lindenstrauss, ~1/sqrt(64) relative spread).
    """
    flat = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    s = sign_matrix(flat.shape[1])
    return (flat @ s.T / np.sqrt(FP_DIM)).astype(np.float32)


def carrier_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """Per position: l2s[h] = ||X[h]||, sum_l2 = ||sum_h X[h]||, rms = sqrt(sum x^2 / (H*D)), min, max, fp.

    x: [n, H, D] (a [n, D] vector is treated as H = 1) -> dict of float32 arrays [n, H] / [n] / [n, 64].
    """
    x = np.asarray(x)
    if x.ndim == 2:
        x = x[:, None, :]
    if x.ndim != 3:
        raise TraceError(f"carrier must be [n, H, D] or [n, D], got shape {x.shape}")
    x64 = x.astype(np.float64)
    sq = np.einsum("nhd,nhd->nh", x64, x64)
    streamsum = x64.sum(axis=1)
    return {
        "l2s": np.sqrt(sq).astype(np.float32),
        "sum_l2": np.sqrt(np.einsum("nd,nd->n", streamsum, streamsum)).astype(np.float32),
        "rms": np.sqrt(sq.sum(axis=1) / (x.shape[1] * x.shape[2])).astype(np.float32),
        "min": x.min(axis=(1, 2)).astype(np.float32),
        "max": x.max(axis=(1, 2)).astype(np.float32),
        "fp": fingerprint(x),
    }


def stats_view(name: str, x: np.ndarray) -> np.ndarray:
    """The [n, H, D] / [n, D] view of checkpoint `name`'s full vectors x [n, ...] that its ckpt rows summarise:
    DSpark block rows [n, B, H, D] as the stream-major [n, H, B·D], [n, B, V] rows as [n, B·V], others as they are."""
    x = np.asarray(x)
    if x.ndim == 4:
        return x.transpose(0, 2, 1, 3).reshape(len(x), x.shape[2], -1)
    return x.reshape(len(x), -1) if x.ndim == 3 and not per_stream(name) else x


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (ids, logits) per row, descending by logit, ties by lower id (the argmax convention). The one
    top-k of the project: traces, trajectories and ds4 logprob rows all use it.

    logits: [n, V] (ordered in their own precision) -> int32 [n, k], float32 [n, k]
    """
    logits = np.asarray(logits)
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -logits), axis=1)[:, :k]
    return order.astype(np.int32), np.take_along_axis(logits, order, axis=1).astype(np.float32)
