"""`reaper healthcheck`: the image's HEALTHCHECK. It asks `/healthz` where the command the container
runs answers it: `reaper run` on `metrics.port`, `reaper serve` on `http.port` (over TLS when
`http.tls_certfile` is set). The configuration is the container's own: its REAPER_ variables, and
the file its main process was given with `-c` (read from that process's command line when the probe
is not given one), so a changed `metrics.port` or a `reaper serve` container is probed where it
listens. Healthy (exit 0) when either answers 200; else exit 1 naming each address tried.
"""

from __future__ import annotations

import ipaddress
import ssl
import urllib.request
from pathlib import Path

from harvester.config import Config

# the container's main process: its command line names the configuration file the probe reads too
MAIN_PROCESS_CMDLINE = Path("/proc/1/cmdline")
_CONFIG_FLAGS = ("-c", "--config")


def config_file_of_main_process(cmdline: Path = MAIN_PROCESS_CMDLINE) -> str | None:
    """The `-c`/`--config` file of the container's main process when it is a `reaper` command, else None."""
    try:
        args = cmdline.read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return None
    if not any(Path(a).name == "reaper" or a == "harvester.cli" for a in args[:3]):
        return None
    for i, arg in enumerate(args):
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            return args[i + 1]
        for flag in _CONFIG_FLAGS:
            if arg.startswith(f"{flag}="):
                return arg[len(flag) + 1 :]
    return None


def _reachable(host: str) -> str:
    """The address to ask for a listening `host`: a wildcard one is asked on loopback."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # a name
    if ip.is_unspecified:
        ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
    return f"[{ip}]" if ip.version == 6 else str(ip)


def targets(cfg: Config) -> list[tuple[str, str]]:
    """(what, URL) of each /healthz the container's reaper may answer on."""
    out = []
    if cfg.metrics.enabled:
        out.append((f"metrics.port {cfg.metrics.port}", f"http://{_reachable(cfg.metrics.host)}:{cfg.metrics.port}"))
    scheme = "https" if cfg.http.tls_certfile else "http"
    out.append((f"http.port {cfg.http.port}", f"{scheme}://{_reachable(cfg.http.host)}:{cfg.http.port}"))
    return [(what, f"{base}/healthz") for what, base in out]


def probe(cfg: Config, timeout: float = 2.0) -> tuple[bool, str]:
    """Whether a /healthz of `targets` answered 200, and what was found."""
    # the probe checks that the process answers, not who it is: its own certificate may name no loopback
    unverified = ssl.create_default_context()
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    failures = []
    for what, url in targets(cfg):
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=unverified) as answer:
                if answer.status == 200:
                    return True, f"healthy: {url} ({what}) answered 200"
                failures.append(f"{url} ({what}): {answer.status}")
        except Exception as exc:  # refused, timed out, an HTTP error: not healthy there
            failures.append(f"{url} ({what}): {getattr(exc, 'reason', None) or exc}")
    return False, "unhealthy: " + "; ".join(failures)
