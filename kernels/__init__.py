"""Triton kernels, each beside the plain-torch reference it is tested against.

The runtime's ops (``runtime/ops.py``) are the torch references the CPU path runs today.
"""
