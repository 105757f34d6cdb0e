"""``fleetpilot token``: mint a bearer token with the local key (for ``submit`` and scripts)."""

from __future__ import annotations

from fleetpilot.auth import edit_keyring, mint_token

from .arguments import path_text, positive_float
from .local import AUDIENCE, ISSUER, state_dir


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot token``."""
    parser.add_argument("--tenant", default="local")
    parser.add_argument("--ttl", type=positive_float, default=3600.0,
                        help="lifetime in seconds, at most the key overlap window (86400 by default)")
    parser.add_argument("--rotate", action="store_true", help="rotate the signing key first")
    parser.add_argument("--state-dir", type=path_text, default=None)


def main(args) -> int:
    """Print a token for the tenant.

    Every argument is checked before the key ring changes (a refused ``--rotate`` rotated
    the key before): the ring is read, rotated, used and written under its file lock, so a
    concurrent ``token``, ``submit`` or ``up`` neither loses this rotation nor has its own lost.
    """
    if not args.tenant:
        raise ValueError("--tenant must not be empty")
    state = state_dir(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    with edit_keyring(state / "keyring.json", jwks_path=state / "jwks.json") as ring:
        if not args.ttl <= ring.overlap_s:
            # Said here, naming the flag: mint_token's own refusal names its parameter ttl_s.
            raise ValueError(f"--ttl must be at most {ring.overlap_s:g} s (the signing key overlap window), "
                             f"got {args.ttl:g}")
        if args.rotate:
            ring.rotate()
        token = mint_token(ring, args.tenant, AUDIENCE, ISSUER, args.ttl)
    print(token)
    return 0
