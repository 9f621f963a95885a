"""Who may read a node's observability endpoint: a web config, typed.

The file (``metrics.web_config`` in a broker's or sidecar's config) follows
the Prometheus exporter toolkit's ``web-config.yml``; gateway/webconfig.py
reads it into a :class:`WebConfig` when the config is loaded, and
gateway/httpserver.py enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.tls import WebTls


@dataclass(frozen=True, slots=True)
class WebConfig:
    """TLS (``None``: plain HTTP) and the basic-auth users with their argon2
    password hashes (empty: no authentication), from the file ``path``."""

    path: str
    tls: WebTls | None = None
    users: tuple[tuple[str, str], ...] = ()
