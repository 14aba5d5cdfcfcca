"""Verification and identification metrics of the FedFS and FedUV papers: one import surface
for :mod:`device_sim.score_metrics` (score-level: ROC, AUROC, EER, TAR@FAR, TPIR@FPIR, pairwise)
and :mod:`device_sim.client_metrics` (per client: aggregation, paired Δ, warm-up, mean ROC).

Conventions (``docs/evaluation.md`` states them in full):

* a **score** is "higher = more likely the genuine user"; a probe is **accepted iff
  score ≥ threshold** (FedUV Eq. 5), so a score equal to the threshold is accepted;
* **genuine** scores compare a user's model/enrollment with that user's own held-out images;
  **impostor** scores compare it with other people's images;
* ROC and AUROC come from scikit-learn (``roc_curve``, ``roc_auc_score``; tied scores count
  one half in the AUROC — the Mann–Whitney statistic);
* **TAR@FAR f**: the highest TAR of any threshold whose FAR is ≤ f on the given impostors:
  with ``m = ⌊f · n_imp⌋`` allowed false accepts, the threshold sits just above the
  ``(m+1)``-th largest impostor score, so TAR = share of genuine scores strictly above that
  impostor score. It is exactly the ROC's upper envelope at FPR ≤ f. When
  ``f · n_imp < 1`` no impostor may be accepted (the figure is then "TAR at FAR 0" — see
  ``far_resolution``);
* **TPIR@FPIR** (FedFR's 1:N protocol, used by FedFS Table 2): per client, a gallery of
  enrolled identities and a set of probes; a mated probe counts as identified at threshold
  t iff its own gallery entry is the rank-1 match with score ≥ t; a non-mated probe is a
  false positive iff its best gallery score is ≥ t. The threshold for FPIR f is chosen like
  TAR@FAR f on the non-mated best scores. With FedFS's one identity per client the gallery
  has a single entry and rank-1 is automatic. Reported numbers are means over clients.
  The non-mated probes are either never-seen new users or (FedFR's own choice) the other
  clients' images — :func:`tpir_other_clients`;
* **pairwise 1:1 AUROC** (FedFR's verification protocol): per client, cosine between the two
  images' embeddings of every pair; genuine = every unordered pair of the client's own test
  images, impostor = each own test image × each other identity's image
  (:func:`pairwise_scores`, :func:`pairwise_auroc`);
* **paired Δ** between two methods: per-client differences over the clients where both are
  finite, mean ± standard error (:func:`paired_delta`).
"""
from __future__ import annotations

from .client_metrics import (WarmupOutcome, aggregate, mean_roc, paired_delta, per_client_identification,
                             per_client_verification, per_user_warmup, warmup_outcome)
from .score_metrics import (DEFAULT_FARS, auroc, eer, identification_scores, pairwise_auroc, pairwise_scores, roc,
                            tar_at_far, template_scores, threshold_at_far, tpir_at_fpir, tpir_other_clients,
                            verification_metrics)

__all__ = [
    "DEFAULT_FARS", "roc", "auroc", "eer", "threshold_at_far", "tar_at_far", "verification_metrics",
    "identification_scores", "template_scores", "tpir_at_fpir", "aggregate", "per_client_verification",
    "per_client_identification", "WarmupOutcome", "warmup_outcome", "per_user_warmup", "mean_roc",
    "tpir_other_clients", "pairwise_scores", "pairwise_auroc", "paired_delta",
]
