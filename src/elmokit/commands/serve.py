"""`elmo serve`: an HTTP service for ELMo's vectors, and a page to explore them (elmokit.serve)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from elmokit.commands.common import add_device_arguments, add_model_arguments, device_from_args, model_from_args
from elmokit.extras import require
from elmokit.serve.inputs import Limits  # plain Python: no extra needed
from elmokit.devices import check_threads

API_KEY_VARIABLE = "ELMOKIT_API_KEY"

DESCRIPTION = f"""\
Serve the model's contextual vectors over HTTP, on --host:--port (127.0.0.1:8080 unless told
otherwise), and print the address (on stderr) once the model is loaded and requests are answered:

  POST /v1/embeddings  OpenAI-compatible: a vector per input text (the mean over its tokens of the
                       equal-weight average of all layers, as ElmoEmbedder gives it)
  POST /embed          TEI-compatible: the same vectors, unit length by default
  POST /embed_all      token-level vectors: all layers, one, or a weighted mix; JSON floats or
                       base64 float32; the tokens beside them
  POST /explore        the page's nearest occurrences and pictures
  GET  /health, /info, /metrics (Prometheus), and / : a page to explore the vectors

Texts are Moses-tokenized, as `elmo embed --tokenize` does; token lists are taken as they are.
The texts of the requests in flight run in the recurrence together (--rows), in a process of the
model's own: a text joins as soon as a row is free, and its answer leaves at its last step
(--max-batch-tokens, --max-wait-ms). Every text starts from a zero state: its vector never
depends on the others it ran with. Bad requests get a 4xx and a JSON error; a full queue
(--max-queue-tokens) answers 429, a request of more tokens than it may hold 413; a body that
takes longer than --body-timeout, 408. A request whose client hangs up is dropped, from the
queue and the recurrence. With --api-key (or {API_KEY_VARIABLE}), every route but /health and
the page needs 'Authorization: Bearer KEY'. SIGTERM (or Ctrl-C) stops accepting, finishes the
requests already accepted (for at most --shutdown-timeout seconds; those left get 503), says
how it stopped, and exits 0.
Needs the serve extra: pip install 'elmokit[serve]'. docs/serve.md has examples."""


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("serve", help="serve the vectors over HTTP (OpenAI/TEI routes) and a page",
                                    description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080; 0: any free port)")
    parser.add_argument("--api-key",
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_VARIABLE}, else no key)")
    parser.add_argument("--rows", type=int,
                        help="sentences the recurrence runs at once, each joining as soon as a row is free "
                             "(default: the rows embed_sentences chooses for a call of --max-batch-tokens "
                             "positions, at most 16384 of them counted: 128)")
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="tokens in the recurrence at once, summed over its rows (default: 16384)")
    parser.add_argument("--max-wait-ms", type=float, default=2.0,
                        help="an idle model waits for more requests until none has come for this long, at most "
                             "10x this after the first (default: 2)")
    parser.add_argument("--max-queue-tokens", type=int, default=Limits.max_queue_tokens,
                        help="tokens waiting at most; past that a request gets 429, and one of more tokens "
                             f"than this, 413 (default: {Limits.max_queue_tokens}, a request of --max-inputs x "
                             "--max-input-tokens at their defaults)")
    parser.add_argument("--max-inputs", type=int, default=256, help="inputs per request at most (default: 256)")
    parser.add_argument("--max-input-tokens", type=int, default=512, help="tokens per input at most (default: 512)")
    parser.add_argument("--max-body-bytes", type=int, default=2_000_000,
                        help="size of a request body at most (default: 2000000)")
    parser.add_argument("--body-timeout", type=float, default=20.0,
                        help="seconds a client has to send a request's whole body; past it, 408 (default: 20)")
    parser.add_argument("--shutdown-timeout", type=float, default=25.0,
                        help="seconds SIGTERM waits for the requests in flight before it cancels them (503) "
                             "and exits (default: 25, within the 30 s Kubernetes gives before SIGKILL)")
    parser.add_argument("--threads", type=int,
                        help="torch threads for the model (default: the CPUs this process may use, by its "
                             "affinity and cgroup quota, less those other processes keep busy when it starts)")
    add_model_arguments(parser)
    add_device_arguments(parser, dtype=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    limits = Limits(args.max_body_bytes, args.max_inputs, args.max_input_tokens, args.max_batch_tokens,
                    args.max_queue_tokens, args.max_wait_ms, args.body_timeout)  # bad limits fail before anything loads
    if args.rows is not None and not 1 <= args.rows <= 4096:
        raise ValueError(f"--rows must be from 1 to 4096, got {args.rows}")
    if not 0 < args.shutdown_timeout <= 3600:
        raise ValueError(f"--shutdown-timeout must be more than 0 and at most 3600 seconds, "
                         f"got {args.shutdown_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    if args.threads is not None:
        check_threads(args.threads, "--threads")
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_VARIABLE)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"--api-key (or ${API_KEY_VARIABLE}) is empty: give a key, or unset it for none")
    require("serve", "elmo serve")
    listener = _listen(args.host, args.port)  # a taken port fails before the model loads
    try:
        return _serve(args, limits, listener)
    except KeyboardInterrupt as interrupt:  # SIGTERM (the CLI's handler) or Ctrl-C while the model loaded; once
        # it serves, uvicorn takes both and drains (see `_serve`)
        logging.getLogger(__name__).info(f"stopped ({interrupt or 'Ctrl-C'}) while the model was loading: no "
                                         f"request was accepted, the connections made meanwhile are closed unanswered")
        return 0
    finally:
        listener.close()


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r} is not an address of this machine: {error.strerror}") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    listener.listen(2048)
    return listener


def _serve(args: argparse.Namespace, limits, listener: socket.socket) -> int:
    import uvicorn

    from elmokit.inference.embedder import ElmoEmbedder
    from elmokit.inference.files import make_tokenizer
    from elmokit.serve.app import Service, build_app

    model_name = args.model or args.options_file or "gutenberg-en"
    service = Service(ElmoEmbedder(module=model_from_args(args), device=device_from_args(args), dtype=args.dtype,
                                   threads=args.threads),
                      model_name, limits, make_tokenizer(True), "moses", args.api_key, args.rows)  # no other reference:
    # the embedder leaves this process for the model's (elmokit.serve.worker) once that has loaded it
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    def ready() -> None:  # the model's process has the model: /health answers 200 from now on
        if server.should_exit:  # SIGTERM came while the model's process loaded: uvicorn stops at once
            return
        print(f"listening on http://{shown}:{port} (model {model_name}; SIGTERM or Ctrl-C to stop)", file=sys.stderr,
              flush=True)  # a message, as every other: stdout is for what a command outputs

    config = uvicorn.Config(build_app(service, ready), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught once it has drained; no-op handlers make that an exit 0
    previous = {number: signal.signal(number, lambda *_: None) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[listener])
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    logging.getLogger(__name__).info(_how_it_stopped(service, args.shutdown_timeout))
    return 0


def _how_it_stopped(service, shutdown_timeout: float) -> str:
    """The last message: whether every accepted request was answered, and if not, why."""
    said = []
    if service.batcher.died:
        said.append(f"the model's process had died while serving (exit code {service.batcher.exit_code}): "
                    f"the requests in flight then, and those after, got 503")
    if service.unanswered:
        said.append(f"{service.unanswered} request{'s' if service.unanswered > 1 else ''} still in flight at "
                    f"--shutdown-timeout ({shutdown_timeout:g} s) got 503, unanswered")
    return "stopped: " + ("; ".join(said) if said else "every accepted request was answered")
