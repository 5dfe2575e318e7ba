"""Speculative decoding: a lossless engine, a CLI, a benchmark and a Gradio app."""
