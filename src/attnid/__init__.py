"""attnid: which attention parameters are identified, and what optimizers do with the rest."""

from importlib.metadata import PackageNotFoundError, version

from attnid.arbiter import ArbiterResult, Verification, jacobian_rank, randomize_, verify
from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.theory import Component, Count, count
from attnid.whole.count import WholeCount
from attnid.whole.model import count_model

__all__ = [
    "ArbiterResult",
    "Attention",
    "AttentionSpec",
    "AttnidError",
    "Component",
    "Count",
    "Verification",
    "WholeCount",
    "count",
    "count_model",
    "jacobian_rank",
    "randomize_",
    "verify",
]

try:
    __version__ = version("attnid")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
