"""Every bound of ``vlfit serve`` in one place, with its default and why (docs/serving.md has the table).

``vlfit serve``'s flags of the same names set them (declared here, each field's help its flag's, and inherited by
``vlfit serve``'s arguments through ``vlfit.arguments.runtime.flags_of``); ``create_app(engine,
limits=ServerLimits(...))`` takes them.
Who enforces each: ``vlfit.serve.connections`` (connections, shared by address as ``vlfit.serve.pool`` keeps them,
and request heads, under uvicorn), the app's middlewares in ``vlfit.serve.middleware`` (bodies arriving, then
requests in flight, counted per client in ``vlfit.serve.clients``), ``vlfit.serve.admission`` (a search's
expected wait) and ``vlfit.serve.json_body``, ``vlfit.serve.queries`` and ``vlfit.serve.images`` (what a
request may ask).
"""

from __future__ import annotations

from dataclasses import dataclass

from vlfit.errors import ConfigError
from vlfit.flags import flag
from vlfit.serve.clients import trusted_networks
from vlfit.threads import available_cores

LIMITS_KEY = "vlfit.limits"  # the app's lifespan state entries its connections read: its ServerLimits and metrics
METRICS_KEY = "vlfit.metrics"
ADMISSION_KEY = "vlfit.admission"  # and its WaitAdmission (None without --max_queue_wait_ms)
CLIENTS_KEY = "vlfit.clients"  # and its ClientShares (vlfit.serve.clients)
SEARCH_PATH = "/api/search"  # the routes whose requests are admitted by expected wait
VECTORIZE_PATH = "/vectorize"  # Weaviate's multi2vec modules' route (vlfit.serve.weaviate)
EMBEDDINGS_PATH = "/v1/embeddings"  # OpenAI's embeddings API (vlfit.serve.openai_api)
VECTORIZING_PATHS = (VECTORIZE_PATH, EMBEDDINGS_PATH)  # texts and images together: the "vectorize" queue and thread
ADMITTED_PATHS = (SEARCH_PATH, *VECTORIZING_PATHS)
WEAVIATE_PROBES = ("/.well-known/live", "/.well-known/ready")  # what Weaviate waits on before it starts
# Never refused for load (answered on the event loop in microseconds): a monitor sees an overloaded server as up
# and overloaded, not as down.
EXEMPT_PATHS = ("/api/health", "/metrics", *WEAVIATE_PROBES)


# The default --max_concurrency: requests in flight per CPU core, and the fewest. Measured on a 2-core CPU (the
# text encoder an INT8 ONNX Runtime graph, 10^5 vectors; benchmarks/serve_pressure.py --levels overload --pin, the
# server on one core and its clients on the other), open-loop arrivals at twice the capacity the same run measured,
# admitted p99 over the unloaded p50, pooled and fresh connections: 32 in flight 145x and 132x, 16 29.6x and 44.8x,
# 8 10.3x and 13.6x, with as many queries answered at 8 as at 32; with every level run (docs/serving.md), 8 left the
# admitted tail at 7.5x (kept-open) and 17.7x (fresh). Beyond what the wait budget sees, each request in
# flight waits behind every other on the event loop, which bounds the count, not the wait.
CONCURRENCY_PER_CORE = 4
MIN_CONCURRENCY = 8


def default_concurrency(cores: int | None = None) -> int:
    """``--max_concurrency``'s default: ``CONCURRENCY_PER_CORE`` per core of ``cores`` (those this process may run
    on), at least ``MIN_CONCURRENCY``."""
    cores = available_cores() if cores is None else cores
    return max(MIN_CONCURRENCY, CONCURRENCY_PER_CORE * cores)


