"""Names of the transformers classes attnid defines itself (`attnid.adapters.positions_llama`),
kept apart from that module so that reading them imports neither transformers nor a family."""

MODEL_TYPE = "attnid_llama"  # Llama without RoPE
POSITIONS = ("learned", "none")  # its positions: a learned table, or no positional encoding (NoPE)
