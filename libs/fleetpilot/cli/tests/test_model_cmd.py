"""``fleetpilot model`` over a real nats-server: the models the learner stored, with what it said of them."""

from __future__ import annotations

import asyncio
import io
import json
from types import SimpleNamespace

import msgspec
import numpy as np
from fleetpilot.cli.main import main as cli_main
from fleetpilot.cli.model_cmd import main
from fleetpilot.contracts import HeldOutFigures, ModelPublished, encode
from fleetpilot.learner import CANDIDATE_KEY, PROMOTED_KEY, OutcomeFeatures, train


def a_model() -> bytes:
    layout = OutcomeFeatures.for_models({"H100", "A100-40GB"})
    x = np.zeros((4, layout.width()))
    return msgspec.json.encode(train(layout, x, np.ones(4), np.ones(4), epochs=0))


async def announce(js, name: str, version: int, promoted: bool, brier: float) -> None:
    figures = HeldOutFigures(examples=400, held_out=100, brier_model=brier, brier_prior=0.04, mean_predicted=0.97,
                             mean_prior=0.93, observed=0.98)
    event = ModelPublished(name=name, version=version, figures=figures, promoted=promoted,
                           reason=f"reason of {name} v{version}", published_at=1_764_639_600.0)
    await js.publish("model.published", encode(event), headers={"Nats-Msg-Id": f"model:{name}:{version}"})


def show(nats_url: str, *, as_json: bool = False) -> str:
    out = io.StringIO()
    assert main(SimpleNamespace(nats_url=nats_url, state_dir=None, json=as_json), out=out) == 0
    return out.getvalue()


async def test_the_promoted_model_and_the_candidate_with_their_own_figures(nats_client, nats_url):
    js = nats_client.jetstream()
    kv = await js.key_value("models")
    first = await kv.put(PROMOTED_KEY, a_model())
    await announce(js, PROMOTED_KEY, first, True, 0.02)
    later = await kv.put(CANDIDATE_KEY, a_model())
    await announce(js, CANDIDATE_KEY, later, False, 0.05)
    text = await asyncio.to_thread(show, nats_url)
    lines = text.splitlines()
    assert lines[0] == f"outcome (what the policies use): version {first}, published 2025-12-02 01:40:00 UTC"
    assert lines[1] == "  23 inputs; GPU models it knows: A100-40GB, H100"
    assert lines[2].startswith("  learnt from 400 judged placements; on the latest 100, which it was not trained on: "
                               "Brier 0.0200 against the policy's 0.0400")
    assert lines[3] == f"  promoted: reason of outcome v{first}"
    assert lines[4].startswith(f"outcome-candidate (the latest model not promoted): version {later}")
    assert lines[7] == f"  not promoted: reason of outcome-candidate v{later}"


async def test_without_a_promoted_model_it_says_the_policies_use_their_own(nats_client, nats_url):
    js = nats_client.jetstream()
    kv = await js.key_value("models")
    await kv.put(PROMOTED_KEY, b'{"not": "a model"}')
    rows = json.loads(await asyncio.to_thread(show, nats_url, as_json=True))["models"]
    assert [r["key"] for r in rows] == [PROMOTED_KEY]
    assert rows[0]["error"].startswith("unreadable: ")
    await kv.delete(PROMOTED_KEY)
    text = await asyncio.to_thread(show, nats_url)
    assert text == "no promoted outcome model: the policies publish their own confidence\n"


async def test_a_withdrawn_model_is_said_to_be_why_none_is_promoted(nats_client, nats_url):
    js = nats_client.jetstream()
    kv = await js.key_value("models")
    version = await kv.put(PROMOTED_KEY, a_model())
    await announce(js, PROMOTED_KEY, version, True, 0.02)
    await kv.delete(PROMOTED_KEY)
    figures = HeldOutFigures(examples=500, held_out=125, brier_model=0.05, brier_prior=0.04, mean_predicted=0.9,
                             mean_prior=0.93, observed=0.93)
    gone = ModelPublished(name=PROMOTED_KEY, version=version, figures=figures, promoted=False,
                          reason="no better than the policy", published_at=1_764_639_600.0, withdrawn=True)
    await js.publish("model.published", encode(gone), headers={"Nats-Msg-Id": f"withdrawn:{version}"})
    text = await asyncio.to_thread(show, nats_url)
    assert text.splitlines() == ["no promoted outcome model: the policies publish their own confidence",
                                 f"  version {version} was withdrawn (2025-12-02 01:40:00 UTC): no better than the policy"]


def test_no_server_is_one_line(capsys):
    assert cli_main(["model", "--nats-url", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fleetpilot model: cannot connect to NATS at nats://127.0.0.1:1")


def test_a_time_no_calendar_holds_is_shown_not_a_traceback():
    # One event's published_at out of range (a producer's garbage, or milliseconds past
    # year 9999) ended the text report with OverflowError / ValueError.
    from fleetpilot.cli.model_cmd import render  # noqa: PLC0415

    figures = msgspec.to_builtins(HeldOutFigures(examples=4, held_out=1, brier_model=0.1, brier_prior=0.2,
                                                 mean_predicted=0.5, mean_prior=0.5, observed=0.5))
    for at in (1e20, 1.7e15):
        out = io.StringIO()
        rows = [{"key": PROMOTED_KEY, "role": "what the policies use", "version": 3, "inputs": 5, "gpu_models": [],
                 "figures": figures, "published_at": at, "promoted": True, "reason": "better"}]
        render(rows, out, {"version": 2, "published_at": at, "reason": "worse"})
        assert f"version 3, published at {at:g} (not a time)" in out.getvalue()
