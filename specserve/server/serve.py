"""`specserve serve`: load the models, start the engine thread, serve HTTP with uvicorn.

Shutdown on SIGTERM or Ctrl-C (draining): the server keeps accepting connections, and
new requests get 503 (with `Connection: close`, and /health says 503 too), while the
requests in flight finish, for at most `shutdown_grace_s`; then whatever is left ends
with a clear error (HTTP 503, or an error event in a stream) and the process exits;
nothing hangs. A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import uvicorn

from specserve.config import SpecConfig
from specserve.engine.build import build_engine
from specserve.engine.engine import DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_SCHEDULER_STEPS
from specserve.errors import ConfigError
from specserve.model.device import CPU
from specserve.server.app import ApiSettings, build_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.metrics import ServerMetrics
from specserve.server.recording import PromptRecorder
from specserve.server.transport import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    SEND_TIMEOUT_S,
    TimedH11Protocol,
    raise_open_file_limit,
)

log = logging.getLogger("specserve")


@dataclass(frozen=True)
class ServerConfig:
    model: str
    spec: SpecConfig | None = None
    dtype: torch.dtype = torch.float32
    quantization: str = "none"
    batch_invariant: bool = False
    compile: bool | None = None  # see build_engine
    cuda_graphs: bool | None = None  # see build_engine
    prefix_cache_space: float | None = None  # GiB for prefix caching (model/prefix_cache.py); None: off
    kv_cache_space: float | str | None = "auto"  # GiB for the running requests' caches; see build_engine
    device: torch.device = CPU  # see specserve.model.device
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    max_queue_len: int = 64
    prefill_chunk_size: int | None = None  # None: the device's (see build_engine)
    num_scheduler_steps: int = DEFAULT_NUM_SCHEDULER_STEPS  # see Engine
    log_stats_interval_s: float = 10.0
    stream_mode: str = "step"  # see ApiSettings.stream_mode
    header_timeout_s: float = HEADER_TIMEOUT_S  # see server/transport.py
    body_timeout_s: float = BODY_TIMEOUT_S
    send_timeout_s: float = SEND_TIMEOUT_S
    shutdown_grace_s: float = 30.0
    record_prompts: str | None = None  # a file the admitted prompts are appended to (server/recording.py)
    tool_call_parser: str | None = None  # see ApiSettings.tool_call_parser
    reasoning_parser: str | None = None  # see ApiSettings.reasoning_parser
    scheduling_policy: str = "fcfs"  # see Engine
    chat_template: str | None = None  # served in place of the model's own (vLLM's --chat-template)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # see ApiSettings
    tokenizer_info: bool = False  # see ApiSettings.tokenizer_info
    cors: dict[str, Any] = field(default_factory=dict)  # ApiSettings' allowed_* and allow_credentials where given
    root_path: str = ""  # the prefix a proxy strips before forwarding (uvicorn's root_path; vLLM's --root-path)
    log_level: str = "info"


class _Server(uvicorn.Server):
    """uvicorn, plus draining on the first stop signal (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float):
        super().__init__(config)
        self._engine, self._grace_s = engine, grace_s
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: uvicorn's own shutdown, now
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.info("shutting down: refusing new requests, finishing those in flight (at most %.0f s)", self._grace_s)
        self._engine.refuse_new_requests()
        threading.Thread(target=self._drain, name="specserve-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self._grace_s
        while self._engine.num_unfinished > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self._engine.stop()  # ends what is left with a clear error
        self.should_exit = True  # uvicorn's loop sees it within 0.1 s and closes the sockets


def serve(config: ServerConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    name = config.served_model_name or config.model
    # Opened before the models load: a path that cannot be written is refused at once.
    recorder = None if config.record_prompts is None else PromptRecorder(config.record_prompts)
    engine, tokenizer = build_engine(
        config.model,
        config.spec,
        config.dtype,
        config.max_model_len,
        config.quantization,
        config.batch_invariant,
        compile=config.compile,
        device=config.device,
        cuda_graphs=config.cuda_graphs,
        prefix_cache_space=config.prefix_cache_space,
        kv_cache_space=config.kv_cache_space,
        max_num_seqs=config.max_num_seqs,
        prefill_chunk_size=config.prefill_chunk_size,
        num_scheduler_steps=config.num_scheduler_steps,
        scheduling_policy=config.scheduling_policy,
    )
    if config.chat_template is not None:
        tokenizer.use_chat_template(config.chat_template)
    async_engine = AsyncEngine(
        engine, tokenizer, ServerMetrics(name), config.max_queue_len, config.log_stats_interval_s
    )

    @asynccontextmanager
    async def lifespan(_app):
        yield
        async_engine.stop()

    settings = ApiSettings(
        served_model_name=name,
        max_model_len=engine.max_model_len,
        api_key=config.api_key,
        stream_mode=config.stream_mode,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        default_chat_template_kwargs=config.default_chat_template_kwargs,
        tokenizer_info=config.tokenizer_info,
        **config.cors,
    )
    app = build_app(
        async_engine, tokenizer, settings, lifespan=lifespan, body_timeout_s=config.body_timeout_s, recorder=recorder
    )
    spec = "off" if config.spec is None else f"{config.spec.method}, {config.spec.describe_k()}"
    if hasattr(engine.proposer, "describe"):  # a draft model or a head
        spec += f"; {engine.proposer.describe()}"
    prefix = "off" if engine.prefix_cache is None else f"{engine.prefix_cache.max_tokens} tokens"
    kv = "unbounded" if engine.kv_cache_positions is None else f"{engine.kv_cache_positions} positions"
    log.info(
        "serving %r as %r (speculation %s; max_num_seqs %d; max_model_len %d; prefill chunk %d tokens; "
        "KV cache %s; prefix caching %s)",
        config.model,
        name,
        spec,
        config.max_num_seqs,
        engine.max_model_len,
        engine.prefill_chunk_size,
        kv,
        prefix,
    )
    if recorder is not None:
        log.info("recording the admitted requests' prompts in %s (for train-head --instructions)", recorder.path)
    raise_open_file_limit()
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        root_path=config.root_path,
        http=TimedH11Protocol.with_timeouts(config.header_timeout_s, config.send_timeout_s),
        timeout_graceful_shutdown=config.shutdown_grace_s + 5,
    )
    server = _Server(uv_config, async_engine, config.shutdown_grace_s)

    # HTTP on a second thread, the engine on the main one (see async_engine); uvicorn
    # installs no signal handlers off the main thread, so stop signals come here.
    def run_http() -> None:
        try:
            server.run()
        finally:  # also when uvicorn gives up (a taken port): never leave the engine waiting
            async_engine.stop()

    http = threading.Thread(target=run_http, name="specserve-http")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http.start()
    async_engine.run()  # returns once uvicorn's shutdown has stopped the engine
    http.join()
    if recorder is not None:
        recorder.close()
        log.info("recorded the prompts of %d requests in %s", recorder.written, recorder.path)
    if not server.started:  # e.g. the port was taken: uvicorn logged why
        raise ConfigError(f"the HTTP server did not start on {config.host}:{config.port}; see the log above")
