"""Data shipped with attnid: a public-domain character-level Shakespeare corpus (see README)."""
