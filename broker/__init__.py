"""gradbus.broker: routing, partition table, sequencing and batching, membership, flow control."""
