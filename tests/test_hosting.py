"""Public hosting defaults: presets only, no owner's token for visitors' ids, no host paths in messages."""

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app import models
from app.core.config import UserError
from app.models import hosting

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def on_space(monkeypatch):
    monkeypatch.setenv("SPACE_ID", "someone/specdec")
    monkeypatch.delenv("SPECDEC_ALLOWED_MODELS", raising=False)


def test_private_machine_is_open_and_public_hosting_is_presets_only(monkeypatch):
    monkeypatch.delenv("SPACE_ID", raising=False)
    monkeypatch.delenv("SPECDEC_ALLOWED_MODELS", raising=False)
    hosting.configure("127.0.0.1")
    assert not hosting.public() and models.allowlist() is None
    hosting.configure("0.0.0.0")
    try:
        assert hosting.public()
        with pytest.raises(UserError, match="not on this server's model list"):
            models.resolve("someone/custom-model")
    finally:
        hosting.configure(None)


def test_on_a_space_a_custom_id_is_refused_and_presets_load(on_space):
    with pytest.raises(UserError, match="pick one of the presets"):
        models.load_pair("someone/custom-model", "prompt-lookup")
    pair = models.load_pair("stdlib-code target (bundled)", "prompt lookup (n-grams)")
    assert pair.draft_name == models.PROMPT_LOOKUP
    assert all("/" not in name or not name.startswith("/") for name in models.allowlist())


@pytest.mark.parametrize("bad", ["prompt-lookup", "early-exit:2", "eagle:/x", "prompt lookup (n-grams)"])
def test_draft_sources_are_never_targets(bad):
    with pytest.raises(UserError, match="draft source, not a target"):
        models.load_pair(bad, "prompt-lookup")


# Ids that only look like prompt lookup or early exit, and install paths: none may skip the model list.
BYPASSES = ["prompt-lookup-evil/tiny", "prompt-lookupX/y", "early-exit:2x/y", "early-exit:+2", "eagle:someone/head"]


@pytest.mark.parametrize("draft", [*BYPASSES, "eagle:" + models.TINY_TARGET, models.FEATURE_DRAFT])
def test_on_a_space_only_real_draft_sources_skip_the_list(on_space, draft):
    with pytest.raises(UserError, match="not on this server's model list|early exit needs a layer count"):
        models.load_pair("stdlib-code target (bundled)", draft)
    for real in ("prompt-lookup", "early exit after 2 layers", "early-exit:1"):
        assert models.load_pair("stdlib-code target (bundled)", real).draft.modules() == []


@pytest.mark.parametrize("target", [models.SMOLLM2, models.TINY_TARGET], ids=["smollm2", "tiny"])
def test_the_draft_size_sweeps_own_drafts_pass_a_public_servers_model_list(on_space, target):
    """The Which draft panel's defaults name bundled drafts by their preset labels, never an install path."""
    from app import sweep

    drafts = sweep.drafts_for(target, 30)
    assert not [d for d in drafts if str(models.BUNDLED) in d or d.startswith("/")], drafts
    for draft in drafts:
        hosting.check(draft, "draft", models.preset_ids(), means=models.presets.id_of(draft))


def test_a_bundled_install_path_is_refused_like_any_other_path(on_space):
    """Accepting the bundled models' absolute paths alone would confirm where the app is installed."""
    for typed in (models.TINY_TARGET, "/srv/elsewhere/target"):
        with pytest.raises(UserError, match="not on this server's model list"):
            models.load_pair(typed, "prompt-lookup")
    assert models.load_pair("stdlib-code target (bundled)").draft_name == models.FEATURE_DRAFT  # its default head


@pytest.mark.parametrize(
    "target, draft, message",
    [
        (models.TINY_TARGET, "eagle:" + models.TINY_TARGET, "holds a full model, not a feature head"),
        ("/etc", "prompt-lookup", "has no config.json"),
        ("/etc/hostname", "prompt-lookup", "no such directory"),
        ("https://evil.example/x", "prompt-lookup", "neither a local directory nor a Hub id"),
        (models.TINY_TARGET, "eagle:https://evil.example/x", "neither a local directory nor a Hub id"),
    ],
)
def test_odd_ids_are_refused_in_the_apps_own_words(monkeypatch, target, draft, message):
    monkeypatch.setenv("SPECDEC_ALLOWED_MODELS", "any")
    with pytest.raises(UserError, match=message) as err:
        models.load_pair(target, draft)
    assert "hf download" not in str(err.value) and "instantiate" not in str(err.value)


