"""Entry point: python app.py [--host 127.0.0.1] [--port 7860] [--share]"""

import argparse
import os

from app.core.config import FAST_PATHS
from app.kv import static_cache
from app.models import hosting, threads
from app.serve import queue_limits, zerogpu
from app.serve.ui import launch  # imports `spaces` where it exists, before anything touches CUDA

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Speculative decoding, live (Gradio app)")
    ap.add_argument("--host", help="interface to bind (default 127.0.0.1, or GRADIO_SERVER_NAME)")
    ap.add_argument("--port", type=int, help="port (default 7860, or GRADIO_SERVER_PORT)")
    ap.add_argument("--share", action="store_true", help="create a public gradio.live link (off by default)")
    ap.add_argument(
        "--threads",
        type=threads.cli_value,
        help="torch threads: N or auto (default: auto, or SPECDEC_THREADS; see README)",
    )
    ap.add_argument(
        "--fast-path",
        choices=FAST_PATHS,
        help="CUDA passes: graphs (CUDA graphs on a static cache), compile (torch.compile's), off (eager); "
        "default auto, or SPECDEC_FAST_PATH: graphs on CUDA",
    )
    args = ap.parse_args()
    if args.fast_path:  # every request's default (static_cache.default_mode)
        os.environ[static_cache.FAST_PATH_ENV] = args.fast_path
    threads.apply(args.threads, share=queue_limits.concurrency())  # auto threads divide free cores among runs
    # A non-loopback bind, or a share link anyone can open, is public hosting: presets only by default.
    shared = args.share or os.environ.get("GRADIO_SHARE", "").lower() in ("1", "true")
    hosting.configure("gradio.live" if shared else args.host)
    zerogpu.preload()  # on ZeroGPU: the preset models, placed once at start-up (a no-op elsewhere)
    launch(args.host, args.port, args.share)
