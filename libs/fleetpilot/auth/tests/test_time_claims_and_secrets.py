"""Signed tokens whose time claims are no numbers, and key sets that hold a shared secret."""

from __future__ import annotations

import json
import os
import stat

import jwt
import pytest
from fleetpilot.auth import AuthError, KeyRing, TokenVerifier, mint_token, save_jwks

AUD, ISS = "fleetpilot", "https://auth.example"
T0 = 1_800_000_000.0


def _signed(ring: KeyRing, claims: dict) -> str:
    """A token signed by the ring's key whose payload is exactly ``claims`` as Python's json
    writes it: NaN and Infinity included, which pyjwt's own encoder would also write."""
    key = ring.signing_key()
    return jwt.api_jws.encode(json.dumps(claims).encode(), jwt.PyJWK(key.private_jwk, key.alg).key,
                              algorithm=key.alg, headers={"kid": key.kid})


@pytest.mark.parametrize(
    "times",
    [
        {"exp": float("nan")},
        {"exp": float("inf")},
        {"exp": "99999999999"},
        {"exp": True},
        {"exp": T0 + 600, "nbf": float("nan")},
        {"exp": T0 + 600, "iat": float("-inf")},
    ],
    ids=["exp-nan", "exp-infinity", "exp-string", "exp-bool", "nbf-nan", "iat-minus-infinity"],
)
def test_a_time_claim_that_is_no_finite_number_is_refused(times: dict) -> None:
    # NaN and Infinity compared false (or never past): such a token never expired, and a
    # NaN nbf never held it back. A NumericDate is a JSON number (RFC 7519 section 2).
    ring = KeyRing(clock=lambda: T0)
    ring.signing_key()
    verifier = TokenVerifier(ring.public_jwks(), audience=AUD, issuer=ISS, clock=lambda: T0 + 60)
    claims = {"tenant": "acme", "sub": "acme", "aud": AUD, "iss": ISS, "iat": T0, "nbf": T0, **times}
    with pytest.raises(AuthError) as err:
        verifier.verify(_signed(ring, claims))
    assert err.value.reason == "malformed", str(err.value)


@pytest.mark.parametrize(("alg", "mode"), [("HS256", 0o600), ("EdDSA", 0o644)])
def test_a_key_set_holding_a_shared_secret_is_readable_by_its_owner_only(tmp_path, alg, mode) -> None:
    # With HS256 the "public" key set is the secret that mints any tenant's token; a set of
    # public keys stays readable by verifiers running as other users.
    ring = KeyRing(alg, clock=lambda: T0)
    ring.signing_key()
    old_umask = os.umask(0o022)
    try:
        save_jwks(ring.public_jwks(), tmp_path / "jwks.json")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "jwks.json").stat().st_mode) == mode


def test_a_token_issued_in_the_future_is_not_yet_valid() -> None:
    # pyjwt's iat check is switched off (it reads the wall clock, not the verifier's) and
    # was never made again: a token issued a day from now, nbf in the past, was accepted.
    ring = KeyRing(clock=lambda: T0)
    ring.signing_key()
    verifier = TokenVerifier(ring.public_jwks(), audience=AUD, issuer=ISS, clock=lambda: T0)
    claims = {"tenant": "acme", "sub": "acme", "aud": AUD, "iss": ISS, "nbf": T0 - 60, "exp": T0 + 600}
    with pytest.raises(AuthError) as err:
        verifier.verify(_signed(ring, {**claims, "iat": T0 + 86400}))
    assert err.value.reason == "not_yet_valid", str(err.value)
    assert verifier.verify(_signed(ring, {**claims, "iat": T0 + 20})).tenant == "acme"  # skew within leeway


@pytest.mark.parametrize("leeway_s", [float("nan"), float("inf"), -1.0])
def test_a_verifier_refuses_a_leeway_that_would_let_tokens_live_forever(leeway_s) -> None:
    # With a NaN leeway `now >= exp + leeway` was never true: no token expired.
    with pytest.raises(ValueError, match="leeway_s must be a finite number"):
        TokenVerifier({"keys": []}, audience=AUD, issuer=ISS, leeway_s=leeway_s)


@pytest.mark.parametrize("name", ["exp", "nbf", "iat"])
def test_a_time_claim_too_large_for_a_float_is_malformed_not_a_crash(name: str) -> None:
    # JSON reads 1000...0 (400 digits) as a Python int; float() of it raised OverflowError,
    # which escaped verify as a traceback instead of an AuthError.
    ring = KeyRing(clock=lambda: T0)
    ring.signing_key()
    verifier = TokenVerifier(ring.public_jwks(), audience=AUD, issuer=ISS, clock=lambda: T0 + 60)
    claims = {"tenant": "acme", "sub": "acme", "aud": AUD, "iss": ISS, "iat": T0, "nbf": T0, "exp": T0 + 600,
              name: 10**400}
    with pytest.raises(AuthError) as err:
        verifier.verify(_signed(ring, claims))
    assert err.value.reason == "malformed", str(err.value)


@pytest.mark.parametrize("valid_until", [float("nan"), "nan", str(T0 + 600), 10**400],
                         ids=["nan", "text-nan", "text-number", "int-too-large"])
def test_a_key_whose_valid_until_is_no_finite_number_is_skipped(valid_until) -> None:
    # float() took the text "nan" and JSON's NaN: `now > nan` is never true, so a stale key
    # set kept such a key verifying for ever; an int too large raised OverflowError out of
    # update_jwks (which the SLA gate's reload does not catch). The README: skipped.
    ring = KeyRing(clock=lambda: T0)
    ring.signing_key()
    token = mint_token(ring, "acme", AUD, ISS, ttl_s=600)
    jwks = ring.public_jwks()
    jwks["keys"][0]["valid_until"] = valid_until
    verifier = TokenVerifier(jwks, audience=AUD, issuer=ISS, clock=lambda: T0 + 60)
    with pytest.raises(AuthError) as err:
        verifier.verify(token)
    assert err.value.reason == "unknown_kid", str(err.value)
