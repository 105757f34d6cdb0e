"""Tenant authentication: rotating signing keys and strict JWT verification.

Issuer side: :class:`KeyRing`, :func:`edit_keyring` (a ring file shared by processes) and
:func:`mint_token`. Verifier side: :class:`TokenVerifier` over the ring's public JWKS, returning :class:`Claims` or raising :class:`AuthError`.
"""

from .keys import (
    DAY_S,
    SUPPORTED_ALGORITHMS,
    WEEK_S,
    KeyRing,
    SigningKey,
    edit_keyring,
    generate_jwk,
    load_jwks,
    save_jwks,
)
from .tokens import REQUIRED_CLAIMS, AuthError, AuthReason, Claims, TokenVerifier, mint_token

__all__ = [
    "DAY_S",
    "REQUIRED_CLAIMS",
    "SUPPORTED_ALGORITHMS",
    "WEEK_S",
    "AuthError",
    "AuthReason",
    "Claims",
    "KeyRing",
    "SigningKey",
    "TokenVerifier",
    "edit_keyring",
    "generate_jwk",
    "load_jwks",
    "mint_token",
    "save_jwks",
]
