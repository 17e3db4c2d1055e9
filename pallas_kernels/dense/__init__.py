"""Dense layers at decode: fused SwiGLU MLP, skinny GEMMs, norm + q|k|v + RoPE + K/V write, L2 prefetch."""
