"""DSpark's confidence head at work: calibration (STS) and the schedulers
that decide how many drafts each round verifies."""
