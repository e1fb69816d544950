"""Triton kernels for the QVG codec: one operation per file, each bit-compatible with the torch reference."""
