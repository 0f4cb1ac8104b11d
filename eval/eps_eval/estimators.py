"""Estimators of a group's attention from the quest8 record (issue 19), not bounds.

Quest's score is the worst case over the group's box [min, max]:
    quest(q) = q·mid + Σ_i |q_i| w_i,   mid = (max + min) / 2,  w = (max − min) / 2.
At d = 256 the L1 spread Σ|q_i| w_i assumes every channel sits at its extreme in the
same token, which real keys never do; a group with wide but uninformative channels
then outranks one whose keys actually align with q. The scorers here read the same
bytes (quest8's int8 min/max and scale, 2·d + 4 per group and KV head) and replace
the worst case with a typical case:

  questclt{κ}    q·mid + κ·sqrt(Σ_i q_i² w_i²): channels as independent, the spread of
                 q·k a sum of d small terms (central-limit), κ standard deviations of
                 that sum above the centre. κ = 1 at d = 1 is quest itself; the score
                 grows with κ.
  questblend{α}  α·quest + (1 − α)·q·mid = q·mid + α·Σ|q_i| w_i (α = 1: quest).
  meanclt{κ}     questclt{κ} centred on the group's mean key instead of the box's
                 midpoint: q·μ + κ·sqrt(Σ_i q_i² w_i²). Reads the quest8 record and the
                 mean key in int8 with its own scale (d + 4 more bytes: 3·d + 8).
  questlgn       log of the group's expected softmax mass per token, in score units
                 (× √d): with q·k ~ Normal(q·mid, s²) over the group's tokens and each
                 channel uniform on its range (s² = Σ q_i² w_i² / 3),
                 √d · log E[exp(q·k / √d)] = q·mid + s² / (2√d).

The group's token count n would enter an expected maximum as sqrt(2 ln n) and a mass
as ln n; within one group size every group but the last (always forced) has the
same n, so those terms change no ranking and are left out.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

from eps_eval.metrics import BLOCK

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

# The estimators evaluated by the estimator plan (plans.ESTIMATOR_PLAN).
ESTIMATORS = ("questclt0", "questclt0.25", "questclt0.5", "questclt1", "questclt1.5",
              "questclt2", "questclt3", "questblend0.25", "questblend0.5", "questblend0.75",
              "questlgn")

_NAME = re.compile(r"^(questclt|questblend|meanclt)([0-9.]+)$|^questlgn$")


def is_estimator(name: str) -> bool:
    return _NAME.match(name) is not None


def reads_mean(name: str) -> bool:
    """Whether the estimator reads the int8 mean key beside the quest8 record."""
    return name.startswith("meanclt")


def centre_and_spread(min8: F64, max8: F64) -> tuple[F64, F64]:
    """mid and half-range [kv, G, d] of the (dequantised) int8 ranges."""
    return 0.5 * (max8 + min8), 0.5 * (max8 - min8)


def estimate(name: str, q: F32, min8: F64, max8: F64, mean8: F64 | None = None) -> F32:
    """Scores [H, G] of the estimator `name` for q [H, d] over ranges [kv, G, d]
    (GQA: head h reads KV head h // (H / kv)); meanclt also reads mean8 [kv, G, d]."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"estimator name={name!r} is not questclt<κ>, questblend<α>, "
                         "meanclt<κ> or questlgn")
    kind = m.group(1) or "questlgn"
    param = float(m.group(2)) if m.group(2) else 0.0
    if kind == "meanclt" and mean8 is None:
        raise ValueError(f"estimator {name!r} needs the group's mean key")
    h, d = q.shape
    r = h // min8.shape[0]
    mid, w = centre_and_spread(min8, max8)
    qd = q.astype(np.float64)
    out = np.empty((h, min8.shape[1]))
    for i in range(h):
        centre = (mean8 if kind == "meanclt" else mid)[i // r] @ qd[i]  # type: ignore[index]
        if kind in ("questclt", "meanclt"):
            out[i] = centre + param * np.sqrt((w[i // r] ** 2) @ (qd[i] ** 2))
        elif kind == "questblend":
            out[i] = centre + param * (w[i // r] @ np.abs(qd[i]))
        else:
            out[i] = centre + ((w[i // r] ** 2) @ (qd[i] ** 2)) / 3.0 / (2.0 * np.sqrt(d))
    return out.astype(np.float32)


class MomentTables:
    """A different record at quest8's size, for comparison: each group's per-channel key
    mean and standard deviation in int8, one fp32 scale each per (group, KV head):
    2·d + 8 bytes. Scored as questlgn with the measured moments in place of the box:
        momentlgn(q) = q·μ + Σ_i q_i² σ_i² / (2√d)
    (the softmax mass per token if q·k were normal with channels independent)."""

    def __init__(self, k: F32, tokens: int, g: int) -> None:
        kv, _, d = k.shape
        gt = g * BLOCK
        G = -(-tokens // gt)
        pad = G * gt - tokens
        kk = np.pad(k[:, :tokens].astype(np.float64), ((0, 0), (0, pad), (0, 0)))
        kk = kk.reshape(kv, G, gt, d)
        counts = np.minimum(gt, tokens - np.arange(G) * gt)[None, :, None]
        mean = kk.sum(axis=2) / counts
        var = np.maximum((kk**2).sum(axis=2) / counts - mean**2, 0.0)
        self.mean, self.std = int8_per_group(mean), int8_per_group(np.sqrt(var))
        self.kv = kv

    def scores(self, q: F32) -> F32:
        h, d = q.shape
        r = h // self.kv
        qd = q.astype(np.float64)
        out = np.stack([self.mean[i // r] @ qd[i]
                        + (self.std[i // r] ** 2) @ (qd[i] ** 2) / (2.0 * np.sqrt(d))
                        for i in range(h)])
        return out.astype(np.float32)


def int8_per_group(x: F64) -> F64:
    """x [kv, G, d] rounded to int8 codes with one scale per (KV head, group), dequantised."""
    scale = np.abs(x).max(axis=2, keepdims=True) / 127.0
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint(x / scale), -127, 127) * scale
