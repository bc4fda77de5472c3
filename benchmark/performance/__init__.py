"""Speed, memory and reproducibility: generation and training throughput, memory plans, determinism, the GPU check."""
