"""``fleetpilot token``: a refused command changes no key, and concurrent ones lose none."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import traceback
from pathlib import Path

import pytest
from fleetpilot.auth import AuthError, KeyRing, TokenVerifier, load_jwks
from fleetpilot.cli.local import AUDIENCE, ISSUER
from fleetpilot.cli.main import main

PROCESSES = 4
ROUNDS = 15
FORK = multiprocessing.get_context("fork")  # the children need no import of this module by name


def one_line_error(argv: list[str], capsys) -> str:
    """Run ``fleetpilot ARGV`` in-process; assert exit 2 with one stderr line; return it."""
    try:
        rc = main(argv)
    except SystemExit as exit_:  # the parser's refusals
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def token(argv: list[str]) -> str:
    """The token ``fleetpilot token ARGV`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["token", *argv]) == 0
    return out.getvalue().strip()


@pytest.fixture
def minted_state(tmp_path) -> Path:
    """A state directory whose key ring and key set one token created."""
    token(["--state-dir", str(tmp_path)])
    return tmp_path


def _files(state: Path) -> tuple[bytes, bytes]:
    return (state / "keyring.json").read_bytes(), (state / "jwks.json").read_bytes()


@pytest.mark.parametrize("ttl", ["0", "-5", "nan", "100000"])
def test_a_bad_ttl_names_the_flag_and_rotates_nothing(minted_state, ttl, capsys) -> None:
    # The refusal said "ttl_s must be in (0, 86400]", a name the user never typed, and came
    # from mint_token after --rotate had rotated the key and republished the key set.
    before = _files(minted_state)
    line = one_line_error(["token", "--rotate", "--ttl", ttl, "--state-dir", str(minted_state)], capsys)
    assert "--ttl" in line and "ttl_s" not in line, line
    assert _files(minted_state) == before


def test_an_empty_tenant_rotates_nothing(minted_state, capsys) -> None:
    before = _files(minted_state)
    line = one_line_error(["token", "--rotate", "--tenant", "", "--state-dir", str(minted_state)], capsys)
    assert "--tenant must not be empty" in line
    assert _files(minted_state) == before


def test_rotate_signs_with_a_new_key_and_the_old_one_still_verifies(minted_state) -> None:
    first = token(["--state-dir", str(minted_state)])
    second = token(["--rotate", "--ttl", "600", "--state-dir", str(minted_state)])
    verifier = TokenVerifier(load_jwks(minted_state / "jwks.json"), audience=AUDIENCE, issuer=ISSUER)
    kids = [verifier.verify(t).kid for t in (first, second)]
    assert kids[0] != kids[1]
    assert verifier.verify(second).expires_at - verifier.verify(second).issued_at == 600


DAMAGED = {
    "cut short": lambda doc: json.dumps(doc)[:80],
    "valid_until is text": lambda doc: json.dumps({**doc, "keys": [{**doc["keys"][0], "valid_until": "soon"}]}),
    "private key is text": lambda doc: json.dumps({**doc, "keys": [{**doc["keys"][0], "private_jwk": "x"}]}),
    "kid no string": lambda doc: json.dumps({**doc, "keys": [{**doc["keys"][0], "kid": 5}]}),
}


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_key_ring_is_one_line_naming_the_file(minted_state, damage, capsys) -> None:
    # A ring that parsed but held a key of the wrong shape raised a traceback from jwt.
    path = minted_state / "keyring.json"
    path.write_text(damage(json.loads(path.read_text())))
    line = one_line_error(["token", "--state-dir", str(minted_state)], capsys)
    assert f"{path}: not a key ring document" in line, line


def _mint_in_rounds(state: Path, start, out: Path) -> None:
    try:
        start.wait(30)
        minted = [token(["--rotate", "--ttl", "600", "--state-dir", str(state)]) for _ in range(ROUNDS)]
        out.write_text(json.dumps({"tokens": minted}))
    except BaseException:  # any failure: the parent asserts on what went wrong
        out.write_text(json.dumps({"error": traceback.format_exc()}))


def test_concurrent_rotations_lose_no_key_and_every_token_verifies(tmp_path) -> None:
    # Each command read the ring, rotated and wrote it back with nothing held in between,
    # through one fixed temporary file: keys were lost (last writer won), and the tokens
    # they signed were refused by the SLA service as unknown_kid.
    state = tmp_path / "state"
    start = FORK.Barrier(PROCESSES)
    outs = [tmp_path / f"child-{i}.json" for i in range(PROCESSES)]
    children = [FORK.Process(target=_mint_in_rounds, args=(state, start, out)) for out in outs]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    results = [json.loads(out.read_text()) for out in outs]
    errors = [r["error"] for r in results if "error" in r]
    assert errors == [], errors[0] if errors else ""
    tokens = [t for r in results for t in r["tokens"]]
    verifier = TokenVerifier(load_jwks(state / "jwks.json"), audience=AUDIENCE, issuer=ISSUER)
    refused = []
    for minted in tokens:
        try:
            verifier.verify(minted)
        except AuthError as exc:
            refused.append(str(exc))
    assert refused == [], f"{len(refused)} of {len(tokens)} refused: {refused[0]}"
    ring = KeyRing.load(state / "keyring.json")
    assert len(ring.keys) == PROCESSES * ROUNDS  # one per --rotate: none lost (the first made the ring)
