"""Command-line clients of a running daemon: ``neuron models | load | unload | status | chat``."""
