"""Signing keys that rotate: a ring of keys chosen by ``kid``, each retired after an overlap.

The newest key signs. Every ``rotation_s`` (7 days) a new key takes over; the one it
supersedes stays in the published JWKS, marked ``valid_until`` = supersession +
``overlap_s``, so tokens it signed just before rotation keep verifying until they expire.
Token lifetimes are capped at the overlap, which is what makes that enough.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, HMACAlgorithm, OKPAlgorithm, RSAAlgorithm

Clock = Callable[[], float]

WEEK_S = 7 * 24 * 3600.0
DAY_S = 24 * 3600.0
SUPPORTED_ALGORITHMS = ("EdDSA", "ES256", "RS256", "HS256")


@dataclass(frozen=True)
class SigningKey:
    """One key of the ring: its private JWK (for signing) and lifetime on the ring's clock."""

    kid: str
    alg: str
    private_jwk: dict[str, Any]
    created_at: float
    valid_until: float | None = None

    def public_jwk(self) -> dict[str, Any]:
        """The JWK a verifier needs: public members only (for HS256, the shared secret)."""
        private_members = {"d", "p", "q", "dp", "dq", "qi", "oth"}
        jwk = {k: v for k, v in self.private_jwk.items() if k not in private_members}
        jwk.update({"kid": self.kid, "alg": self.alg, "use": "sig"})
        if self.valid_until is not None:
            jwk["valid_until"] = self.valid_until
        return jwk


def generate_jwk(alg: str) -> dict[str, Any]:
    """A fresh private JWK for ``alg`` (Ed25519, P-256, RSA-2048 or a 256-bit secret)."""
    if alg == "EdDSA":
        return OKPAlgorithm.to_jwk(ed25519.Ed25519PrivateKey.generate(), as_dict=True)
    if alg == "ES256":
        return ECAlgorithm.to_jwk(ec.generate_private_key(ec.SECP256R1()), as_dict=True)
    if alg == "RS256":
        return RSAAlgorithm.to_jwk(rsa.generate_private_key(public_exponent=65537, key_size=2048), as_dict=True)
    if alg == "HS256":
        return HMACAlgorithm.to_jwk(secrets.token_bytes(32), as_dict=True)
    raise ValueError(f"unsupported algorithm {alg!r}; choose one of {', '.join(SUPPORTED_ALGORITHMS)}")


class KeyRing:
    """The issuer's keys: generate, rotate on schedule, publish a JWKS, persist as JSON.

    ``clock`` (seconds, default ``time.time``) is injectable so rotation and retirement can
    be tested without waiting a week.
    """

    def __init__(self, algorithm: str = "EdDSA", *, rotation_s: float = WEEK_S, overlap_s: float = DAY_S,
                 clock: Clock = time.time, keys: list[SigningKey] | None = None) -> None:
        """An empty ring (a key is created on first use) or one restored from ``keys``."""
        if algorithm not in SUPPORTED_ALGORITHMS:
            raise ValueError(f"unsupported algorithm {algorithm!r}")
        if overlap_s <= 0 or rotation_s <= overlap_s:
            raise ValueError("need 0 < overlap_s < rotation_s")
        self.algorithm = algorithm
        self.rotation_s = rotation_s
        self.overlap_s = overlap_s
        self._clock = clock
        self._keys: list[SigningKey] = list(keys or [])

    def now(self) -> float:
        """The ring's clock reading (seconds)."""
        return self._clock()

    @property
    def keys(self) -> tuple[SigningKey, ...]:
        """Every key still on the ring, oldest first."""
        return tuple(self._keys)

    def rotate(self) -> SigningKey:
        """Create a new signing key now; the previous one stays valid for ``overlap_s``."""
        now = self._clock()
        if self._keys and self._keys[-1].valid_until is None:
            self._keys[-1] = replace(self._keys[-1], valid_until=now + self.overlap_s)
        key = SigningKey(kid=f"k{int(now)}-{secrets.token_hex(4)}", alg=self.algorithm,
                         private_jwk=generate_jwk(self.algorithm), created_at=now)
        self._keys.append(key)
        self._prune(now)
        return key

    def signing_key(self) -> SigningKey:
        """The key to sign with now, rotating first when none exists or the current one is due."""
        if not self._keys or self._clock() - self._keys[-1].created_at >= self.rotation_s:
            return self.rotate()
        return self._keys[-1]

    def _prune(self, now: float) -> None:
        self._keys = [k for k in self._keys if k.valid_until is None or k.valid_until > now]

    def public_jwks(self) -> dict[str, Any]:
        """The verifier's key set ``{"keys": [...]}``: every key not yet retired, no private parts.

        For HS256 the "public" set necessarily holds the shared secret: treat it as secret.
        """
        now = self._clock()
        return {"keys": [k.public_jwk() for k in self._keys if k.valid_until is None or k.valid_until > now]}

    def to_json(self) -> str:
        """The whole ring, private keys included, as JSON (for the issuer's own storage)."""
        return json.dumps({
            "algorithm": self.algorithm, "rotation_s": self.rotation_s, "overlap_s": self.overlap_s,
            "keys": [{"kid": k.kid, "alg": k.alg, "private_jwk": k.private_jwk, "created_at": k.created_at,
                      "valid_until": k.valid_until} for k in self._keys],
        }, indent=2)

    @classmethod
    def from_json(cls, text: str, *, clock: Clock = time.time) -> KeyRing:
        """A ring restored from :meth:`to_json`; raises ``ValueError`` on a malformed document."""
        try:
            doc = json.loads(text)
            keys = [SigningKey(kid=k["kid"], alg=k["alg"], private_jwk=k["private_jwk"],
                               created_at=float(k["created_at"]), valid_until=k.get("valid_until"))
                    for k in doc["keys"]]
            return cls(doc["algorithm"], rotation_s=float(doc["rotation_s"]), overlap_s=float(doc["overlap_s"]),
                       clock=clock, keys=keys)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a key ring document: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` readable by its owner only (it holds private keys)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, *, clock: Clock = time.time) -> KeyRing:
        """Read a ring written by :meth:`save`."""
        return cls.from_json(Path(path).read_text(), clock=clock)


def save_jwks(jwks: dict[str, Any], path: str | Path) -> None:
    """Write a public JWKS for verifiers, whole or not at all: a verifier that reads it
    while it is rewritten (the SLA service starting, or reloading after a rotation) sees the
    old set or the new one, never an empty or half-written file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    # An HS256 set holds the shared secret that mints any tenant's token: its owner only.
    # Public keys stay readable (umask permitting) by verifiers running as other users.
    shared_secret = any(isinstance(k, dict) and k.get("kty") == "oct" for k in jwks.get("keys", ()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if shared_secret else 0o644)
    if shared_secret:
        os.fchmod(fd, 0o600)  # a leftover temporary file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(jwks, indent=2))
    os.replace(tmp, path)


def load_jwks(path: str | Path) -> dict[str, Any]:
    """Read a JWKS written by :func:`save_jwks`."""
    return json.loads(Path(path).read_text())
