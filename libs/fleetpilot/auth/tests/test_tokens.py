"""Token verification: every rejection has its reason; rotation works through the overlap only."""

from __future__ import annotations

import base64
import json
import threading

import jwt
import pytest
from fleetpilot.auth import DAY_S, WEEK_S, AuthError, KeyRing, TokenVerifier, load_jwks, mint_token, save_jwks

AUD, ISS = "fleetpilot", "https://auth.example"
T0 = 1_800_000_000.0


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, at: float = T0) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def _b64(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def _setup(alg: str = "EdDSA"):
    clock = FakeClock()
    ring = KeyRing(alg, clock=clock)
    verifier = TokenVerifier(ring.public_jwks() if ring.keys else {"keys": []}, audience=AUD, issuer=ISS,
                             algorithms=[alg], clock=clock)
    token = mint_token(ring, "acme", AUD, ISS, ttl_s=600)
    verifier.update_jwks(ring.public_jwks())
    return clock, ring, verifier, token


@pytest.mark.parametrize("alg", ["EdDSA", "ES256", "RS256", "HS256"])
def test_valid_token_gives_tenant(alg):
    _, ring, verifier, token = _setup(alg)
    claims = verifier.verify(token)
    assert claims.tenant == "acme" and claims.audience == AUD and claims.issuer == ISS
    assert claims.kid == ring.keys[-1].kid and claims.expires_at - claims.issued_at == 600


def _forged(token: str, ring: KeyRing) -> str:
    header, payload, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    claims["tenant"] = "evil"
    return f"{header}.{_b64(claims)}.{sig}"


def _alg_none(token: str, ring: KeyRing) -> str:
    _, payload, _ = token.split(".")
    return f"{_b64({'alg': 'none', 'typ': 'JWT', 'kid': ring.keys[-1].kid})}.{payload}."


def _unknown_kid(token: str, ring: KeyRing) -> str:
    other = KeyRing("EdDSA", clock=lambda: T0)
    return mint_token(other, "acme", AUD, ISS, ttl_s=600)


def _hs256_with_public_key(token: str, ring: KeyRing) -> str:
    # The classic confusion attack: sign HS256 with the public key bytes as the secret.
    _, payload, _ = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    return jwt.encode(claims, "public-key-bytes-used-as-an-hmac-secret", algorithm="HS256", headers={"kid": ring.keys[-1].kid})


def _other_signature(token: str, ring: KeyRing) -> str:
    header, payload, _ = token.split(".")
    other = mint_token(KeyRing("EdDSA", clock=lambda: T0), "acme", AUD, ISS, ttl_s=600)
    return f"{header}.{payload}.{other.split('.')[2]}"


def _mint(ring: KeyRing, **kw) -> str:
    key = ring.signing_key()
    claims = {"tenant": "acme", "sub": "acme", "aud": AUD, "iss": ISS, "iat": int(T0), "nbf": int(T0),
              "exp": int(T0 + 600)}
    claims.update(kw)
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, jwt.PyJWK(key.private_jwk, key.alg).key, algorithm=key.alg,
                      headers={"kid": key.kid})


CASES = [
    ("forged payload", _forged, "forged"),
    ("signature from another key", _other_signature, "forged"),
    ("alg none", _alg_none, "alg_not_allowed"),
    ("alg not configured", _hs256_with_public_key, "alg_not_allowed"),
    ("unknown kid", _unknown_kid, "unknown_kid"),
    ("garbage", lambda t, r: "not-a-token", "malformed"),
    ("truncated", lambda t, r: t.rsplit(".", 1)[0], "malformed"),
    ("wrong audience", lambda t, r: _mint(r, aud="other-service"), "wrong_audience"),
    ("wrong issuer", lambda t, r: _mint(r, iss="https://evil.example"), "wrong_issuer"),
    ("no exp", lambda t, r: _mint(r, exp=None), "missing_claim"),
    ("no tenant", lambda t, r: _mint(r, tenant=None, sub=None), "no_tenant"),
    ("expired", lambda t, r: _mint(r, iat=int(T0 - 900), nbf=int(T0 - 900), exp=int(T0 - 300)), "expired"),
    ("not yet valid", lambda t, r: _mint(r, nbf=int(T0 + 300)), "not_yet_valid"),
]


