"""Entry point: python app.py [--host 127.0.0.1] [--port 7860] [--share]"""

import argparse

from app.ui import launch

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Speculative decoding, live (Gradio app)")
    ap.add_argument("--host", help="interface to bind (default 127.0.0.1, or GRADIO_SERVER_NAME)")
    ap.add_argument("--port", type=int, help="port (default 7860, or GRADIO_SERVER_PORT)")
    ap.add_argument("--share", action="store_true", help="create a public gradio.live link (off by default)")
    args = ap.parse_args()
    launch(args.host, args.port, args.share)
