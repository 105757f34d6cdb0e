"""Signing keys that rotate: a ring of keys chosen by ``kid``, each retired after an overlap.

The newest key signs. Every ``rotation_s`` (7 days) a new key takes over; the one it
supersedes stays in the published JWKS, marked ``valid_until`` = supersession +
``overlap_s``, so tokens it signed just before rotation keep verifying until they expire.
Token lifetimes are capped at the overlap, which is what makes that enough.

Several processes share one ring file (``fleetpilot token``, ``submit`` and ``up`` each
mint): every write of it holds an ``flock`` on ``<ring file>.lock`` beside it, and
:func:`edit_keyring` holds that lock from the read to the write, so no rotation is lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from jwt.algorithms import ECAlgorithm, HMACAlgorithm, OKPAlgorithm, RSAAlgorithm

Clock = Callable[[], float]

WEEK_S = 7 * 24 * 3600.0
DAY_S = 24 * 3600.0
SUPPORTED_ALGORITHMS = ("EdDSA", "ES256", "RS256", "HS256")
_SIGNING_KEY_TYPES = (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey, ec.EllipticCurvePrivateKey,
                      rsa.RSAPrivateKey)


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


def _finite_number(value: Any) -> float | None:
    """``value`` as seconds when it is a finite JSON number (no bool, NaN or infinity), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int JSON read from 400 digits: no float holds it
        return None
    return seconds if math.isfinite(seconds) else None


def _key_from_document(entry: Any, index: int) -> SigningKey:
    """One key of a ring document, checked so that a damaged file is refused on load with a
    ``ValueError`` naming the key, not a traceback from ``jwt`` when the key first signs."""
    if not isinstance(entry, dict):
        raise ValueError(f"key {index} is no object")
    kid, alg, jwk = entry.get("kid"), entry.get("alg"), entry.get("private_jwk")
    if not isinstance(kid, str) or not kid:
        raise ValueError(f"key {index} has no kid")
    if alg not in SUPPORTED_ALGORITHMS:
        raise ValueError(f"key {kid} has algorithm {alg!r}, not one of {', '.join(SUPPORTED_ALGORITHMS)}")
    created_at = _finite_number(entry.get("created_at"))
    if created_at is None:
        raise ValueError(f"key {kid}: created_at is no finite number")
    valid_until = entry.get("valid_until")
    if valid_until is not None and _finite_number(valid_until) is None:
        raise ValueError(f"key {kid}: valid_until is no finite number")
    try:
        # A private JWK cut short (no "d") still loads, as a public key that cannot sign.
        key = jwt.PyJWK(jwk, alg).key if isinstance(jwk, dict) else None
    except (jwt.PyJWTError, ValueError, TypeError, KeyError, AttributeError):  # members of the wrong type
        key = None
    if not (isinstance(key, _SIGNING_KEY_TYPES) or (isinstance(key, bytes) and key)):
        raise ValueError(f"key {kid}: private_jwk is no {alg} private key")
    return SigningKey(kid=kid, alg=alg, private_jwk=jwk, created_at=created_at,
                      valid_until=None if valid_until is None else float(valid_until))


_locks_held = threading.local()


