"""The key ring file shared by processes, and ring documents that are damaged.

``fleetpilot token``, ``submit`` and ``up`` each read, change and write ``keyring.json``:
several at once interleaved their writes in one fixed temporary file, or lost each other's
new keys (and every token such a key had signed).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import threading
import traceback
from pathlib import Path

import pytest
from fleetpilot import auth
from fleetpilot.auth import DAY_S, AuthError, KeyRing, TokenVerifier, load_jwks, mint_token

AUD, ISS = "fleetpilot", "https://auth.example"
T0 = 1_800_000_000.0
PROCESSES = 6
# fork: the children need no import of this test module by name (spawn would).
FORK = multiprocessing.get_context("fork")


def _report(out: Path, work) -> None:
    """Run ``work()`` in a child; write its result, or its traceback, to ``out`` as JSON."""
    try:
        out.write_text(json.dumps({"ok": work()}))
    except BaseException:  # any failure: the parent asserts on what went wrong
        out.write_text(json.dumps({"error": traceback.format_exc()}))


def _run_children(target, tmp_path: Path, *args) -> list:
    """Start PROCESSES children running ``target(index, out, *args)``; their results, in order."""
    outs = [tmp_path / f"child-{i}.json" for i in range(PROCESSES)]
    children = [FORK.Process(target=target, args=(i, outs[i], *args)) for i in range(PROCESSES)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0, f"child exited with {child.exitcode}"
    results = [json.loads(out.read_text()) for out in outs]
    errors = [r["error"] for r in results if "error" in r]
    assert errors == [], errors[0] if errors else ""
    return [r["ok"] for r in results]


def _load_rotate_save(index: int, out: Path, path: Path, loaded, rotated) -> None:
    def work() -> str:
        ring = KeyRing.load(path)
        loaded.wait(30)  # every child has read the same ring before any writes
        kid = ring.rotate().kid
        rotated.wait(30)  # and every child has rotated before any saves
        ring.save(path)
        return kid

    _report(out, work)


def test_processes_that_each_load_rotate_and_save_keep_every_new_key(tmp_path) -> None:
    # Last writer won: of six rotations made at once, one key survived in the file, and
    # tokens signed by the five others were refused as unknown_kid. Or a writer found the
    # shared keyring.json.tmp renamed away by another ("no such file").
    path = tmp_path / "keyring.json"
    first = KeyRing()
    first.signing_key()
    first.save(path)
    kids = _run_children(_load_rotate_save, tmp_path, path, FORK.Barrier(PROCESSES), FORK.Barrier(PROCESSES))
    ring = KeyRing.load(path)  # parses: no interleaved writes
    on_file = [k.kid for k in ring.keys]
    assert set(kids) <= set(on_file), f"lost {set(kids) - set(on_file)}"
    # One key signs; each superseded one stays valid for the overlap, as on any rotation.
    current = [k for k in ring.keys if k.valid_until is None]
    assert len(current) == 1
    assert all(k.valid_until >= k.created_at + DAY_S for k in ring.keys if k.valid_until is not None)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _edit_rotate_mint(index: int, out: Path, path: Path, jwks: Path, start) -> None:
    def work() -> list[str]:
        start.wait(30)
        tokens = []
        for _ in range(10):
            with auth.edit_keyring(path, jwks_path=jwks) as ring:
                ring.rotate()
                tokens.append(mint_token(ring, f"tenant-{index}", AUD, ISS, ttl_s=600))
        return tokens

    _report(out, work)


def test_edit_keyring_from_many_processes_loses_no_rotation_and_publishes_every_key(tmp_path) -> None:
    path, jwks = tmp_path / "keyring.json", tmp_path / "jwks.json"
    tokens = [t for batch in _run_children(_edit_rotate_mint, tmp_path, path, jwks, FORK.Barrier(PROCESSES))
              for t in batch]
    ring = KeyRing.load(path)
    assert len(ring.keys) == PROCESSES * 10  # one per rotation: none lost, none extra
    verifier = TokenVerifier(load_jwks(jwks), audience=AUD, issuer=ISS)
    refused = []
    for token in tokens:
        try:
            verifier.verify(token)
        except AuthError as exc:
            refused.append(str(exc))
    assert refused == []
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_block_that_raises_writes_nothing(tmp_path) -> None:
    path, jwks = tmp_path / "keyring.json", tmp_path / "jwks.json"
    with auth.edit_keyring(path, jwks_path=jwks):
        pass
    before = path.read_bytes(), jwks.read_bytes()
    with pytest.raises(RuntimeError), auth.edit_keyring(path, jwks_path=jwks) as ring:
        ring.rotate()
        raise RuntimeError("the command was refused")
    assert (path.read_bytes(), jwks.read_bytes()) == before


def test_edit_keyring_names_the_file_it_cannot_read(tmp_path) -> None:
    path = tmp_path / "keyring.json"
    path.write_text('{"keys": [')
    with pytest.raises(ValueError, match=f"^{path}: not a key ring document"), auth.edit_keyring(path):
        pass


def test_save_keeps_a_key_it_dropped_dropped(tmp_path) -> None:
    # Taking in keys another writer added must not bring back one this ring retired.
    clock = [T0]
    path = tmp_path / "keyring.json"
    ring = KeyRing(clock=lambda: clock[0])
    old = ring.signing_key()
    ring.rotate()
    ring.save(path)
    again = KeyRing.load(path, clock=lambda: clock[0])
    clock[0] = T0 + DAY_S + 1  # the old key's overlap is over
    again.rotate()
    again.save(path)
    assert old.kid not in [k.kid for k in KeyRing.load(path, clock=lambda: clock[0]).keys]


def test_a_stale_temporary_file_of_a_wider_mode_does_not_expose_the_private_keys(tmp_path) -> None:
    # The fixed temporary name was opened without O_EXCL: a leftover file kept its mode
    # through O_CREAT, and the rename published the private keys readable by all.
    path = tmp_path / "keyring.json"
    stale = tmp_path / "keyring.json.tmp"
    stale.write_text("")
    os.chmod(stale, 0o644)
    ring = KeyRing()
    ring.signing_key()
    ring.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def _ring_document(**key_fields) -> str:
    ring = KeyRing(clock=lambda: T0)
    ring.signing_key()
    doc = json.loads(ring.to_json())
    doc["keys"][0].update(key_fields)
    return json.dumps(doc)


def _without_d() -> dict:
    ring = KeyRing(clock=lambda: T0)
    jwk = dict(ring.signing_key().private_jwk)
    del jwk["d"]
    return jwk


DAMAGED = {
    "created_at is text": _ring_document(created_at="yesterday"),
    "valid_until is text": _ring_document(valid_until="soon"),
    "private key cut short": _ring_document(private_jwk=_without_d()),
    "private key empty": _ring_document(private_jwk={}),
    "private key is text": _ring_document(private_jwk="x"),
    "alg none": _ring_document(alg="none"),
    "kid no string": _ring_document(kid=5),
    "key no object": json.dumps({"algorithm": "EdDSA", "rotation_s": 7 * DAY_S, "overlap_s": DAY_S, "keys": [1]}),
    "overlap NaN": _ring_document().replace(f'"overlap_s": {DAY_S}', '"overlap_s": NaN'),
    # An integer too large for a float: math.isfinite raised OverflowError, a traceback.
    "created_at too large": _ring_document().replace(f'"created_at": {T0}', '"created_at": 1' + "0" * 400),
    "rotation too large": _ring_document().replace(f'"rotation_s": {7 * DAY_S}', '"rotation_s": 1' + "0" * 400),
    "not an object": "[]",
}


@pytest.mark.parametrize("text", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_ring_document_is_refused_on_load_in_one_line(text) -> None:
    # Loaded as it was, such a ring raised TypeError, AttributeError or InvalidKeyError
    # (a traceback) from the first mint_token, or an overlap of NaN refused every ttl.
    with pytest.raises(ValueError, match="^not a key ring document: ") as err:
        KeyRing.from_json(text)
    assert "\n" not in str(err.value)


def test_a_ring_file_that_is_no_text_is_refused_as_no_ring(tmp_path) -> None:
    path = tmp_path / "keyring.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="^not a key ring document: no UTF-8 text"):
        KeyRing.load(path)


@pytest.mark.parametrize("overlap_s", [float("nan"), float("inf")])
def test_a_ring_refuses_an_overlap_that_is_no_finite_number(overlap_s) -> None:
    with pytest.raises(ValueError, match="need 0 < overlap_s < rotation_s"):
        KeyRing(overlap_s=overlap_s)


def test_save_inside_an_edit_block_does_not_wait_for_itself(tmp_path) -> None:
    # flock is per open file: a second lock taken by the thread that holds the first
    # waited for itself forever. Run in a thread so that a hang fails instead of blocking.
    path = tmp_path / "keyring.json"
    done = threading.Event()

    def edit_and_save() -> None:
        with auth.edit_keyring(path) as ring:
            ring.rotate()
            ring.save(path)
        done.set()

    worker = threading.Thread(target=edit_and_save, daemon=True)
    worker.start()
    worker.join(10)
    assert done.is_set(), "save inside edit_keyring never returned"
    assert len(KeyRing.load(path).keys) == 1
