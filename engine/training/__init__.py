"""Training with MLX: the small embedded model (trunk + MTP heads) and new MTP
heads for existing checkpoints. See engine/train.py for the public surface."""
