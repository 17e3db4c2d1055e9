"""Mixture of experts: norm + router + routing, the grouped GEMMs (Triton and Mosaic GPU)."""
