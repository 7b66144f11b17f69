"""16-bit params and optimizer state: stochastic rounding and ``low_precision_optimizer``."""
