"""Linear attention (Gated DeltaNet): causal conv, the delta rule (decode, chunked prefill), gated RMSNorm."""
