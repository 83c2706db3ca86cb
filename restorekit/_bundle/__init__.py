"""The checkpoint (tensor bundle) format itself: index table, entry protos, shard bytes."""
