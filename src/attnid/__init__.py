"""attnid: which attention parameters are identified, and what optimizers do with the rest."""

from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.numeric import ArbiterResult, jacobian_rank, randomize_
from attnid.spec import AttentionSpec
from attnid.theory import Count, count

__all__ = [
    "ArbiterResult",
    "Attention",
    "AttentionSpec",
    "AttnidError",
    "Count",
    "count",
    "jacobian_rank",
    "randomize_",
]
__version__ = "0.1.0"
