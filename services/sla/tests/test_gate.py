"""The gate's key set: read when it changes, never missed, never a crash on a bad file."""

from __future__ import annotations

import base64
import json
import os

import pytest
from fleetpilot.auth import AuthError, KeyRing, mint_token, save_jwks
from fleetpilot.auth import keys as auth_keys
from fleetpilot_services.sla import service as sla_service
from fleetpilot_services.sla.service import Gate, SlaSettings, UnreadableKeySet, load_verifier
from prometheus_client import CollectorRegistry, Counter


def _settings(tmp_path) -> SlaSettings:
    return SlaSettings(nats_url="unused", metrics_port=-1, jwks_path=str(tmp_path / "jwks.json"), issuer="iss")


def _counter() -> Counter:
    return Counter("refused", "refused", ["reason"], registry=CollectorRegistry())


def _bearer(ring: KeyRing) -> dict[str, str]:
    return {"Authorization": f"Bearer {mint_token(ring, 'acme', 'fleetpilot', 'iss', ttl_s=600)}"}


def test_a_key_set_rewritten_while_the_gate_starts_is_picked_up(tmp_path, monkeypatch):
    # `fleetpilot up` rewrites jwks.json while the service may be starting: a rewrite that
    # lands between the gate's read and its look at the file must still be read later.
    path = tmp_path / "jwks.json"
    old, new = KeyRing(), KeyRing()
    old.signing_key(), new.signing_key()
    save_jwks(old.public_jwks(), path)
    read = auth_keys.load_jwks

    def read_then_rewritten(p):
        doc = read(p)
        monkeypatch.setattr(sla_service, "load_jwks", read)
        save_jwks(new.public_jwks(), path)  # same size: another Ed25519 key of the same shape
        return doc

    monkeypatch.setattr(sla_service, "load_jwks", read_then_rewritten)
    gate = Gate(_settings(tmp_path), clock=lambda: old.now(), refused=_counter())
    assert gate.claims(_bearer(new)).tenant == "acme"


def test_a_rewrite_of_the_same_size_in_the_same_clock_tick_is_seen(tmp_path, monkeypatch):
    # File systems stamp mtimes with a coarse clock: two rewrites of one size within a tick
    # have the same (mtime, size); save_jwks replaces the file, so its inode tells them apart.
    path = tmp_path / "jwks.json"
    old, new = KeyRing(), KeyRing()
    old.signing_key(), new.signing_key()
    save_jwks(old.public_jwks(), path)
    gate = Gate(_settings(tmp_path), clock=lambda: old.now(), refused=_counter())
    before = path.stat()
    save_jwks(new.public_jwks(), path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    assert gate.claims(_bearer(new)).tenant == "acme"


def test_a_key_set_with_an_unusable_key_keeps_the_gate_working(tmp_path):
    path = tmp_path / "jwks.json"
    ring = KeyRing()
    ring.signing_key()
    save_jwks(ring.public_jwks(), path)
    gate = Gate(_settings(tmp_path), clock=lambda: ring.now(), refused=_counter())
    broken = {**ring.public_jwks()["keys"][0], "kid": "broken", "crv": "X448-unknown"}
    save_jwks({"keys": [broken, *ring.public_jwks()["keys"]]}, path)
    assert gate.claims(_bearer(ring)).tenant == "acme"


def test_a_header_kid_that_is_no_string_is_refused_and_counted(tmp_path):
    ring = KeyRing()
    ring.signing_key()
    save_jwks(ring.public_jwks(), tmp_path / "jwks.json")
    refused = _counter()
    gate = Gate(_settings(tmp_path), clock=lambda: ring.now(), refused=refused)
    token = _bearer(ring)["Authorization"].removeprefix("Bearer ")
    _, payload, sig = token.split(".")
    header = base64.urlsafe_b64encode(json.dumps({"alg": "EdDSA", "kid": 7}).encode()).rstrip(b"=").decode()
    with pytest.raises(AuthError) as err:
        gate.claims({"Authorization": f"Bearer {header}.{payload}.{sig}"})
    assert err.value.reason == "malformed"
    assert refused.labels("malformed")._value.get() == 1


@pytest.mark.parametrize("content", ["[]", '{"keys": 3}', '"keys"'])
def test_json_that_is_no_key_set_is_unreadable(tmp_path, content):
    (tmp_path / "jwks.json").write_text(content)
    with pytest.raises(UnreadableKeySet, match="cannot read the key set"):
        load_verifier(_settings(tmp_path))
