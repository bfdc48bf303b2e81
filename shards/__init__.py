"""gradbus.shards: parameter store, optimizers, the batched apply loop and the shard process."""
