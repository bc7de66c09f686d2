"""neuron: a self-hosted LLM inference daemon."""

__version__ = "0.1.0"
