"""The serving command: `serve`, the OpenAI-compatible HTTP API and the chat page (nanoeuler_core/serving)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import typer

from nanoeuler_core.cli.finetune import CHAT_TEMPLATE_HELP
from nanoeuler_core.cli.train import DECODE_WEIGHTS_HELP, SPECULATIVE_HELP
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import ChatTemplate


MODES = {None: "adaptive (speculative where measured faster)", True: "speculative", False: "plain"}


def serve(
    run_dir: Path = typer.Argument(..., help="a run directory (from pretrain, sft, dpo or import)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface of this machine)"),
    port: int = typer.Option(8000, help="port to listen on (0: any free one)"),
    backend: str = typer.Option("cpu", help="cpu, cuda or reference"),
    max_batch: Optional[int] = typer.Option(None, help="rows decoded at once, shared by all requests (default: 32 "
                                                       "where a wide decoding step is cheap, a GPU; else 8)"),
    max_queue: int = typer.Option(64, help="requests that may wait for a row; more are refused (HTTP 429)"),
    template: Optional[str] = typer.Option(None, help=CHAT_TEMPLATE_HELP),
    speculative: Optional[bool] = typer.Option(None, "--speculative/--no-speculative", help=SPECULATIVE_HELP),
    decode_weights: Optional[str] = typer.Option(None, help=DECODE_WEIGHTS_HELP),
    api_key: Optional[str] = typer.Option(None, envvar="NANOEULER_API_KEY", show_envvar=True,
                                          help="require \"Authorization: Bearer KEY\" on /v1/* (/, /health and "
                                               "/metrics stay open)"),
    max_request_bytes: int = typer.Option(1 << 20, help="the largest request body taken (HTTP 413 past it)"),
    request_timeout: Optional[float] = typer.Option(None, help="seconds a request may take from its arrival: then "
                                                               "it ends (HTTP 504, or a stream's error event)"),
    shutdown_grace: float = typer.Option(30.0, help="seconds running requests get to finish on SIGTERM or Ctrl-C"),
    prefix_cache_tokens: Optional[int] = typer.Option(None, help="tokens of keys and values kept for later prompts "
                                                                 "that begin the same way (default: as many as the "
                                                                 "rows' cache, max-batch x the context; 0: none)"),
) -> None:
    """Serve the model in RUN_DIR: an OpenAI-compatible API (POST /v1/completions and
    /v1/chat/completions, streamed or not, with log-probabilities; GET /v1/models, /health,
    /metrics) and a chat page at /. Concurrent requests share one batched decoder (continuous
    batching). SIGTERM or Ctrl-C stops it: new requests get 503, running ones finish within
    --shutdown-grace seconds (a second Ctrl-C stops at once)."""
    import uvicorn

    from nanoeuler_core.serving.app import Operations, ServedModel, create_app
    from nanoeuler_core.serving.server import DrainingServer

    if max_batch is not None and max_batch < 1 or max_queue < 0:
        raise ValueError(f"--max-batch must be at least 1 and --max-queue at least 0, got {max_batch} and {max_queue}")
    if max_request_bytes < 1 or (request_timeout is not None and request_timeout <= 0) or shutdown_grace < 0:
        raise ValueError(f"--max-request-bytes and --request-timeout must be positive and --shutdown-grace at least 0, "
                         f"got {max_request_bytes}, {request_timeout} and {shutdown_grace}")
    if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
        raise ValueError(f"--prefix-cache-tokens must be 0 (no prefix cache) or more, got {prefix_cache_tokens}")
    operations = Operations(api_key or None, max_request_bytes, request_timeout, shutdown_grace)
    model, tok = load_model(run_dir, backend)
    chat_template = ChatTemplate.for_run(run_dir, template)
    if max_batch is None:  # many rows per step pay where a step over many tokens costs about one over a few
        max_batch = 32 if model.backend.multi_token_step_cheap else 8
    name = Path(run_dir).resolve().name
    created = int((Path(run_dir) / "config.json").stat().st_mtime)
    app = create_app(ServedModel(model, tok, name, chat_template, created), max_batch, max_queue, speculative,
                     decode_weights, operations, prefix_cache_tokens)
    sock = listen(host, port)
    address = sock.getsockname()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{address[1]}"
    chat = f"chat in {chat_template.name}" if chat_template else "no chat template (completions only)"
    key = "API key required on /v1" if operations.api_key else "no API key"
    typer.echo(f"serving {run_dir} as model {name!r} on {url} (chat page at {url}/, API at {url}/v1): "
               f"{max_batch} rows, {MODES[speculative]} decoding on {backend}, {chat}, {key}",
               err=True)
    DrainingServer(app, uvicorn.Config(app, log_level="info")).run(sockets=[sock])


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or one line saying why not (a port in use, an unknown address)."""
    try:
        family, kind, proto, _, _ = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)   # proto TCP: asyncio then sets TCP_NODELAY on each connection
                                                    # (else a streamed chunk can wait 40 ms for an ACK)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # not past a listening socket: a restart only
        sock.bind((host, port))
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pass another --port, or a --host "
                      f"of this machine") from None
    return sock


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
