"""Losses of FedFS (Eq. 2–9) and FedUV (Eq. 4), each citing its equation."""
from .fedfs import (FedFSLossConfig, adaptive_soft_labels, combine, f_insub, f_reg, f_total,
                    insub_logits, resolve_k)
from .feduv import feduv_neg_loss, feduv_pos_loss, uv_score

__all__ = ["FedFSLossConfig", "adaptive_soft_labels", "combine", "f_insub", "f_reg", "f_total",
           "insub_logits", "resolve_k", "feduv_neg_loss", "feduv_pos_loss", "uv_score"]
