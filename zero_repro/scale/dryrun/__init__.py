"""The dry run: the real build and step on data-free (meta) tensors, traced, its allocations
replayed through a caching-allocator model; the max-model-size search; the 2020 stack."""
