"""Prefill/decode disaggregation: a request prefilled on one instance (P) decodes on
another (D) from the KV cache P computed, sent layer by layer over a `PDTransport`.

    scheduler halves (no paddle, over CacheManager's public API)
      prefill.py   PrefillTransfers: offers, pins what it sends until settled
      decode.py    DecodeTransfers: own prefix + receiving tail, commit or fence
    worker halves (one per TP rank)
      sender.py    PDSender: the per-layer hook, notices after the writes settled
      receiver.py  PDReceiver: verifies notices and what landed
      layout.py    KVLayout, the layout digest, TP pairing, block checksums
    between them
      messages.py  offers, answers, plans, reports; notices on the wire (HMAC)
      transport.py the byte mover's interface; inproc.py: one with faults, for tests
      metrics.py   Prometheus families of either role

See docs/pd.md for the flow, each side's states and what the checksum stops.
"""
