"""The wire contract between processes: versioned messages, kv_transfer_params, chunk MACs."""
