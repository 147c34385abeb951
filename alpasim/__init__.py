"""alpasim: plan, simulate and run Alpa-style parallel training."""

__version__ = "0.1.0"
