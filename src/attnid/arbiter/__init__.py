"""The numerical arbiter: Jacobian rank in float64, and its comparison with the closed form."""

from attnid.arbiter.compare import Verification, verify, verify_module
from attnid.arbiter.precision import Float64Mode
from attnid.arbiter.rank import ArbiterResult, jacobian_rank, near_unidentified, randomize_

__all__ = ["ArbiterResult", "Float64Mode", "Verification", "jacobian_rank", "near_unidentified",
           "randomize_", "verify", "verify_module"]
