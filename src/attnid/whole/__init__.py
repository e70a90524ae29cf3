"""Whole-model identification: every parameter of a transformer, not only its attention.

``structure`` (the layout read from a config), ``count`` (the closed form), ``check`` (the
whole-model arbiter on Hugging Face's classes, needs transformers), ``transforms`` (the
symmetries as function-preserving maps).
"""
