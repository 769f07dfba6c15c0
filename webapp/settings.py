"""The one settings table: every knob the service has, its type, default and help.

Env vars (``CLASSIFIER_<NAME>``), ``create_app(config)``, ``gunicorn.conf.py``, the README
table and ``/healthz`` all read this table; nothing else defines a default. Values are
parsed and checked once, at start-up, and a bad value stops the start with a message that
names the variable, the value and what is allowed (Datasette's settings table is the model).

This module must stay cheap to import: ``gunicorn.conf.py`` reads it in the master first thing
(torch comes later there, in ``on_starting``, and never starts its thread pools: forking after
OpenMP starts hangs workers; ``webapp/preload.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import catalog, rate_limits
from .listen import BIND_RULE, parse_bind as _bind

# gunicorn.conf.py sets this: the model is then started by its post_worker_init hook, in the
# worker after fork (never in the master, even with --preload), with gunicorn's heartbeat.
GUNICORN_ENV = "WEBAPP_GUNICORN_CONF"

PREFIX = "CLASSIFIER_"

MODELS = catalog.NAMES

# The commands a setting can apply to (the ``commands`` column): ``python -m webapp serve`` (gunicorn),
# ``serve --cluster`` (Ray Serve), ``classify`` (local) and ``classify --cluster`` (Ray Data). The CLI
# offers a setting as an option of the commands it applies to.
SERVE, SERVE_CLUSTER, CLASSIFY, CLASSIFY_CLUSTER = "serve", "serve --cluster", "classify", "classify --cluster"
COMMANDS = (SERVE, SERVE_CLUSTER, CLASSIFY, CLASSIFY_CLUSTER)
SERVERS = (SERVE, SERVE_CLUSTER)  # settings only an HTTP server reads


class SettingsError(ValueError):
    """A setting has a value that is not allowed; the message names key, value and rule."""


def _bool(text: str) -> bool:
    if (low := text.strip().lower()) in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return low in ("1", "true", "yes", "on")
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _int(text: str) -> int:
    if not (digits := str(text).strip().replace("_", "")).isascii():  # int() reads any script's digits ("٥")
        raise ValueError("expected an integer in ASCII digits")
    return int(digits)


def _float(text: str) -> float:  # ASCII: float() reads any script's digits ("١٠" as 10.0: tryout26)
    if not (text := str(text).strip()).isascii() or (value := float(text)) != value or abs(value) == float("inf"):
        raise ValueError("expected a finite number in ASCII digits")
    return value


def _str(text: str) -> str:  # spaces alone are refused before any parser (Setting.convert)
    return str(text).strip()


class _Reason(ValueError):
    """A parser's refusal in words that help (said before the rule), unlike Python's own."""


TOKEN_RULE = "empty (none), or up to 4,096 letters, digits and ASCII punctuation without spaces (visible ASCII)"


def _token(text: str) -> str:
    """A bearer token: empty (none), or visible ASCII (what every HTTP client sends byte for byte). Spaces alone are
    not "none". At most 4,096: one of 9,000 started, and every header sending it got 431 (tryout34)."""
    if (value := str(text).strip()) != str(text) and not value:
        raise _Reason("only spaces: read as no token, it would leave the API open")
    if len(value) > 4096:  # gunicorn reads 8,190 bytes of a header; PAGE_LOGIN's Basic one is base64, 4/3 as long
        raise _Reason(f"{len(value):,} characters: no client could send it in one header")
    if not all("!" <= c <= "~" for c in value):
        raise _Reason("curl and browsers send other characters as UTF-8, Python's requests as Latin-1")
    return value


def _photo_folder(text: str) -> str:
    """``CALIBRATION_DIR``: empty, or a folder of photos (``assets.calibration_problem``), checked as settings load."""
    value = _str(text)
    if value:
        from .assets import calibration_problem  # Pillow: imported only when a folder is set

        if problem := calibration_problem(value):
            raise _Reason(problem)
    return value


@dataclass(frozen=True)
class Setting:
    """One row of the table.

    ``parse`` turns the env-var text into a value (raising ``ValueError`` with the rule);
    ``low``/``high`` bound numbers inclusively; ``choices`` limits strings; ``commands`` are the
    commands it applies to (``COMMANDS``); ``secret`` values are never printed in clear; ``allowed`` is
    the rule in words for a parser of its own (one of ``rate_limits``').
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None
    commands: tuple[str, ...] = COMMANDS
    secret: bool = False
    allowed: str = ""

    @property
    def env(self) -> str:
        """The environment variable that sets it, e.g. ``CLASSIFIER_MAX_BATCH_SIZE``."""
        return PREFIX + self.name

    @property
    def type_name(self) -> str:
        """Short type name for docs: int, float, bool, str or one of the choices."""
        if self.choices:
            return " / ".join(self.choices)
        return {_bool: "bool", _int: "int", _float: "float", _bind: "address"}.get(self.parse, "str")

    def rule(self) -> str:
        """What values are allowed, in words (used in error messages and docs)."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.allowed:
            return self.allowed
        if self.parse is _bool:
            return "a boolean (1/0, true/false, yes/no, on/off)"
        if self.parse is _bind:
            return BIND_RULE
        kind = "an integer" if self.parse is _int else "a number" if self.parse is _float else "a string"
        low, high = ("" if v is None else f"{v:,}" if self.parse is _int else f"{v:,g}" for v in (self.low, self.high))
        if self.low is None:
            return kind
        return f"{kind} from {low} to {high}" if self.high is not None else f"{kind} >= {low}"

    def convert(self, raw: Any, source: str) -> Any:
        """Parse and check ``raw`` (text or an already-typed value).

        :raises SettingsError: naming ``source`` (the env var or config key), the value and the rule.
        """
        try:
            if isinstance(raw, str) and raw and not raw.strip() and self.parse is not _token:  # a slip, not "empty":
                raise _Reason("only spaces (a slip?); unset it for the default")  # WEIGHTS=' ' fell back unsaid
            if isinstance(raw, str):
                value = self.parse(raw)
            elif self.parse is _bool:
                if not isinstance(raw, bool):
                    raise ValueError("expected a boolean")
                value = raw
            elif self.parse in (_int, _float) and isinstance(raw, bool):
                raise ValueError("expected a number, got a boolean")
            else:
                value = self.parse(str(raw)) if self.parse is not _float else _float(raw)
        except ValueError as exc:
            # The parser's own words ("invalid literal for int() with base 10") are Python's, not the
            # operator's: the rule says what is allowed, once; a package to install is said too.
            why = f": {exc}" if isinstance(exc, (rate_limits.MissingPackage, _Reason)) else ""
            shown = "(a secret, not shown)" if self.secret else repr(raw)
            if raw == "" and source.startswith(PREFIX):  # CLASSIFIER_TOP_K=$K, K unset: refused, as an empty path is
                why = f" (empty: a shell variable not set? unset {source} for the default, {self.default!r})"
            raise SettingsError(f"{source}={shown} is not valid{why}; allowed: {self.rule()}") from None
        if self.choices and value not in self.choices:
            raise SettingsError(f"{source}={raw!r} is not valid; allowed: {self.rule()}")
        if self.low is not None and value < self.low or self.high is not None and value > self.high:
            raise SettingsError(f"{source}={raw!r} is out of range; allowed: {self.rule()}")
        return value


MiB = 1024 * 1024  # (bytes)
# fmt: off
SETTINGS: tuple[Setting, ...] = (
    # -- model and weights --
    Setting("MODEL", _str, catalog.DEFAULT, catalog.settings_help(), choices=MODELS),
    Setting("WEIGHTS", _str, "", "Path of a ResNet-18 weights file (resnet18-f37072fd.pth). Empty: look in the torch hub "
            "cache ($TORCH_HOME/hub/checkpoints/), then download where a network exists. Read for MODEL=resnet18 "
            "only: beside another model, a warning at start says it is not used."),
    Setting("DOWNLOAD", _bool, True, "Try to download ResNet-18 weights when no file is found (gives up after "
            "DOWNLOAD_TIMEOUT_S when there is no network)."),
    Setting("DOWNLOAD_TIMEOUT_S", _float, 3.0, "Seconds a weights download may take to connect, and then for the server "
            "(or a proxy) to begin its answer, before giving up.", low=0.1, high=600),
    Setting("FALLBACK", _bool, True, "Serve the offline EfficientNet-Lite0 when ResNet-18 weights cannot be had. "
            "Off: start-up fails and says which file to put where."),
    Setting("SEED", _int, 0, "Seed of the random weights of resnet18_seeded.", low=0, high=2**31 - 1),
    Setting("SELF_TEST", _str, "auto", "Classify the shipped golden dog photo before reporting ready. auto: on for "
            "trained weights, off for resnet18_seeded.", choices=("auto", "on", "off")),
    # -- engine --
    Setting("COMPILE", _bool, True, "torch.compile the model (inductor, freezing, channels_last). Off: eager, "
            "nothing compiled (unit tests): starts in seconds, not faster than a warm compiled start."),
    Setting("PRECISION", _str, "auto", "Arithmetic of the forward pass. auto: bf16 where oneDNN has native bf16 "
            "(avx512_bf16, AMX), else fp32; int8: static quantization calibrated on real photos (see README).",
            choices=("auto", "fp32", "bf16", "int8")),
    Setting("INT8_REDUCE_RANGE", _str, "auto", "int8 activations in 7 bits instead of 8. auto: on where oneDNN "
            "has no VNNI (pre-2019 CPUs, AVX2-only), where 8-bit products can saturate.", choices=("auto", "on", "off")),
    Setting("INT8_RECHECK_PTS", _float, 3.0, "int8, trained weights: a photo whose top two labels int8 puts closer than this "
            "(percentage points) is run again in fp32 and answered by fp32, where int8 flips answers (README). 0: never.",
            low=0, high=100),
    Setting("BF16_RECHECK_PTS", _float, 1.0, "bf16: the same, for bf16's close calls; auto judges bf16 with them (README).", low=0, high=100),
    Setting("CACHE_DIR", _str, "", "Directory for compiled kernels and the int8 program; survives restarts so "
            "workers start fast. Empty: ~/.cache/photo-classifier."),
    Setting("CALIBRATION_DIR", _photo_folder, "", "Photos to calibrate int8 on (JPEG/PNG/WebP), and bf16's start-up "
            "check. Empty: the 28 shipped ones (webapp/calibration). Your own photos suit a narrow domain better.",
            allowed="empty, or a folder holding JPEG, PNG or WebP photos"),
    Setting("FAST_DECODE", _bool, True, "Decode large JPEGs at a reduced DCT scale (Pillow draft), never below twice "
            "the resize size (answers stay within 2 points of a full decode): a 12 MP phone photo's decode and "
            "preprocess take ~3x less CPU (bench/preprocess_bench.py). Other formats are always decoded at full size."),
    Setting("THREADS", _int, 0, "Intra-op threads per worker. 0: one per core this worker is pinned to (on a Ray "
            "cluster: 1 per replica, which reserves that many CPUs).", low=0, high=1024),
    # -- batching --
    Setting("MAX_BATCH_SIZE", _int, 8, "Most images in one forward pass; warmed up at start: sizes 1, 2 and this (another "
            "size's first batch pays ~10 ms); every size 1..this under a JIT compile (no AOTInductor package).", low=1, high=256),
    Setting("BATCH_TIMEOUT_MS", _float, 5.0, "Longest wait (ms) after the first queued image for more to join "
            "its batch.", low=0, high=10_000),
    Setting("BATCH_WAIT", _str, "company", "When a batch waits BATCH_TIMEOUT_MS for more images. company: only while "
            "other requests' photos are being decoded (a lone request runs at once); fixed: always (the old way, "
            "for benchmarks).", choices=("company", "fixed"), commands=(SERVE, CLASSIFY)),
    Setting("WORK_NICE", _int, 10, "How many niceness steps below a worker's request-handling thread its decode "
            "and inference threads run, so new connections, refusals and /healthz are answered at once while photos "
            "are being worked on (at 2x overload: refusals in 8 ms p99 instead of 70). 0: the same priority.",
            low=0, high=19, commands=(SERVE,)),
    Setting("IDLE_FIRST", _bool, True, "New requests go to an idle worker first: while another worker is idle, a "
            "worker with photos in progress leaves a new connection to it for 2 ms, and closes the keep-alive "
            "connection of a client it answers, so that client's next request goes there too (webapp/balance.py). "
            "Off, or with gunicorn's reuse_port: whichever worker accepts first.", commands=(SERVE,)),
    Setting("DECODE_CORES", _str, "server", "Cores a worker's decode threads may run on. server: any core of the "
            "server, so a busy worker's decodes use an idle neighbour's core (open loop at half the peak rate, 12 MP, "
            "2 single-core workers: p99 283 vs 313 ms, the same images/s at saturation); worker: only the worker's "
            "own cores. Inference threads always stay on the worker's own.", choices=("server", "worker"),
            commands=(SERVE,)),
    Setting("TRIM_IDLE_S", _float, 10.0, "Seconds a worker must be idle (no image) before it hands the memory that "
            "decoding and batches freed back to the OS (glibc malloc_trim): after 12 MP uploads a worker drops from "
            "~165 to ~100 MB private. The first photo after that pays the pages again (~3-5 ms). 0: never.",
            low=0, high=86_400, commands=(SERVE,)),
    Setting("MALLOC_ARENAS", _int, 1, "glibc malloc arenas a worker's threads share (mallopt M_ARENA_MAX, set before "
            "and as it forks). glibc gives each thread that allocates its own, up to 8 per core, and each keeps what "
            "its thread freed: 12 MP uploads left a loaded worker at 148-175 MB private, 143-150 with one arena, at the "
            "same CPU per image. 0: glibc's own default.", low=0, high=1024, commands=(SERVE,)),
    Setting("QUEUE_SIZE", _int, 64, "Most images waiting in one worker's queue; more get 429 with Retry-After.",
            low=1, high=100_000),
    Setting("MAX_WAIT_MS", _float, 1000.0, "Latency budget (ms): a request this worker predicts it would answer "
            "later than this (photos being decoded and queued, times their measured cost) gets 429 at once, before "
            "its body is read, with Retry-After from that prediction. QUEUE_SIZE still applies.",
            low=10, high=86_400_000, commands=(SERVE,)),
    Setting("REQUEST_TIMEOUT_S", _float, 30.0, "Seconds from a request's body read to its result, decoding included, "
            "before it gets 504. Bounds requests only: start-up's self-test has STARTUP_TIMEOUT_S.", low=0.01, high=3600),
    # -- requests --
    Setting("TOP_K", _int, 3, "Labels returned per image when the request does not say (topk=1..10).", low=1, high=10),
    Setting("MAX_UPLOAD_BYTES", _int, 32 * MiB, "Largest request body in bytes; larger gets 413.", low=1024, high=2**40),
    Setting("MAX_FILES", _int, 16, "Most images in one request; more get 413.", low=1, high=1024, commands=SERVERS),
    Setting("MAX_PIXELS", _int, 80_000_000, "Largest image in pixels (width x height, read from the header before "
            "decoding); larger gets 413. 80 MP admits 64 MP phone photos.", low=1, high=2**40),
    Setting("MAX_REQUEST_PIXELS", _int, 256_000_000, "Most pixels one request's photos may decode to together "
            "(read from their headers before any is decoded; a large JPEG counts at the reduced size FAST_DECODE "
            "decodes it at); more gets 413. Bounds the decode work one request holds a worker for: 256 MP is 16 "
            "PNGs of 16 MP, ~4 to 7 s of decoding here.", low=1, high=2**44, commands=SERVERS),
    Setting("BODY_TIMEOUT_S", _float, 30.0, "Longest pause (s) between bytes of a request body; a client that stalls longer "
            "gets 408 and its connection closes (also bounds how long SIGTERM waits on a stalled upload).", low=0.1, high=3600, commands=SERVERS),
    # -- access --
    Setting("API_TOKEN", _token, "", "If set, POST /api/v1/* and POST /v2/models/*/infer need 'Authorization: "
            "Bearer <token>' (compared in constant time); else 401. /healthz, /readyz, /v2 health and metadata stay "
            "open, and so does the page: its own POST / classifies for anyone who can open it (behind a proxy's "
            "login, or PAGE_LOGIN, if it must not).", commands=SERVERS, secret=True, allowed=TOKEN_RULE),
    Setting("PAGE_LOGIN", _bool, False, "The page asks for API_TOKEN too (HTTP Basic: any user name, the token as "
            "password): a browser asks once and sends it with the page's photos. Needs API_TOKEN.", commands=SERVERS),
    Setting("TRUSTED_PROXIES", _int, 0, "Reverse proxies in front that set X-Forwarded-For/-Proto/-Host (nginx, a "
            "load balancer): the client address the logs and RATE_LIMIT see is the one the outermost of them saw. "
            "0: those headers are ignored (a client could set them).", low=0, high=5, commands=SERVERS),
    Setting("RATE_LIMIT", rate_limits.rate_limit, "", "Per-client-address limit on classify requests: one budget "
            "for the page, the API and /v2 together, in Flask-Limiter's notation, e.g. '120/minute' or "
            "'10/second;500/hour'; over it: 429. Empty: off.", commands=SERVERS, allowed=rate_limits.RATE_LIMIT_RULE),
    Setting("RATE_LIMIT_STORAGE", rate_limits.storage, "memory://", "Where rate-limit counters live (Flask-Limiter "
            "storage URI with a moving window). memory:// counts per worker; redis://host:6379 shares counts between "
            "workers and hosts and needs the redis client, which requirements.txt leaves out: pip install redis.",
            commands=SERVERS, allowed=rate_limits.STORAGE_RULE),
    # -- operations --
    Setting("METRICS", _bool, True, "Serve /metrics in Prometheus format (all gunicorn workers counted). With "
            "API_TOKEN set, a scrape needs a token too (METRICS_TOKEN, else API_TOKEN).", commands=SERVERS),
    Setting("METRICS_TOKEN", _token, "", "If set, GET /metrics needs 'Authorization: Bearer <token>' (Prometheus: "
            "authorization: {credentials: <token>} in the scrape config); else 401. Empty: the API_TOKEN, if set.",
            commands=SERVERS, secret=True, allowed=TOKEN_RULE),
    Setting("ACCESS_LOG", _str, "text", "Access log lines: text (gunicorn's), json (one JSON object per request, "
            "with its request id), or off.", choices=("text", "json", "off"), commands=SERVERS),
    # -- Ray cluster: python -m webapp serve --cluster / classify --cluster (requirements-cluster.txt) --
    Setting("CLUSTER_REPLICAS", _int, 1, "Model replicas on the Ray cluster, each reserving THREADS CPUs (1 when "
            "THREADS is 0). 0: autoscale between CLUSTER_MIN_REPLICAS and CLUSTER_MAX_REPLICAS, aiming at "
            "MAX_BATCH_SIZE requests in flight per replica.", low=0, high=10_000, commands=(SERVE_CLUSTER,)),
    Setting("CLUSTER_MIN_REPLICAS", _int, 1, "Autoscaling (CLUSTER_REPLICAS=0): fewest model replicas (at least 1: "
            "a new replica compiles its model before it serves).", low=1, high=10_000, commands=(SERVE_CLUSTER,)),
    Setting("CLUSTER_MAX_REPLICAS", _int, 4, "Autoscaling (CLUSTER_REPLICAS=0): most model replicas.", low=1, high=10_000, commands=(SERVE_CLUSTER,)),
    Setting("CLUSTER_INGRESS_REPLICAS", _int, 1, "HTTP replicas on the Ray cluster (this Flask app: parsing uploads, "
            "errors, the page); they reserve no CPU and forward each upload to a model replica.", low=1, high=10_000, commands=(SERVE_CLUSTER,)),
    Setting("CLUSTER_MAX_ONGOING_REQUESTS", _int, 16, "Requests one model replica takes at once (Ray Serve "
            "max_ongoing_requests); its batches form from these, so keep it >= MAX_BATCH_SIZE.", low=1, high=100_000,
            commands=(SERVE_CLUSTER,)),
    Setting("CLUSTER_MAX_QUEUED_REQUESTS", _int, 64, "Requests waiting for a model replica, per HTTP replica (Ray "
            "Serve max_queued_requests); more get 429 with Retry-After.", low=1, high=1_000_000, commands=(SERVE_CLUSTER,)),
    Setting("CLUSTER_ACTORS", _int, 2, "classify --cluster: model actors classifying at once (Ray Data actor pool), "
            "each reserving THREADS CPUs (1 when THREADS is 0).", low=1, high=10_000, commands=(CLASSIFY_CLUSTER,)),
    # -- server --
    Setting("BIND", _bind, "127.0.0.1:8000", "Address gunicorn listens on: HOST:PORT, [IPv6]:PORT, unix:PATH, or a "
            "bare PORT (on 127.0.0.1); or Ray Serve's HTTP proxy with serve --cluster. Localhost unless you open it.", commands=SERVERS),
    Setting("WORKERS", _int, 0, "gunicorn worker processes. 0: cores this process may use / threads per worker. More than the "
            "available memory holds at 150 MB each (cpu.WORKER_MB) is refused at start (exit 2), -w too.", low=0, high=1024, commands=SERVERS),
    Setting("STARTUP_TIMEOUT_S", _int, 600, "Seconds a worker may spend building, compiling and warming up its model. A "
            "compile (in a child process) still running then is stopped and the start fails saying so (exit 3); a worker "
            "otherwise still starting stops reporting and gunicorn replaces it 60 s later.", low=10, high=86_400, commands=SERVERS),
    Setting("PRELOAD_LIBRARIES", _bool, True, "Import torch, torchvision, timm and the service's code in gunicorn's master "
            "before it forks the workers (never the model or a thread pool), so every worker shares those pages instead "
            "of holding its own ~400 MB copy. Off: each worker imports them itself (the old way, for benchmarks).", commands=(SERVE,)),
    Setting("LOG_LEVEL", _str, "info", "Log level.", choices=("debug", "info", "warning", "error")),
)  # fmt: on

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


class Settings(Mapping[str, Any]):
    """Checked, typed settings: ``s.MAX_BATCH_SIZE`` or ``s["MAX_BATCH_SIZE"]``; ``sources``: see ``given_as``."""

    def __init__(self, values: Mapping[str, Any], sources: Mapping[str, str] | None = None):
        self._values, self.sources = dict(values), dict(sources or {})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> Any: return self._values[name]
    def __iter__(self): return iter(self._values)
    def __len__(self) -> int: return len(self._values)
    def __repr__(self) -> str: return f"Settings({self._values!r})"


def given_as(values: Mapping[str, Any], name: str) -> str:
    """How the user set setting ``name``, for messages: the flag it came from (``--weights``: ``load``'s ``names``),
    else its variable (``CLASSIFIER_WEIGHTS``; so for a default, a config key, and any plain mapping ``values``)."""
    return getattr(values, "sources", {}).get(name, PREFIX + name)


ALIASES = {"PORT": "BIND", "HOST": "BIND", "ADDRESS": "BIND", "LISTEN": "BIND"}  # what other servers call it


def did_you_mean(key: str, prefix: str = "") -> str:
    """" (did you mean X?)" for a mistyped ``key`` (``prefix`` + name): the name nearest it, compared without the
    prefix and the underscores (difflib ratio >= 0.75: MAXBATCH, MODLE, TOKEN); else those holding it as a word
    (SIZE: MAX_BATCH_SIZE or QUEUE_SIZE), else ``ALIASES``' (PORT: BIND); else "" (tryout34: MAXBATCH, TOKEN, PORT had none)."""
    import difflib

    typed, squashed = key[len(prefix):].upper(), {n.replace("_", ""): n for n in BY_NAME}
    near = [squashed[c] for c in difflib.get_close_matches(typed.replace("_", ""), list(squashed), n=1, cutoff=0.75)]
    near = near or [n for n in BY_NAME if typed in n.split("_")][:3] or [ALIASES[k] for k in (typed,) if k in ALIASES]
    return f" (did you mean {' or '.join(prefix + n for n in near)}?)" if near else ""


def load(environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None,
         names: Mapping[str, str] | None = None) -> Settings:
    """Read every setting: default, then ``CLASSIFIER_*`` env var, then ``overrides`` (config keys; flags: ``names``).

    :raises SettingsError: for an unknown ``CLASSIFIER_*`` variable or config key (a typo must not be silently
        ignored), a value outside the table's rule, or a conflicting pair (``RATE_LIMIT`` with an empty
        ``RATE_LIMIT_STORAGE``; ``CLUSTER_MIN_REPLICAS`` above ``CLUSTER_MAX_REPLICAS`` while autoscaling; ``PAGE_LOGIN``
        without ``API_TOKEN``).
    """
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    values: dict[str, Any] = {}
    unknown = [(k, k, PREFIX) for k in environ if k.startswith(PREFIX) and k[len(PREFIX):] not in BY_NAME]
    for key, shown, prefix in unknown + [(k, repr(k), "") for k in overrides if k not in BY_NAME]:  # (not 60 names)
        raise SettingsError(f"unknown setting {shown}{did_you_mean(key, prefix) or ' (python -m webapp settings lists them)'}")
    for s in SETTINGS:
        value = s.default
        if s.env in environ:
            value = s.convert(environ[s.env], s.env)
        if s.name in overrides:
            value = s.convert(overrides[s.name], s.name)
        values[s.name] = value
    src = {name: (names or {}).get(name, name) if name in overrides else PREFIX + name for name in BY_NAME}
    if values["RATE_LIMIT"] and not values["RATE_LIMIT_STORAGE"]:  # a limit needs somewhere to count
        raise SettingsError(f"{src['RATE_LIMIT_STORAGE']}='' is not valid; allowed: {BY_NAME['RATE_LIMIT_STORAGE'].rule()}")
    if values["CLUSTER_REPLICAS"] == 0 and (low := values["CLUSTER_MIN_REPLICAS"]) > values["CLUSTER_MAX_REPLICAS"]:
        raise SettingsError(f"{src['CLUSTER_MIN_REPLICAS']}={low} is above {src['CLUSTER_MAX_REPLICAS']}="
                            f"{values['CLUSTER_MAX_REPLICAS']} (autoscaling: CLASSIFIER_CLUSTER_REPLICAS=0)")
    if values["PAGE_LOGIN"] and not values["API_TOKEN"]:  # no token to ask for: not a page left open unsaid
        raise SettingsError(f"{src['PAGE_LOGIN']} needs {src['API_TOKEN']}: the page asks for that token")
    return Settings(values, {name: how for name, how in (names or {}).items() if name in overrides})


def markdown_table() -> str:
    """The README's settings table, generated from ``SETTINGS`` (a test keeps the README in step)."""
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = "(empty)" if s.default == "" else f"`{str(s.default).lower() if isinstance(s.default, bool) else s.default}`"
        rows.append(f"| `{s.env}` | {s.type_name} | {default} | {s.help} |")
    return "\n".join(rows)