@pytest.mark.slow  # two CLI processes, one a generation
def test_export_and_json_name_models_as_picked_never_by_install_path():
    run = dict(cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    pair = ["--target", "stdlib-code target (bundled)", "--draft", "feature draft (EAGLE-style, bundled)"]
    out = subprocess.run([sys.executable, "-m", "app", "export", *pair, "--json"], **run)
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(ROOT) not in out.stdout and '"vllm", "serve", "assets/models/target"' in out.stdout, out.stdout
    gen = [sys.executable, "-m", "app", "generate", "--prompt", "def f(a):", *pair, "--max-new-tokens", "4"]
    out = subprocess.run([*gen, "--json"], **run)
    doc = json.loads(out.stdout)
    assert str(ROOT) not in out.stdout and doc["target"] == "stdlib-code target (bundled)", out.stderr[-2000:]


@pytest.mark.parametrize("typed", ["/proc/self/cwd", "/proc/self/exe", "~", "..", str(ROOT / "assets"), "x" * 300])
@pytest.mark.parametrize("mode", ["space", "open"])
def test_no_message_contains_a_resolved_host_path(monkeypatch, typed, mode):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if mode == "space":
        monkeypatch.setenv("SPACE_ID", "someone/specdec")
        monkeypatch.delenv("SPECDEC_ALLOWED_MODELS", raising=False)
    else:
        monkeypatch.delenv("SPACE_ID", raising=False)
        monkeypatch.setenv("SPECDEC_ALLOWED_MODELS", "any")
    with pytest.raises(UserError) as err:
        models.load_pair(typed, "prompt-lookup")
    message = str(err.value)
    resolved = {os.getcwd(), str(ROOT), os.path.expanduser("~"), sys.executable, os.path.realpath(sys.executable)}
    assert not any(p in message for p in resolved if p not in typed), message  # echoing what was typed is fine
    assert len(message) < 600


def test_an_id_typed_into_a_private_server_gets_no_token_unless_the_owner_opts_in(monkeypatch):
    """A plain reverse proxy can make visitors look local, so a server never lends a typed id the owner's login."""
    for name in ("SPACE_ID", "SPECDEC_OWNER_TOKEN", "GRADIO_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hosting, "_proxied", False)
    monkeypatch.setattr(hosting, "_serving", False)
    assert not hosting.public() and hosting.token_for("me/private-model", set()) is None, "the CLI: the owner's own"
    hosting.serving()
    assert hosting.token_for("me/private-model", set()) is False
    assert hosting.token_for("Qwen/some-model", {"Qwen/some-model"}) is None, "a preset the owner listed"
    monkeypatch.setenv("SPECDEC_OWNER_TOKEN", "1")
    assert hosting.token_for("me/private-model", set()) is None


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self):
        _Recorder.seen.append(dict(self.headers))
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", "RepoNotFound")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(json.dumps({"error": "Repository not found"}).encode())

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


def test_a_visitors_id_never_reaches_the_hub_with_the_owners_token(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.seen.clear()
    env = dict(
        os.environ,
        SPACE_ID="someone/specdec",
        SPECDEC_ALLOWED_MODELS="any",
        HF_TOKEN="hf_owner_secret",
        HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_DISABLE_IMPLICIT_TOKEN="0",
        OMP_NUM_THREADS="1",
    )
    env.pop("HF_HUB_OFFLINE", None)
    code = (
        "from app import models\n"
        "from app.core.config import UserError\n"
        "try:\n    models.load_pair('visitor/private-model', 'prompt-lookup')\n"
        "except UserError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    server.shutdown()
    assert "refused:" in out.stdout, out.stderr[-2000:]
    assert _Recorder.seen, "the mock Hub must have been asked"
    assert not any("hf_owner_secret" in json.dumps(h) for h in _Recorder.seen)
    assert not any(k.lower() == "authorization" for h in _Recorder.seen for k in h)


class _BigModelHub(_Recorder):
    paths: list = []
    params = 70_000_000_000

    def _answer(self):
        _BigModelHub.paths.append(self.path)
        if self.path.startswith("/api/models/"):
            n = _BigModelHub.params
            body = json.dumps({"id": "visitor/huge", "safetensors": {"parameters": {"BF16": n}, "total": n}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)
        else:
            super()._answer()

    do_GET = do_HEAD = _answer


@pytest.mark.parametrize(
    "params, cap, message",
    [(70_000_000_000, "", "70.0B parameters; this server loads at most 8.0B"), (10**13, "1e15", "GiB can hold")],
)
def test_a_model_over_the_size_cap_or_the_hosts_memory_is_refused_before_download(tmp_path, params, cap, message):
    _BigModelHub.params = params
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BigModelHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.seen.clear()
    env = dict(
        os.environ,
        SPACE_ID="someone/specdec",
        SPECDEC_ALLOWED_MODELS="any",
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
        OMP_NUM_THREADS="1",
        SPECDEC_MAX_PARAMS=cap,
    )
    env.pop("HF_HUB_OFFLINE", None)
    code = (
        "from app import models\nfrom app.core.config import UserError\n"
        "try:\n    models.load_pair('visitor/huge', 'prompt-lookup')\n"
        "except UserError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    server.shutdown()
    assert message in out.stdout, out.stdout + out.stderr[-2000:]
    assert any(p.startswith("/api/models/visitor/huge") for p in _BigModelHub.paths)
    assert not any("/resolve/" in p for p in _BigModelHub.paths), "no file may be downloaded"


def test_lookalike_draft_ids_make_no_hub_request(tmp_path):
    """With a Hub that answers, an id that only looks like a draft source is refused before any request."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.seen.clear()
    env = dict(
        os.environ,
        SPACE_ID="someone/specdec",
        HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
        HF_HOME=str(tmp_path / "hf"),
        OMP_NUM_THREADS="1",
    )
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("SPECDEC_ALLOWED_MODELS", None)
    code = (
        "from app import models\nfrom app.core.config import UserError\n"
        f"for draft in {BYPASSES!r}:\n"
        "    try:\n        models.load_pair('stdlib-code target (bundled)', draft)\n"
        "    except UserError as e:\n        print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    server.shutdown()
    assert out.stdout.count("refused:") == len(BYPASSES), out.stdout + out.stderr[-2000:]
    assert not _Recorder.seen, f"{len(_Recorder.seen)} Hub requests"


@pytest.mark.parametrize(
    "headers, proxied",
    [
        ({b"host": b"127.0.0.1:7860"}, False),
        ({b"host": b"localhost:7860"}, False),
        ({b"host": b"[::1]:7860"}, False),
        ({b"host": b"specdec.example.org"}, True),  # a tunnel or proxy passing the public name through
        ({b"host": b"127.0.0.1:7860", b"x-forwarded-for": b"203.0.113.5"}, True),
        ({b"host": b"127.0.0.1:7860", b"forwarded": b"for=203.0.113.5"}, True),
    ],
)
def test_a_request_through_a_proxy_or_tunnel_is_told_apart(headers, proxied):
    from app.serve import boundary

    assert boundary._proxied(headers) is proxied


@pytest.mark.slow  # a server
def test_a_loopback_server_reached_through_a_proxy_is_public(tmp_path):
    """Bound to 127.0.0.1 but reached through a reverse proxy: from then on, presets only."""
    from app_server import serve
    from gradio_client import Client

    custom = ["stdlib-code target (bundled)", "", "prompt lookup (n-grams)", str(models.BUNDLED / "draft-small")]
    with serve(tmp_path / "server.log") as url:
        assert "Loaded target" in Client(url, verbose=False).predict(*custom, api_name="/load_pair")
        proxied = Client(url, verbose=False, headers={"x-forwarded-for": "203.0.113.5"})
        for client in (proxied, Client(url, verbose=False)):  # and it stays public
            with pytest.raises(Exception, match="not on this server's model list"):
                client.predict(*custom, api_name="/load_pair")
        assert "Loaded target" in proxied.predict(*custom[:3], "", api_name="/load_pair"), "presets still load"
    log = (tmp_path / "server.log").read_text()
    assert "through a proxy or tunnel" in log and "Traceback" not in log


def test_loading_never_asks_the_hub_for_kernels(monkeypatch):
    """With the `kernels` package installed, transformers kernelizes every load, and on CUDA that fetches
    kernels-community's rotary from the Hub: offline, the load failed. The app's loads ask for none."""
    import torch
    import transformers.modeling_utils
    from huggingface_hub import constants
    from transformers.utils import is_kernels_available

    from app.models import loading

    if not is_kernels_available():
        pytest.skip("the `kernels` package is not installed here")

    def hub(*args, **kwargs):
        raise RuntimeError("Version 2 of 'kernels-community/rotary' is not available in the local cache")

    monkeypatch.setattr(transformers.modeling_utils, "kernelize", hub)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    path = loading.resolve(models.TINY_TARGET)
    model, _ = loading._load_uncached(path, models.TINY_TARGET, None, torch.device("cpu"), torch.float32, False)
    assert not model.use_kernels
