"""Training DeepSpec drafters (DSpark and DFlash) in MLX: data preparation,
DeepSpec's training objective, the optimizer and the training loop."""
