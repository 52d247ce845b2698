"""Optimizers, learning-rate schedules and gradient clipping: torch.optim's math, any array kind."""