@pytest.mark.parametrize("name,tamper,reason", CASES, ids=[c[0] for c in CASES])
def test_rejections(name, tamper, reason):
    _, ring, verifier, token = _setup()
    bad = tamper(token, ring)
    with pytest.raises(AuthError) as err:
        verifier.verify(bad)
    assert err.value.reason == reason, str(err.value)


def test_a_token_without_nbf_is_valid_from_its_iat():
    """Identity providers' tokens often carry no ``nbf`` (Auth0's access tokens, Google's ID
    tokens): RFC 7519 makes it optional. They were all refused as ``missing_claim``; the
    deploy README says to take such a provider's key set. Without ``nbf``, the token is valid
    from its ``iat``, which is checked as before."""
    clock, ring, verifier, _ = _setup()
    claims = verifier.verify(_mint(ring, nbf=None))
    assert (claims.tenant, claims.not_before) == ("acme", claims.issued_at)
    with pytest.raises(AuthError) as err:
        verifier.verify(_mint(ring, nbf=None, iat=int(T0 + 300)))
    assert err.value.reason == "not_yet_valid"
    for missing in ("exp", "iat"):
        with pytest.raises(AuthError) as err:
            verifier.verify(_mint(ring, **{missing: None}))
        assert err.value.reason == "missing_claim", missing


def test_tenant_falls_back_to_sub():
    _, ring, verifier, _ = _setup()
    assert verifier.verify(_mint(ring, tenant=None, sub="globex")).tenant == "globex"


def test_expiry_follows_the_clock():
    clock, _, verifier, token = _setup()
    clock.at = T0 + 600 + 29  # inside the 30 s leeway
    assert verifier.verify(token).tenant == "acme"
    clock.at = T0 + 600 + 31
    with pytest.raises(AuthError, match="expired"):
        verifier.verify(token)


def test_rotated_key_works_through_overlap_and_fails_after():
    clock, ring, verifier, _ = _setup()
    old_kid = ring.keys[-1].kid
    clock.at = T0 + WEEK_S - 60
    old_token = mint_token(ring, "acme", AUD, ISS, ttl_s=DAY_S)
    assert ring.keys[-1].kid == old_kid  # not due yet
    clock.at = T0 + WEEK_S
    new_token = mint_token(ring, "acme", AUD, ISS, ttl_s=600)
    assert ring.keys[-1].kid != old_kid and len(ring.keys) == 2
    verifier.update_jwks(ring.public_jwks())
    assert verifier.verify(old_token).kid == old_kid
    assert verifier.verify(new_token).tenant == "acme"
    clock.at = T0 + WEEK_S + DAY_S - 120  # still inside the overlap, old token still unexpired
    assert verifier.verify(old_token).kid == old_kid
    clock.at = T0 + WEEK_S + DAY_S + 60  # overlap over: a stale JWKS still refuses the old key
    with pytest.raises(AuthError) as err:
        verifier.verify(old_token)
    assert err.value.reason == "key_retired"
    verifier.update_jwks(ring.public_jwks())  # and a fresh JWKS no longer lists it at all
    assert [k["kid"] for k in ring.public_jwks()["keys"]] == [ring.keys[-1].kid]
    with pytest.raises(AuthError) as err:
        verifier.verify(old_token)
    assert err.value.reason == "unknown_kid"


