"""Benchmarks: how fast the engine runs, and why.

Two modes share one report layer:

- `speed`: raw model throughput per weight format (prefill, decode, bytes per token against the
  machine's measured memory bandwidth) and the verification cost curve (ms of one forward over k
  new tokens), the two numbers that bound what speculative decoding can gain on a machine.
- `methods`: end-to-end generation with every decoding method on the same prompts (HumanEval,
  Spec-Bench), greedy and fixed-length, checking that all methods emit identical tokens and
  comparing measured speedups with the Leviathan et al. prediction.

Optional peers (llama.cpp, Hugging Face transformers) run the same workload where installed.
"""
