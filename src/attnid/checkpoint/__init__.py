"""Read-only tools on real checkpoints: `audit` (how unbalanced is it?) and `diff` (is B A modulo
the attention symmetry group?). Neither ever writes to the checkpoints it is given."""
