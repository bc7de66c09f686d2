"""The operator's surface: /health, /metrics, /models, load and unload, the debug fault hook."""
