"""Local state shared by the CLI commands: the state directory and the signing keys."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from fleetpilot.auth import KeyRing, edit_keyring, mint_token

AUDIENCE = "fleetpilot"
ISSUER = "fleetpilot-local"
NATS_URL_FILE = "nats.url"
"""Where a running ``fleetpilot up`` leaves its bus's URL in the state directory."""
UP_LOCK_FILE = "up.lock"
"""Held by the ``fleetpilot up`` that runs from a state directory, for as long as it runs."""
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def state_dir(explicit: str | None = None) -> Path:
    """``--state-dir``, else ``FLEETPILOT_STATE_DIR``, else ``./.fleetpilot``; a
    ``ValueError`` in one line when that names something that is not a directory."""
    path = Path(explicit or os.environ.get("FLEETPILOT_STATE_DIR") or ".fleetpilot").resolve()
    if path.exists() and not path.is_dir():
        # Said here, not as the FileExistsError of a mkdir deep inside a command.
        raise ValueError(f"state directory {path} is not a directory (--state-dir or FLEETPILOT_STATE_DIR)")
    return path


def announced_nats_url(explicit_state: str | None = None) -> str | None:
    """The bus of a fleet known to be running: ``FLEETPILOT_NATS_URL``, else the one a
    running ``fleetpilot up`` announced in the state directory (its embedded server takes a
    free port); None when neither says. An announcement whose ``up`` no longer runs says
    nothing: an ``up`` killed outright cannot take its ``nats.url`` back."""
    env = os.environ.get("FLEETPILOT_NATS_URL")
    if env:
        return env
    state = state_dir(explicit_state)
    try:
        announced = (state / NATS_URL_FILE).read_text().strip()
    except OSError:
        return None
    return announced if announced and up_runs_from(state) else None


def up_runs_from(state: Path) -> bool:
    """Whether a ``fleetpilot up`` holds ``<state>/up.lock`` now. Asked of the lock, not of
    a pid written down: the kernel lets it go however its holder ended, SIGKILL included, and
    a pid may since be another process's."""
    try:
        lock = (state / UP_LOCK_FILE).open("rb")
    except OSError:
        return False
    with lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        return False


def local_nats_url(explicit_state: str | None = None) -> str:
    """The bus the CLI talks to: ``announced_nats_url``, else NATS's default port on this
    machine."""
    return announced_nats_url(explicit_state) or DEFAULT_NATS_URL


CONNECT_TIMEOUT_S = 2.0


async def connect_once(url: str, name: str):
    """A plain nats-py connection for a command that reads and leaves, tried once:
    ``ConnectionError`` with one line when no server answers (nats-py would retry a refused
    first connect forever, and print a traceback per attempt). Its answers come on the inbox
    of the URL's user, the only one that user may read (``inbox_prefix_of``)."""
    import asyncio

    import nats
    import nats.errors

    from fleetpilot.runtime.nats_bus import cannot_connect, inbox_prefix_of

    errors: list[BaseException] = []

    async def on_error(exc: BaseException) -> None:
        errors.append(exc)

    try:
        return await asyncio.wait_for(nats.connect(servers=[url], name=name, inbox_prefix=inbox_prefix_of(url),
                                                   connect_timeout=CONNECT_TIMEOUT_S,
                                                   max_reconnect_attempts=1, reconnect_time_wait=0,
                                                   error_cb=on_error),
                                      timeout=CONNECT_TIMEOUT_S * 2)
    except (ValueError, TimeoutError, OSError, nats.errors.Error) as exc:
        raise cannot_connect(url, errors[-1] if errors else exc) from None


def no_jetstream(url: str) -> ConnectionError:
    """The one-line error for a NATS server that answers but has no JetStream, which every
    stream and bucket of Fleetpilot lives in (nats-py says only ``ServiceUnavailableError``)."""
    return ConnectionError(f"the NATS server at {url} has no JetStream (Fleetpilot needs nats-server -js)")


def local_keyring(state: Path) -> KeyRing:
    """The local issuer's key ring, created on first use, rotated when its key is due;
    the public key set (``jwks.json``) that the SLA service verifies with is kept beside it.
    Read, rotated and written under the ring file's lock (:func:`edit_keyring`), so a
    concurrent ``token``, ``submit`` or ``up`` neither loses a key nor has its own lost."""
    state.mkdir(parents=True, exist_ok=True)
    with edit_keyring(state / "keyring.json", jwks_path=state / "jwks.json") as ring:
        return ring


def local_token(state: Path, tenant: str, ttl_s: float = 3600.0) -> str:
    """A bearer token for ``tenant`` signed by the local key ring."""
    return mint_token(local_keyring(state), tenant, AUDIENCE, ISSUER, ttl_s)