@contextlib.contextmanager
def _ring_file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` (created 0600, never removed: removing
    a lock file lets two processes lock two different files) for the ``with`` block.

    The lock is per open file, so threads of one process exclude each other too. A thread
    that holds it already (``ring.save`` inside an :func:`edit_keyring` block) goes on
    without taking it again: a second ``flock`` of its own would wait for itself forever.
    """
    lock_path = path.with_name(path.name + ".lock").absolute()
    held: set[Path] = _locks_held.__dict__.setdefault("paths", set())
    if lock_path in held:
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(lock_path)
        yield
    finally:
        held.discard(lock_path)
        os.close(fd)  # releases the lock


def _write_whole(path: Path, text: str, mode: int, *, durable: bool) -> None:
    """Write ``text`` to ``path`` whole or not at all, as a new file of ``mode`` (umask permitting).

    The temporary file's name is unique to this call: a fixed name let concurrent writers
    interleave their bytes in one file, or rename it from under each other ("no such file").
    ``O_EXCL`` makes it a new file, so a stale file of a wider mode cannot lend its mode.
    ``durable`` syncs the data before the rename: a crash then leaves the old file or the
    new one, never an empty ring (which would lose every private key).
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
        # Written so that NaN fails too: a NaN overlap made every ttl "out of (0, nan]" and
        # a NaN rotation period never rotated.
        if not (math.isfinite(rotation_s) and 0 < overlap_s < rotation_s):
            raise ValueError("need 0 < overlap_s < rotation_s, both finite")
        self.algorithm = algorithm
        self.rotation_s = rotation_s
        self.overlap_s = overlap_s
        self._clock = clock
        self._keys: list[SigningKey] = list(keys or [])
        # Every kid this ring has held: what save() may take from the file is what it never saw.
        self._known_kids = {k.kid for k in self._keys}

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
        self._known_kids.add(key.kid)
        self._prune(now)
        return key

    def signing_key(self) -> SigningKey:
        """The key to sign with now, rotating first when none exists or the current one is due."""
        if not self._keys or self._clock() - self._keys[-1].created_at >= self.rotation_s:
            return self.rotate()
        return self._keys[-1]

    def _prune(self, now: float) -> None:
        self._keys = [k for k in self._keys if k.valid_until is None or k.valid_until > now]

    def _absorb(self, others: Iterable[SigningKey]) -> None:
        """Take in the keys of another copy of this ring (the file, as another process saved it).

        A key this ring never held is added; one it dropped stays dropped. A key both hold
        keeps the later ``valid_until`` of the two, so no token either copy signed with it is
        cut short. Two copies that each rotated leave two current keys: the older one is
        superseded now and, as on any rotation, stays valid for ``overlap_s``.
        """
        now = self._clock()
        merged = {k.kid: k for k in self._keys}
        for other in others:
            ours = merged.get(other.kid)
            if ours is not None:
                ends = [t for t in (ours.valid_until, other.valid_until) if t is not None]
                merged[other.kid] = replace(ours, valid_until=max(ends) if ends else None)
            elif other.kid not in self._known_kids:
                merged[other.kid] = other
        keys = sorted(merged.values(), key=lambda k: (k.created_at, k.kid))
        for i, key in enumerate(keys[:-1]):
            if key.valid_until is None:
                keys[i] = replace(key, valid_until=now + self.overlap_s)
        self._keys = keys
        self._known_kids.update(merged)
        self._prune(now)

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
        """A ring restored from :meth:`to_json`; raises ``ValueError`` (one line) on a malformed
        document: cut JSON, a key with a field missing or of the wrong type, a private key that
        does not load or cannot sign, a kid twice."""
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise ValueError("no JSON object")
            entries = doc.get("keys")
            if not isinstance(entries, list):
                raise ValueError('no list of "keys"')
            keys = [_key_from_document(entry, i) for i, entry in enumerate(entries)]
            kids = [k.kid for k in keys]
            if len(set(kids)) != len(kids):
                raise ValueError("a kid appears twice")
            rotation_s, overlap_s = _finite_number(doc.get("rotation_s")), _finite_number(doc.get("overlap_s"))
            if rotation_s is None or overlap_s is None:
                raise ValueError("rotation_s and overlap_s must be finite numbers")
            return cls(doc.get("algorithm"), rotation_s=rotation_s, overlap_s=overlap_s, clock=clock, keys=keys)
        except ValueError as exc:  # json.JSONDecodeError is one
            raise ValueError(f"not a key ring document: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` readable by its owner only (it holds private keys).

        Under the ring file's lock, keys another process saved there since this ring was
        read are taken in first (see :meth:`_absorb`): two processes that each loaded the
        ring, rotated or created a key and saved no longer lose one of the two keys (and
        whatever it signed). To read, change and write with nothing in between, use
        :func:`edit_keyring`. A file that is no ring document is overwritten.
        """
        path = Path(path)
        with _ring_file_lock(path):
            try:
                on_file = KeyRing.load(path, clock=self._clock)
            except (FileNotFoundError, ValueError):
                on_file = None
            if on_file is not None:
                self._absorb(on_file.keys)
            self._write(path)

    def _write(self, path: Path) -> None:
        """Replace ``path`` with this ring, 0600; the caller holds the ring file's lock."""
        _write_whole(path, self.to_json(), 0o600, durable=True)

    @classmethod
    def load(cls, path: str | Path, *, clock: Clock = time.time) -> KeyRing:
        """Read a ring written by :meth:`save`; ``ValueError`` (one line) when it is none."""
        try:
            text = Path(path).read_text()
        except UnicodeDecodeError as exc:  # a ValueError whose message says nothing of a ring
            raise ValueError(f"not a key ring document: no UTF-8 text (byte {exc.start})") from None
        return cls.from_json(text, clock=clock)


@contextlib.contextmanager
def edit_keyring(path: str | Path, *, jwks_path: str | Path | None = None, algorithm: str = "EdDSA",
                 clock: Clock = time.time) -> Iterator[KeyRing]:
    """The ring at ``path`` (a new ``algorithm`` ring when there is none) for one change
    that no other process interleaves with, written back when the block ends without error::

        with edit_keyring(state / "keyring.json", jwks_path=state / "jwks.json") as ring:
            token = mint_token(ring, "acme", AUD, ISS, ttl_s=3600)

    The ring file's lock is held from the read to the write, so concurrent rotations and
    first uses (every process creating a key for an empty directory) all keep their keys.
    On the way out the ring gets a current key (rotated when due) and is saved 0600, then
    ``jwks_path``, when given, is republished from it under the same lock (a slower process
    can no longer publish an older set over a newer one). A block that raises writes
    nothing. A ring file that cannot be read is a one-line ``ValueError`` naming it.
    """
    path = Path(path)
    with _ring_file_lock(path):
        try:
            ring = KeyRing.load(path, clock=clock)
        except FileNotFoundError:
            ring = KeyRing(algorithm, clock=clock)
        except ValueError as exc:  # the loader does not know which file it read: say it
            raise ValueError(f"{path}: {exc}") from None
        yield ring
        ring.signing_key()
        ring._write(path)
        if jwks_path is not None:
            save_jwks(ring.public_jwks(), jwks_path)


def save_jwks(jwks: dict[str, Any], path: str | Path) -> None:
    """Write a public JWKS for verifiers, whole or not at all: a verifier that reads it
    while it is rewritten (the SLA service starting, or reloading after a rotation) sees the
    old set or the new one, never an empty or half-written file."""
    # An HS256 set holds the shared secret that mints any tenant's token: its owner only.
    # Public keys stay readable (umask permitting) by verifiers running as other users.
    shared_secret = any(isinstance(k, dict) and k.get("kty") == "oct" for k in jwks.get("keys", ()))
    _write_whole(Path(path), json.dumps(jwks, indent=2), 0o600 if shared_secret else 0o644, durable=False)


def load_jwks(path: str | Path) -> dict[str, Any]:
    """Read a JWKS written by :func:`save_jwks`."""
    return json.loads(Path(path).read_text())
