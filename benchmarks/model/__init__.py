"""In-process figures of the model: decode step, kernels, sampling, snapshots (no HTTP, except
snapshots.py over each store)."""
