"""Configuration: JAX-free, validated where arguments are parsed."""
