"""Quant VideoGen: config, packed format, reference encoder and decoder."""

from ..kernel_backend import backend
from .codec import QVGConfig
from .format import QVGPacked

__all__ = ["QVGConfig", "QVGPacked", "backend"]
