"""HF <-> Megatron-Core: names, layouts and sharding, for checkpoints and streaming weight sync."""
