"""Compressor registry: ``compressor=`` takes one of these names or a Compressor instance."""
from .base import Compressor, available_compressors, check_density, make_compressor, register_compressor
from .dgc import DGC
from .none import NoneCompressor
from .topk import TopK

__all__ = ["Compressor", "DGC", "NoneCompressor", "TopK", "available_compressors", "check_density",
           "make_compressor", "register_compressor"]