def test_ring_persists_and_public_jwks_has_no_private_parts(tmp_path):
    clock, ring, verifier, token = _setup("ES256")
    path = tmp_path / "ring.json"
    ring.save(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    again = KeyRing.load(path, clock=clock)
    assert [k.kid for k in again.keys] == [k.kid for k in ring.keys]
    token2 = mint_token(again, "acme", AUD, ISS, ttl_s=60)
    assert verifier.verify(token2).kid == ring.keys[-1].kid
    assert all("d" not in k for k in ring.public_jwks()["keys"])


@pytest.mark.parametrize("kwargs", [
    {"algorithms": ["none"]},
    {"algorithms": []},
    {"algorithms": ["HS512"]},
])
def test_verifier_refuses_bad_configuration(kwargs):
    with pytest.raises(ValueError, match="algorithms must be a non-empty subset"):
        TokenVerifier({"keys": []}, audience=AUD, issuer=ISS, **kwargs)


@pytest.mark.parametrize("ttl", [0, -1, DAY_S + 1])
def test_mint_refuses_ttl_outside_overlap(ttl):
    with pytest.raises(ValueError, match="ttl_s must be in"):
        mint_token(KeyRing(clock=lambda: T0), "acme", AUD, ISS, ttl_s=ttl)


def test_load_refuses_garbage():
    with pytest.raises(ValueError, match="not a key ring document"):
        KeyRing.from_json('{"keys": 3}')


def test_a_verifier_reading_the_key_set_while_it_is_rewritten_never_sees_half_a_file(tmp_path) -> None:
    # `fleetpilot up` rewrites jwks.json each time it mints a demo token, while the SLA
    # service may be reading it at start: an empty read crashed the service at random.
    path = tmp_path / "jwks.json"
    ring = KeyRing()
    ring.signing_key()
    jwks = ring.public_jwks()
    save_jwks(jwks, path)
    bad: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                load_jwks(path)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                bad.append(str(exc))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(2000):
            save_jwks(jwks, path)
    finally:
        done.set()
        reader.join()
    assert bad == []
    assert load_jwks(path) == jwks and [p.name for p in tmp_path.iterdir()] == ["jwks.json"]


@pytest.mark.parametrize("kid", [123, ["k"], {"k": 1}, None], ids=["int", "list", "object", "null"])
def test_a_header_kid_that_is_no_string_is_malformed_not_a_crash(kid):
    # pyjwt's header parser raises InvalidTokenError (not DecodeError) for such a kid; it
    # escaped verify, so the SLA service retried the submission instead of refusing it.
    _, ring, verifier, token = _setup()
    _, payload, sig = token.split(".")
    with pytest.raises(AuthError) as err:
        verifier.verify(f"{_b64({'alg': 'EdDSA', 'typ': 'JWT', 'kid': kid})}.{payload}.{sig}")
    assert err.value.reason == "malformed", str(err.value)


def test_a_key_the_verifier_cannot_use_is_skipped_and_the_others_still_verify():
    # RFC 7517 section 5: a JWK with missing members or an unsupported curve is ignored,
    # not a reason to refuse the whole set (nor an exception from the reload).
    _, ring, verifier, token = _setup()
    good = ring.public_jwks()["keys"]
    no_x = {**good[0], "kid": "no-x"}
    del no_x["x"]
    wrong_curve = {**good[0], "kid": "x25519", "crv": "X25519"}
    bad_expiry = {**good[0], "kid": "bad-expiry", "valid_until": "soon"}
    verifier.update_jwks({"keys": [no_x, wrong_curve, bad_expiry, "not-an-object", *good]})
    assert verifier.verify(token).tenant == "acme"
    for kid in ("no-x", "x25519", "bad-expiry"):
        _, payload, sig = token.split(".")
        with pytest.raises(AuthError) as err:
            verifier.verify(f"{_b64({'alg': 'EdDSA', 'typ': 'JWT', 'kid': kid})}.{payload}.{sig}")
        assert err.value.reason == "unknown_kid"


@pytest.mark.parametrize("doc", [[], {"keys": 3}, {"keys": {"kid": "k"}}, "keys"])
def test_a_document_that_is_no_key_set_is_a_value_error_and_the_keys_stay(doc):
    _, _, verifier, token = _setup()
    with pytest.raises(ValueError, match="not a JWKS"):
        verifier.update_jwks(doc)
    assert verifier.verify(token).tenant == "acme"


def _with_header(token: str, header: dict) -> str:
    _, payload, sig = token.split(".")
    return f"{_b64(header)}.{payload}.{sig}"


@pytest.mark.parametrize("header", [
    {"alg": "EdDSA\nWARNING forged log line", "typ": "JWT"},
    {"alg": "EdDSA", "typ": "JWT", "kid": "k" * 100_000},
    {"alg": "EdDSA", "typ": "JWT", "crit": ["x\r\nforged " * 20_000]},
], ids=["alg-with-newline", "kid-of-100k", "crit-with-newline-and-huge"])
def test_a_refusal_shows_what_the_sender_wrote_in_one_short_line(header):
    # The header is read before any signature check, and alg (and pyjwt's messages, e.g. the
    # name of a critical extension) went into the message verbatim: a newline forged lines
    # in the SLA service's log and a 100 kB kid came back in the rejection event.
    _, ring, verifier, token = _setup()
    with pytest.raises(AuthError) as err:
        verifier.verify(_with_header(token, header))
    message = str(err.value)
    assert "\n" not in message and "\r" not in message and len(message) <= 300, message[:300]
    assert err.value.detail in message


def test_a_tenant_claim_of_the_wrong_type_is_refused_not_replaced_by_sub():
    # A list tenant was skipped and `sub` (a user) taken as the tenant instead.
    _, ring, verifier, _ = _setup()
    with pytest.raises(AuthError) as err:
        verifier.verify(_mint(ring, tenant=["globex"], sub="alice"))
    assert err.value.reason == "malformed", str(err.value)


@pytest.mark.parametrize("tenant", [["globex"], 123, {"t": 1}], ids=["list", "int", "object"])
def test_mint_refuses_a_tenant_that_is_no_string(tenant):
    # mint_token checked only `not tenant`: a list was minted, and verified as the subject.
    with pytest.raises(ValueError, match="tenant must be a non-empty string"):
        mint_token(KeyRing(clock=lambda: T0), tenant, AUD, ISS, ttl_s=600, subject="alice")


@pytest.mark.parametrize("alg", ["EdDSA", "ES256", "RS256", "HS256"])
def test_a_key_set_whose_keys_name_no_alg_still_verifies(alg):
    # "alg" is optional in a JWK (RFC 7517 section 4.4) and identity providers often leave it
    # out: every such key was skipped, and every token refused as unknown_kid. The algorithm
    # follows from the key type here (one supported algorithm per type); the header must still
    # name that one (no HS/RS confusion).
    _, ring, verifier, token = _setup(alg)
    verifier.update_jwks({"keys": [{k: v for k, v in jwk.items() if k != "alg"}
                                   for jwk in ring.public_jwks()["keys"]]})
    assert verifier.verify(token).tenant == "acme"


def test_a_key_meant_for_encryption_verifies_no_signature():
    # RFC 7517 section 4.2: a key published with "use": "enc" is not a signing key.
    _, ring, verifier, token = _setup()
    verifier.update_jwks({"keys": [{**jwk, "use": "enc"} for jwk in ring.public_jwks()["keys"]]})
    with pytest.raises(AuthError) as err:
        verifier.verify(token)
    assert err.value.reason == "unknown_kid", str(err.value)


def test_a_key_set_without_alg_gives_no_hmac_confusion():
    # An RSA key without "alg" is an RS256 key: a token saying HS256 with the public key as
    # the secret is refused, with HS256 allowed too.
    clock = FakeClock()
    ring = KeyRing("RS256", clock=clock)
    ring.signing_key()
    jwks = {"keys": [{k: v for k, v in jwk.items() if k != "alg"} for jwk in ring.public_jwks()["keys"]]}
    verifier = TokenVerifier(jwks, audience=AUD, issuer=ISS, algorithms=["RS256", "HS256"], clock=clock)
    with pytest.raises(AuthError) as err:
        verifier.verify(_hs256_with_public_key(mint_token(ring, "acme", AUD, ISS, ttl_s=600), ring))
    assert err.value.reason == "alg_not_allowed", str(err.value)
