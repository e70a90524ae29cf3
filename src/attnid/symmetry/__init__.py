"""The symmetry toolkit: orbit directions, gauge transforms, projection, conserved quantities, rebalancing.

Everything is written once against the canonical container `AttentionWeights`, batched
over leading (layer) dims, and RoPE-, GQA-, bias- and QK-norm-aware.
"""

from attnid.rope import project_commutant
from attnid.symmetry.conserved import Metrics, SideMetrics, conserved, metrics
from attnid.symmetry.gauge import Gauge, apply_gauge, random_gauge
from attnid.symmetry.projection import Projection, project, remove_tangent
from attnid.symmetry.rebalance import (
    balance_pair,
    drop_key_bias,
    fold_value_bias,
    rebalance,
    rebalance_qk,
    rebalance_vo,
)
from attnid.symmetry.tangent import TangentMap, tangent_basis
from attnid.weights import SIDES, AttentionWeights, Side, grams

__all__ = [
    "SIDES",
    "AttentionWeights",
    "Gauge",
    "Metrics",
    "Projection",
    "Side",
    "SideMetrics",
    "TangentMap",
    "apply_gauge",
    "balance_pair",
    "conserved",
    "drop_key_bias",
    "fold_value_bias",
    "grams",
    "metrics",
    "project",
    "project_commutant",
    "random_gauge",
    "rebalance",
    "rebalance_qk",
    "rebalance_vo",
    "remove_tangent",
    "tangent_basis",
]
