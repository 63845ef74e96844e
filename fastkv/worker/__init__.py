"""Worker side of fastkv: moves KV blocks between device, host and storage."""
