"""GPU kernels of the model (Triton, grouped GEMMs) and the torch references they are tested
against; every entry point falls back to its reference off CUDA."""
