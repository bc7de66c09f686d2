"""The rank's step: caches sized from the model's declarations (sizing, state), inputs, CUDA graphs,
the step itself (runner), sampling, attention over the paged cache."""
