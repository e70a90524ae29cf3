"""Names of the transformers classes attnid defines itself (`attnid.adapters.positions_llama`),
kept apart from that module, which imports transformers (this one does not: importing it loads
the `attnid.adapters` package, its families included)."""

MODEL_TYPE = "attnid_llama"  # Llama without RoPE
POSITIONS = ("learned", "none")  # its positions: a learned table, or no positional encoding (NoPE)
