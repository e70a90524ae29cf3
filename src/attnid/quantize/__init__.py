"""Weight quantization: fake round-to-nearest (`rtn`), the baseline every quantization-ready
gauge is measured against (issue 27)."""

from attnid.quantize.rtn import Scheme, fake_quantize, parse_scheme, quantizable, quantize_linears

__all__ = ["Scheme", "fake_quantize", "parse_scheme", "quantizable", "quantize_linears"]
