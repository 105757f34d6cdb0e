"""``fleetpilot token``: mint a bearer token with the local key (for ``submit`` and scripts)."""

from __future__ import annotations

from .local import local_keyring, local_token, state_dir


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot token``."""
    parser.add_argument("--tenant", default="local")
    parser.add_argument("--ttl", type=float, default=3600.0, help="lifetime in seconds")
    parser.add_argument("--rotate", action="store_true", help="rotate the signing key first")
    parser.add_argument("--state-dir", default=None)


def main(args) -> int:
    """Print a token for the tenant."""
    state = state_dir(args.state_dir)
    if args.rotate:
        ring = local_keyring(state)
        ring.rotate()
        ring.save(state / "keyring.json")
        local_keyring(state)  # republish the JWKS with the new key
    print(local_token(state, args.tenant, args.ttl))
    return 0
