"""Training experiments: a small GPT on attnid's attention, the loop, and the paper's cases."""
