"""Every kernel of neuron, CPU and GPU, by what it computes: ``attention`` (paged decode and
prefill), ``packed`` and ``int8_rows`` (products of packed weights), ``dense`` (the skinny dense
product), ``fused`` (norms, RoPE + KV store, SiLU·mul), ``sampling`` (greedy tokens, device
tokens), ``launch`` (what every Triton launch shares), ``cpu`` (the C++ extension and its sources
in ``csrc/``). ``gpu`` gathers the Triton ones. The runner and the models call kernels; kernels
import neither. This package imports nothing itself, so the CPU path never loads Triton."""
