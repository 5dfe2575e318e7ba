"""The Gradio app and what only it needs: render, plots, visitor sessions, input checks, queue limits, ZeroGPU."""
