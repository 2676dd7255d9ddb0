"""slimrl: Megatron-native RL post-training for large Mixture-of-Experts language models."""

__version__ = "0.1.0"
