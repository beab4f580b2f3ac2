"""Compressor registry: ``compressor=`` takes one of these names or a Compressor instance."""
from .base import (COMPRESSORS, Compressor, available_compressors, check_density, make_compressor, register_compressor,
                   sparsify)
from .dgc import DGC
from .exdyna import ExDyna
from .gaussiank import GaussianK
from .none import NoneCompressor
from .randomk import RandomK
from .redsync import RedSync
from .sidco import SIDCo
from .threshold import ThresholdCompressor
from .topk import TopK

__all__ = ["COMPRESSORS", "Compressor", "DGC", "ExDyna", "GaussianK", "NoneCompressor", "RandomK", "RedSync",
           "SIDCo", "ThresholdCompressor", "TopK", "available_compressors", "check_density", "make_compressor",
           "register_compressor", "sparsify"]
