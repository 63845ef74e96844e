"""Prefill/decode disaggregation: a request prefilled on one instance (P) decodes on
another (D) from the KV cache P computed, sent layer by layer over a `PDTransport`."""
