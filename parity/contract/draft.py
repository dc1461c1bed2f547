"""What an engine's draft heads return (spec v4-mtp-dspark §2-§3): one MTP call, one DSpark round.

Arrays are the engine's numpy outputs; names follow the draft checkpoints of issue 24 (`mtp.k.in`, `mtp.k.attn`,
`mtp.k`, `mtp.k.logits`; `dspark.main`, `dspark.{s}`, `dspark.base_logits`, `dspark.bias`, `dspark.logits`,
`dspark.confidence`, `dspark.drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class MTPOutput:
    """The MTP block on n (carrier, token) pairs at MTP positions start_pos.. (one row per pair)."""

    input: np.ndarray         # X_mtp [n, H, D] = W_e enorm(E[τ]) + W_h hnorm(G[s])      (mtp.k.in)
    attn_carrier: np.ndarray  # [n, H, D] after the attention HC_post                    (mtp.k.attn)
    carrier: np.ndarray       # X1 [n, H, D] after the FFN HC_post: what a chained step feeds on   (mtp.k)
    logits: np.ndarray        # [n, V] = W_out norm(HC_head_mtp(X1)); row i predicts the token after τ_i
    expert_ids: np.ndarray    # int [n, K] the block's routed experts, selection order


@dataclass
class DSparkRound:
    """One DSpark round at start position p with anchor a = t_{p+1}: B block slots at positions p+1..p+B."""

    main: np.ndarray          # [D] M of position p = main_norm(W_main T_p)                    (dspark.main)
    stages: list[np.ndarray]  # S x [B, H, D] stage output carriers                           (dspark.{s})
    expert_ids: list[np.ndarray]  # S x int [B, K]
    base_logits: np.ndarray   # [B, V] W_out norm(HC_head(X^S)) before the Markov bias       (dspark.base_logits)
    bias: np.ndarray          # [B, V] W2 W1[o_j]                                             (dspark.bias)
    logits: np.ndarray        # [B, V] base + bias                                            (dspark.logits)
    confidence: np.ndarray    # [B] raw confidence logits w_c · [z_j; u_j]                     (dspark.confidence)
    drafts: np.ndarray        # int [B] d_1..d_B (first-max argmax of the biased logits)      (dspark.drafts)
