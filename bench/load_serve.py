"""Load test of `nanoeuler-run serve`: C concurrent streaming clients for D seconds, each sending
one completion request after another; aggregate tokens/s (against one client at a time, the gain
from continuous batching, and against the server's own decoder alone at the same rows) and the
time to first token.

    python bench/load_serve.py RUN_DIR                                   # CPU: 1, 16 and 64 clients, 60 s each
    python bench/load_serve.py RUN_DIR --backend cuda --clients 1,64,256 --max-batch 64
    python bench/load_serve.py --url http://127.0.0.1:8000 --clients 16  # a server already running
    python bench/load_serve.py RUN_DIR --system-words 400 --compare-prefix-cache   # a shared system prompt

Without --url it starts `nanoeuler-run serve RUN_DIR --port 0` itself (with --backend and, if
given, --max-batch) and stops it at the end. Each request: a prompt of --prompt-tokens tokens cut
from the bundled corpus (a different place per request), "stream": true, --max-tokens new tokens
exactly ("ignore_eos": true, so every request is the same work), temperature 0.8 with a seed of
its own. A client starts no new request after D seconds; the window ends when its last one does.
One untimed request goes first, so that no window pays for what a server compiles on its first.

Per client count: requests done and failed (any status but 200, an error event, a broken
stream: a failed request is a failed test), new tokens per second over the window (tokens from
the usage each stream ends with), and p50/p99 time to first token (from sending the request to
the first piece of text, queueing included), and the CPU seconds the clients themselves took (on
the machine they share with the server). One JSON line per client count on stdout.

The decoder alone (with a RUN, before the server starts, on the same machine): `Decoder.generate`
of as many rows as the server decodes at that client count (min(clients, rows)), prompts of the
same token length, the same new tokens and sampling; its tokens/s (prefill included) is
`decoder_tokens_per_s`, and the server's share of it `share_of_decoder`.

--system-words N puts the same N words of corpus text (a system prompt) before every request's
own text; with --compare-prefix-cache each client count runs twice, against a server with its
prefix cache and one started with --prefix-cache-tokens 0, so the two TTFTs compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import numpy as np

CORPUS = Path(__file__).parents[1] / "data" / "tinyshakespeare.txt"


def prompts(count: int, words: int, system_words: int = 0) -> list[str]:
    """`count` prompts of about `words` words, from places spread over the corpus, each after the
    same `system_words` words (the corpus's first)."""
    text = CORPUS.read_text(encoding="utf-8").split()
    system = " ".join(text[:system_words]) + " " if system_words else ""
    starts = np.random.default_rng(0).integers(system_words, len(text) - words, count)
    return [system + " ".join(text[s:s + words]) for s in starts]


class Client:
    """One client: a keep-alive HTTP/1.1 connection, read by hand. The load generator shares the
    cores with the server, so it does as little per streamed chunk as it can (an HTTP library's
    parsing of each chunk costs more than the server's work per token): a chunk is only searched
    for the first text and the usage, and parsed as JSON only for the usage."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.reader = self.writer = None
        self.prompt_tokens = 0   # of the last request (its usage)

    async def request(self, body: dict) -> tuple[float | None, int, str | None]:
        """(time to first text in s, new tokens, error or None) of one streamed completion."""
        start, first, tokens, done = time.perf_counter(), None, 0, False
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            payload = json.dumps(body).encode()
            self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), len(payload), payload))
            status = int((await self.reader.readline()).split()[1])
            headers = {}
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, value = line.decode("latin-1").split(":", 1)
                headers[name.strip().lower()] = value.strip()
            if "content-length" in headers:   # an error object
                text = await self.reader.readexactly(int(headers["content-length"]))
                self.close()
                return None, 0, f"HTTP {status}: {text[:200]!r}"
            buffer = b""
            while (size := int((await self.reader.readline()).strip(), 16)) > 0:   # chunked
                buffer += (await self.reader.readexactly(size + 2))[:-2]
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if event == b"data: [DONE]":
                        done = True
                    elif event.startswith(b'data: {"error":'):   # the server's error object, not text that says "error"
                        self.close()   # the rest of the stream is left unread
                        return None, 0, f"error event: {event[:200]!r}"
                    elif b'"usage":{' in event:
                        usage = json.loads(event[6:])["usage"]
                        tokens, self.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                    elif first is None and b'"text":""' not in event:
                        first = time.perf_counter() - start
            await self.reader.readline()
            if headers.get("connection") == "close":
                self.close()
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
            self.close()
            return None, 0, f"{type(exc).__name__}: {exc}"
        return (first, tokens, None) if status == 200 and done else (None, 0, f"HTTP {status}, no data: [DONE]")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def load(url: str, clients: int, duration: float, max_tokens: int, words: int, system_words: int) -> dict:
    texts = prompts(4096, words, system_words)
    results: list[tuple[float | None, int, str | None]] = []
    prompt_tokens: list[int] = []
    start, cpu = time.perf_counter(), time.process_time()
    deadline = start + duration

    async def client(c: int) -> None:
        connection, i = Client(url), 0
        while i == 0 or time.perf_counter() < deadline:   # one request at least
            n = c * 100_000 + i
            body = {"prompt": texts[n % len(texts)], "max_tokens": max_tokens, "temperature": 0.8, "seed": n,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            results.append(await connection.request(body))
            prompt_tokens.append(connection.prompt_tokens)
            i += 1
        connection.close()

    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    ttft = np.array([r[0] for r in results if r[2] is None and r[0] is not None])
    failures = [r[2] for r in results if r[2] is not None]
    tokens = sum(r[1] for r in results)
    return {"clients": clients, "seconds": round(elapsed, 1), "requests": len(results), "failed": len(failures),
            "first_failures": failures[:3], "tokens": tokens, "tokens_per_s": round(tokens / elapsed, 1),
            "ttft_p50_ms": round(1000 * float(np.percentile(ttft, 50)), 1) if ttft.size else None,
            "ttft_p99_ms": round(1000 * float(np.percentile(ttft, 99)), 1) if ttft.size else None,
            "client_cpu_s": round(cpu, 1), "prompt_tokens": round(float(np.mean(prompt_tokens)), 1)}


def decoder_alone(run: Path, backend: str, rows: int, prompt_tokens: int, max_tokens: int,
                  speculative: bool | None) -> float:
    """Tokens/s of the server's decoder alone: `rows` prompts of `prompt_tokens` tokens decoded to
    max_tokens new tokens each (temperature 0.8, every token kept), the prefill included; the
    fastest of three calls after a first that compiles."""
    from nanoeuler_core.inference.decoder import Decoder, DecodeStats, Sampling
    from nanoeuler_core.inference.loading import load_model

    model, tok = load_model(run, backend)
    ids = tok.encode(" ".join(CORPUS.read_text(encoding="utf-8")[:200_000].split()))
    decoder = Decoder(model, rows, speculative, Sampling(0.8))
    best = 0.0
    for call in range(4):
        stats = DecodeStats()
        starts = np.random.default_rng(call).integers(0, len(ids) - prompt_tokens, rows)
        decoder.generate([ids[s:s + prompt_tokens] for s in starts], max_tokens, list(range(rows)), stats=stats)
        best = max(best, stats.tokens_per_s) if call else best
    return best


def start_server(run: Path, backend: str, max_batch: int | None, log: Path,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`nanoeuler-run serve` on a free port (with `extra` arguments); its process and URL once /health answers."""
    args = [sys.executable, "-m", "nanoeuler_core.cli", "serve", str(run), "--port", "0", "--backend", backend, *extra]
    if max_batch:
        args += ["--max-batch", str(max_batch)]
    stream = open(log, "w")
    server = subprocess.Popen(args, stderr=stream, stdout=stream)
    for _ in range(6000):
        found = re.search(r"on (http://[\d.]+:\d+) ", log.read_text())
        if found:
            try:
                if httpx.get(found.group(1) + "/health").status_code == 200:
                    return server, found.group(1)
            except httpx.HTTPError:
                pass
        if server.poll() is not None:
            raise SystemExit(f"the server stopped:\n{log.read_text()}")
        time.sleep(0.1)
    server.terminate()
    raise SystemExit("the server did not come up in 10 minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", type=Path, help="run directory to serve (else --url)")
    parser.add_argument("--url", help="a server already running (RUN is then not needed)")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--max-batch", type=int, help="the server's --max-batch (default: its own)")
    parser.add_argument("--clients", default="1,16,64", help="client counts to run, one after the other")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds each client count sends requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--prompt-words", type=int, default=12, help="words of corpus text per prompt")
    parser.add_argument("--log", type=Path, default=Path("serve_load.log"), help="the started server's log")
    parser.add_argument("--system-words", type=int, default=0, help="words of a system prompt shared by every request")
    parser.add_argument("--compare-prefix-cache", action="store_true",
                        help="run each client count against a server with its prefix cache and one without")
    parser.add_argument("--no-decoder", action="store_true", help="skip the decoder alone")
    args = parser.parse_args()
    if (args.run is None) == (args.url is None):
        parser.error("give a RUN directory or --url")
    if args.compare_prefix_cache and args.url:
        parser.error("--compare-prefix-cache starts its own servers: give a RUN directory")
    counts = [int(c) for c in args.clients.split(",")]
    servers = [("cache", ()), ("no cache", ("--prefix-cache-tokens", "0"))] if args.compare_prefix_cache \
        else [("", ())]
    decoder_speed: dict[int, float] = {}
    for label, extra in servers:
        server, url = (None, args.url) if args.url else \
            start_server(args.run, args.backend, args.max_batch, args.log, extra)
        try:
            health = httpx.get(url + "/health").json()
            print(f"# {url}: model {health['model']!r}, {health['rows']} rows{', ' + label if label else ''}; "
                  f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            asyncio.run(load(url, 1, 0.0, 2, args.prompt_words, args.system_words))   # one untimed request first
            for clients in counts:
                result = asyncio.run(load(url, clients, args.duration, args.max_tokens, args.prompt_words,
                                          args.system_words))
                line = {**result, "rows": health["rows"], "max_tokens": args.max_tokens}
                rows = min(clients, health["rows"])
                if args.run is not None and not args.no_decoder and rows not in decoder_speed:
                    decoder_speed[rows] = decoder_alone(args.run, args.backend, rows, round(result["prompt_tokens"]),
                                                        args.max_tokens, None)
                if rows in decoder_speed:
                    line |= {"decoder_tokens_per_s": round(decoder_speed[rows], 1),
                             "share_of_decoder": round(result["tokens_per_s"] / decoder_speed[rows], 3)}
                print(json.dumps({**line, "prefix_cache": label or None,
                                  "load_average": round(os.getloadavg()[0], 1)}), flush=True)
        finally:
            if server is not None:
                server.terminate()
                server.wait(30)


if __name__ == "__main__":
    main()
