"""What a learner computes locally: data shards, batches and the inner schedule."""
