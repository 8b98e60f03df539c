"""optimizer: a model optimization compiler whose every stage is measured by one benchmark harness."""

__version__ = "0.1.0"
