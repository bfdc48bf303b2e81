"""gradbus.workers: the client SDK's internals (weight cache, I/O agent, client)."""
