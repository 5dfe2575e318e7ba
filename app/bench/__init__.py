"""Measurements: the benchmark, the model card, the thread check, the GPU check and the quality check."""
