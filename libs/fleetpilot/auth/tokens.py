"""Minting and verifying JWTs: tenant from a claim, every check explicit, ``alg: none`` never.

Verification order, each failure with its own :class:`AuthError` reason:
header parses (``malformed``) -> ``alg`` configured and not ``none`` (``alg_not_allowed``)
-> ``kid`` in the key set (``unknown_kid``) -> the key's own ``alg`` equals the header's
(``alg_not_allowed``: no RS256-key-as-HMAC-secret confusion) -> key not past its
``valid_until`` (``key_retired``) -> signature (``forged``) -> ``aud`` (``wrong_audience``),
``iss`` (``wrong_issuer``), required claims (``missing_claim``) -> ``exp`` (``expired``),
``nbf`` (when present) and ``iat`` (``not_yet_valid``) on the verifier's injectable clock -> tenant
(``no_tenant``).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import jwt

from .keys import SUPPORTED_ALGORITHMS, Clock, KeyRing, _finite_number

AuthReason = Literal[
    "malformed", "alg_not_allowed", "unknown_kid", "key_retired", "forged", "expired",
    "not_yet_valid", "wrong_audience", "wrong_issuer", "missing_claim", "no_tenant",
]
# ``nbf`` is optional (RFC 7519; identity providers' tokens often leave it out): without it a
# token is valid from its ``iat``. Tokens minted here carry it.
REQUIRED_CLAIMS = ("exp", "iat", "aud", "iss")
# A refusal's detail quotes what the sender wrote (alg, kid, pyjwt's messages) before any
# signature is checked: it is cut to this length so that a 100 kB kid is not logged and sent
# back in the rejection event whole.
_DETAIL_MAX = 200


def _one_line(text: str) -> str:
    """``text`` with its unprintable characters escaped (a newline forged a log line) and cut
    to ``_DETAIL_MAX`` characters."""
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return text if len(text) <= _DETAIL_MAX else text[:_DETAIL_MAX] + "..."


class AuthError(Exception):
    """A token was refused; ``reason`` is machine-readable, the message says why to a human."""

    def __init__(self, reason: AuthReason, detail: str) -> None:
        """Carry the ``reason`` code and a one-line ``detail`` (made one short line here)."""
        detail = _one_line(detail)
        super().__init__(f"{reason}: {detail}")
        self.reason: AuthReason = reason
        self.detail = detail


@dataclass(frozen=True)
class Claims:
    """What a verified token says: who (tenant), for whom (audience), by whom (issuer), when."""

    tenant: str
    subject: str
    audience: str
    issuer: str
    issued_at: float
    not_before: float
    expires_at: float
    kid: str
    raw: dict[str, Any] = field(default_factory=dict)


def mint_token(keyring: KeyRing, tenant: str, audience: str, issuer: str, ttl_s: float, *,
               subject: str | None = None, extra: dict[str, Any] | None = None,
               clock: Clock | None = None) -> str:
    """A signed JWT for ``tenant`` valid ``ttl_s`` seconds from now, signed by the ring's current key.

    ``ttl_s`` may not exceed the ring's overlap window, so that a token never outlives the key
    that signed it. ``clock`` defaults to the ring's clock.
    """
    if not isinstance(tenant, str) or not tenant:
        # A list passed `not tenant`, and the verifier then took the subject as the tenant.
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
    if not 0 < ttl_s <= keyring.overlap_s:
        raise ValueError(f"ttl_s must be in (0, {keyring.overlap_s:g}] (the key overlap window)")
    key = keyring.signing_key()
    now = clock() if clock is not None else keyring.now()
    claims = {
        **(extra or {}),
        "tenant": tenant, "sub": subject or tenant, "aud": audience, "iss": issuer,
        "iat": int(now), "nbf": int(now), "exp": int(now + ttl_s), "jti": uuid.uuid4().hex,
    }
    signing = jwt.PyJWK(key.private_jwk, key.alg)
    return jwt.encode(claims, signing.key, algorithm=key.alg, headers={"kid": key.kid})


def _numeric_date(value: Any) -> float | None:
    """A JWT NumericDate (RFC 7519 section 2: a JSON number) as seconds, ``None`` when it is
    no finite number (a string, a boolean, NaN or an infinity, which Python's json reads, or
    an integer too large for a float)."""
    return _finite_number(value)


def _alg_of_key_type(jwk: dict[str, Any]) -> str | None:
    """The one supported algorithm a JWK without ``alg`` can be for, from its key type.

    ``alg`` is optional in a JWK (RFC 7517 section 4.4) and identity providers often leave it
    out; each key type here has a single supported algorithm, so the key's own algorithm is
    still fixed, and the header must name exactly that one (no HS/RS confusion)."""
    kty, crv = jwk.get("kty"), jwk.get("crv")
    if kty == "RSA":
        return "RS256"
    if kty == "EC" and crv == "P-256":
        return "ES256"
    if kty == "OKP" and crv in ("Ed25519", "Ed448"):
        return "EdDSA"
    if kty == "oct":
        return "HS256"
    return None


class TokenVerifier:
    """Verifies tokens against a JWKS for one audience and issuer with the allowed algorithms."""

    def __init__(self, jwks: dict[str, Any], *, audience: str, issuer: str,
                 algorithms: Iterable[str] = ("EdDSA",), tenant_claims: tuple[str, ...] = ("tenant", "sub"),
                 leeway_s: float = 30.0, clock: Clock = time.time) -> None:
        """``jwks`` is ``{"keys": [...]}`` as published by :meth:`KeyRing.public_jwks`.

        ``algorithms`` must be a subset of EdDSA, ES256, RS256, HS256 (``none`` is refused
        here too); ``tenant_claims`` are tried in order; ``leeway_s`` (finite, >= 0) absorbs clock skew.
        """
        if not (math.isfinite(leeway_s) and leeway_s >= 0):
            # A NaN leeway made every time comparison false: no token ever expired.
            raise ValueError(f"leeway_s must be a finite number of seconds, 0 or more, got {leeway_s}")
        algs = tuple(algorithms)
        bad = [a for a in algs if a not in SUPPORTED_ALGORITHMS]
        if bad or not algs:
            raise ValueError(f"algorithms must be a non-empty subset of {SUPPORTED_ALGORITHMS}, got {algs}")
        self.audience = audience
        self.issuer = issuer
        self.algorithms = algs
        self.tenant_claims = tenant_claims
        self.leeway_s = leeway_s
        self._clock = clock
        self._keys: dict[str, tuple[str, Any, float | None]] = {}
        self.update_jwks(jwks)

    def update_jwks(self, jwks: dict[str, Any]) -> None:
        """Replace the key set (after the issuer rotated).

        A key without ``alg`` is for the one supported algorithm of its type (RSA: RS256,
        P-256: ES256, Ed25519/Ed448: EdDSA, oct: HS256). Keys of other algorithms are ignored,
        and so are keys marked ``"use": "enc"`` and any key this verifier cannot use (a
        member missing, an unsupported curve, a ``valid_until`` that is no number), as RFC
        7517 section 5 asks: the set's other keys still verify, and a token signed by the
        unusable key is refused as ``unknown_kid``. A document that is no key set at all
        raises ``ValueError`` and the current keys stay.
        """
        entries = jwks.get("keys") if isinstance(jwks, dict) else None
        if not isinstance(entries, list):
            raise ValueError('not a JWKS: expected {"keys": [...]}')
        keys: dict[str, tuple[str, Any, float | None]] = {}
        for jwk in entries:
            if not isinstance(jwk, dict):
                continue
            alg, kid = jwk.get("alg", _alg_of_key_type(jwk)), jwk.get("kid")
            if not isinstance(kid, str) or not kid or alg not in self.algorithms:
                continue
            if jwk.get("use", "sig") != "sig":
                continue  # an encryption key (RFC 7517 section 4.2) verifies no signature
            member = {k: v for k, v in jwk.items() if k != "valid_until"}
            try:
                key = jwt.PyJWK(member, alg).key
                until = jwk.get("valid_until")
                valid_until = None if until is None else _numeric_date(until)
                if until is not None and valid_until is None:
                    # float() took "nan" and NaN (never retired) and raised on a huge int.
                    raise ValueError("valid_until is no finite number")
            except (jwt.PyJWTError, TypeError, ValueError):
                # One key pyjwt cannot load raised out of every reload before, and the SLA
                # service's gate then failed every request while the file held it.
                continue
            keys[kid] = (alg, key, valid_until)
        self._keys = keys

    def verify(self, token: str) -> Claims:
        """The token's claims, or :class:`AuthError` naming the first check that failed."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError as exc:
            # Not only DecodeError: pyjwt refuses a header whose ``kid`` is no string with a
            # plain InvalidTokenError, which must be a refusal too, never an unexpected error.
            raise AuthError("malformed", f"not a JWT ({exc})") from exc
        alg = header.get("alg")
        if not isinstance(alg, str) or alg.lower() == "none":
            raise AuthError("alg_not_allowed", "unsigned tokens (alg none) are never accepted")
        if alg not in self.algorithms:
            raise AuthError("alg_not_allowed", f"algorithm {alg} is not one of {', '.join(self.algorithms)}")
        kid = header.get("kid")
        if not isinstance(kid, str) or kid not in self._keys:
            raise AuthError("unknown_kid", f"no key with kid {kid!r} in the key set")
        key_alg, key, valid_until = self._keys[kid]
        if key_alg != alg:
            raise AuthError("alg_not_allowed", f"key {kid} is for {key_alg}, token says {alg}")
        now = self._clock()
        if valid_until is not None and now > valid_until + self.leeway_s:
            raise AuthError("key_retired", f"key {kid} was retired after its overlap window")
        try:
            claims = jwt.decode(
                token, key, algorithms=[alg], audience=self.audience, issuer=self.issuer,
                options={"verify_exp": False, "verify_nbf": False, "verify_iat": False,
                         "require": list(REQUIRED_CLAIMS)},
            )
        except jwt.InvalidSignatureError as exc:
            raise AuthError("forged", "signature does not match the key") from exc
        except jwt.MissingRequiredClaimError as exc:
            raise AuthError("missing_claim", str(exc)) from exc
        except jwt.InvalidAudienceError as exc:
            raise AuthError("wrong_audience", f"token is not for {self.audience!r}") from exc
        except jwt.InvalidIssuerError as exc:
            raise AuthError("wrong_issuer", f"token was not issued by {self.issuer!r}") from exc
        except jwt.InvalidTokenError as exc:
            raise AuthError("malformed", str(exc)) from exc
        # Time is checked here, on the injectable clock, rather than by pyjwt's wall clock.
        exp, nbf, iat = (_numeric_date(claims.get(name, claims["iat"])) for name in ("exp", "nbf", "iat"))
        if exp is None or nbf is None or iat is None:
            # A NaN or infinite exp compared as never past: the token would never expire.
            raise AuthError("malformed", "exp, nbf and iat must be finite numbers")
        if now >= exp + self.leeway_s:
            raise AuthError("expired", f"expired {now - exp:.0f} s ago")
        if now + self.leeway_s < nbf:
            raise AuthError("not_yet_valid", f"valid only in {nbf - now:.0f} s")
        if now + self.leeway_s < iat:
            # pyjwt's own iat check is off (it reads the wall clock), so it is made here.
            raise AuthError("not_yet_valid", f"issued {iat - now:.0f} s in the future")
        wrong_type = [c for c in self.tenant_claims if claims.get(c) is not None and not isinstance(claims[c], str)]
        if wrong_type:
            # Skipped, a list tenant let the next claim (``sub``, a user) name the tenant.
            raise AuthError("malformed", f"claim {wrong_type[0]} is no string")
        tenant = next((claims[c] for c in self.tenant_claims if claims.get(c)), None)
        if tenant is None:
            raise AuthError("no_tenant", f"none of the claims {', '.join(self.tenant_claims)} names a tenant")
        aud = claims["aud"]
        return Claims(tenant=tenant, subject=str(claims.get("sub", "")),
                      audience=aud if isinstance(aud, str) else self.audience, issuer=claims["iss"],
                      issued_at=iat, not_before=nbf, expires_at=exp, kid=kid, raw=claims)