@dataclass(frozen=True)
class ServerLimits:
    """The server's bounds.

    Args:
        max_concurrency: Requests in flight (from the end of their body: queued or computing; health and metrics not
            counted); one beyond is answered 503 with ``Retry-After`` at once. ``None`` (the default):
            ``default_concurrency()``, ``CONCURRENCY_PER_CORE`` (4) per CPU core the process may use, at least
            ``MIN_CONCURRENCY`` (8); each worker of ``--workers N`` holds its own. A hard ceiling:
            ``max_queue_wait_ms`` refuses earlier where it sees the wait; what it cannot see (requests read and parsed
            behind every other on the event loop) this bounds.
        max_queue_wait_ms: The longest expected wait, in milliseconds, a search is admitted with (queries of its
            kind ahead x their measured time each; ``vlfit.serve.admission``); a search over it is answered 503 with
            ``Retry-After`` at once, by the connection. 0 (the default): 10x the unloaded time of a query of its
            kind (text, image, vectorize), so the budget follows the model and the machine. ``None``: no wait
            budget, only ``max_concurrency`` (on the command line, a budget far above any wait, such as 60000, does
            the same).
            With 128 closed-loop clients that resend at once it kept the answered queries' p50 near the unloaded
            time, where the count cap alone queued them for tens of milliseconds (docs/serving.md has the
            measurements). Before a query of a kind has been answered, and with nothing ahead, only
            ``max_concurrency`` applies.
        max_connections: Open connections (far below the usual 1024 file-descriptor limit, so the server never runs
            out of them). When all are open, a new connection from an address holding fewer than its fair share (these
            over the addresses holding connections) takes the slot of an idle one of the address holding the most, as
            nginx reuses idle keep-alive connections; one that cannot is answered 503 and closed (after its
            ``Retry-After`` where its address holds connections beside other addresses, so that reopening at once
            costs the server an accept a second per connection).
        header_timeout: Seconds a request head may take to arrive (also: how long a new connection may stay
            silent).
        body_timeout: Seconds a request body may take to arrive, whole (408 beyond): 20 MB at about 3 Mbit/s.
        max_header_bytes: The largest request line plus headers (431 beyond); 16 KiB, h11's default.
        keep_alive_timeout: Seconds an idle keep-alive connection stays open after a response (uvicorn's).
        max_text_chars: The longest text query (422 beyond). A CLIP text tower reads 77 tokens, a few hundred
            characters; 2000 is far above any caption and tokenizes in well under a millisecond.
        max_query_pixels: The most pixels a query image may declare (422 beyond), read from its header before
            any decoding: 40 megapixels, a large camera photo; Pillow's bomb limit for training data is 178.9.
        thumbnail_cache_mb: Bytes of small thumbnails kept for the next request of the same image and size.
        max_connections_per_client: Open connections of one client address; one beyond is answered 429 and
            closed, so one address cannot hold the slots of ``max_connections`` (64 of 512: eight such clients
            before the server's own cap). Connections of a trusted proxy (``forwarded_allow_ips``) are not counted
            per client: they carry many.
        max_concurrency_per_client: Requests in flight of one client (its address, or behind a trusted proxy the
            address the proxy names); one beyond is answered 429 with ``Retry-After`` at once. ``None`` (the
            default): half of ``max_concurrency``, so one client leaves the other half to the rest.
        max_uploads_per_client: Request bodies of one client arriving at once (a request holds no slot of
            ``max_concurrency`` until its body is whole); one beyond is answered 429 with ``Retry-After`` at once.
            Each is bounded in time by ``body_timeout``: 32 bodies sent a byte a second from 2 addresses took every
            slot for 60 s when a slot was taken at the head. ``None`` (the default): the client's share of requests
            in flight (``max_concurrency_per_client``), so a burst of requests whose bodies follow their heads a
            moment later is refused no sooner than by that share.
        forwarded_allow_ips: Addresses of trusted proxies, comma-separated (uvicorn's flag of the same name): a
            request from one is the client its ``X-Forwarded-For`` names (the last address there that is not a
            trusted proxy), for the per-client limits and for access (loopback clients). ``None`` (the default): no
            header is trusted, every client is its connection's address.
    """

    max_concurrency: int | None = flag(
        None,
        "Requests in flight from the end of their body (health, metrics not counted); beyond: 503. Default: 4 per "
        "CPU core this process may use, at least 8 (per worker of --workers N).",
    )
    max_queue_wait_ms: float | None = flag(
        0.0,
        "Longest expected wait (ms) a search is admitted with (its kind's queries ahead x their "
        "measured time each); beyond: 503 with Retry-After. 0: 10x the unloaded time of a query of its "
        "kind (text, image), the default; a budget far above any wait (60000) leaves --max_concurrency "
        "alone.",
    )
    max_connections: int = flag(
        512,
        "Open connections (TLS handshakes included). When all are open, an address holding fewer than "
        "its fair share takes an idle connection's slot of the address holding the most; else 503 and closed.",
    )
    header_timeout: float = flag(
        10.0, "Seconds for a request head to arrive (and for a new connection to start one); 408 after."
    )
    body_timeout: float = flag(60.0, "Seconds for a whole request body to arrive; 408 after.")
    max_header_bytes: int = flag(16 * 1024, "Largest request line plus headers; 431 beyond.")
    keep_alive_timeout: int = flag(5, "Seconds an idle keep-alive connection stays open after a response.")
    max_text_chars: int = flag(2000, "Longest text query in characters; 422 beyond.")
    max_query_pixels: int = flag(
        40_000_000, "Most pixels a query image may declare (read before decoding); 422 beyond."
    )
    thumbnail_cache_mb: float = flag(32.0, "MB of small thumbnails kept for repeat requests.")
    max_connections_per_client: int = flag(
        64, "Open connections of one client address (a trusted proxy's not counted); beyond: 429 and closed."
    )
    max_concurrency_per_client: int | None = flag(
        None, "Requests in flight of one client; beyond: 429 with Retry-After. Default: half of --max_concurrency."
    )
    max_uploads_per_client: int | None = flag(
        None,
        "Request bodies of one client arriving at once (each bounded by --body_timeout; a request takes "
        "its --max_concurrency slot once its body is whole); beyond: 429 with Retry-After. Default: "
        "--max_concurrency_per_client's.",
    )
    forwarded_allow_ips: str | None = flag(
        None,
        "Trusted proxies (addresses or networks, comma-separated; *: any): a request from one is "
        "the client its X-Forwarded-For names, for the per-client limits and access. Default: none "
        "trusted.",
    )

    @property
    def requests_per_client(self) -> int:
        """``max_concurrency_per_client``, or its default: half of ``max_concurrency`` (at least 1)."""
        if self.max_concurrency_per_client is not None:
            return self.max_concurrency_per_client
        return max(1, self.max_concurrency // 2)

    @property
    def uploads_per_client(self) -> int:
        """``max_uploads_per_client``, or its default: ``requests_per_client``."""
        return self.requests_per_client if self.max_uploads_per_client is None else self.max_uploads_per_client

    def __post_init__(self) -> None:
        if self.max_concurrency is None:
            object.__setattr__(self, "max_concurrency", default_concurrency())
        for name in ("max_concurrency", "max_connections", "max_header_bytes", "max_text_chars", "max_query_pixels",
                     "max_connections_per_client", "max_concurrency_per_client",
                     "max_uploads_per_client"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.max_queue_wait_ms is not None and not self.max_queue_wait_ms >= 0:
            raise ConfigError(
                f"--max_queue_wait_ms must be at least 0 milliseconds, got {self.max_queue_wait_ms} (0: 10x the "
                "unloaded time of a query, the default)"
            )
        trusted_networks(self.forwarded_allow_ips)  # an entry that is not an address: one line, now
        if self.thumbnail_cache_mb < 0:
            raise ConfigError(f"--thumbnail_cache_mb must be at least 0, got {self.thumbnail_cache_mb}")
