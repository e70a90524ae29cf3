"""Tools on real checkpoints: `audit` (how unbalanced is it?), `diff` (is B A modulo the
whole-model symmetry group?), `canonicalize` and `rewrite` (function-preserving surgery,
verified before anything is written). None ever writes to the checkpoints it is given."""
