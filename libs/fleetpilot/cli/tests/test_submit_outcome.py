"""``fleetpilot submit``'s exit code and last word say what became of the task: 0 placed or
queued, 1 rejected, whichever service said it."""

from __future__ import annotations

import argparse
import io

from fleetpilot.cli.submit import submit
from fleetpilot.contracts import DecisionMade, PolicyRef, TaskSubmitted, encode


def _args(nats_url: str, tmp_path, timeout: float) -> argparse.Namespace:
    return argparse.Namespace(token="a-token", tenant="local", state_dir=str(tmp_path), nats_url=nats_url,
                              timeout=timeout, accept_offer=False, decline_offer=False)


async def _decides(nats_client, action: str) -> None:
    """Play the policy: answer the task with one decision of ``action``."""
    async def decide(msg) -> None:
        await nats_client.publish("decision.made", encode(DecisionMade(
            decision_id=f"t1.{action}", task_id="t1", action=action, confidence=0.9,
            policy=PolicyRef(name="one-shot"), reason="no node fits", decided_at=0.0)))

    await nats_client.subscribe("task.submitted", cb=decide)
    await nats_client.flush()


async def test_a_reject_decision_exits_1(nats_client, nats_url, tmp_path) -> None:
    # A profile with ``no_fit_action: reject`` answers with decision.made, not task.rejected:
    # submit printed it and exited 0, as for a task placed.
    await _decides(nats_client, "reject")
    out = io.StringIO()
    assert await submit(TaskSubmitted(task_id="t1", kind="infer"), _args(nats_url, tmp_path, 20.0), out) == 1
    assert '"action": "reject"' in out.getvalue()


async def test_a_task_still_queued_at_the_timeout_is_said_so_and_exits_0(nats_client, nats_url, tmp_path,
                                                                        capsys) -> None:
    # Its queue decision was printed, then "no decision for t1 within 1s" and exit 2, the code
    # of invalid input, for a task the fleet holds and will place when capacity frees up.
    await _decides(nats_client, "queue")
    out = io.StringIO()
    assert await submit(TaskSubmitted(task_id="t1", kind="infer"), _args(nats_url, tmp_path, 1.0), out) == 0
    assert '"action": "queue"' in out.getvalue()
    err = capsys.readouterr().err
    assert "t1 is still queued after 1s" in err and "no decision" not in err


async def test_a_mistyped_answer_at_the_offer_prompt_is_asked_again(monkeypatch) -> None:
    # A typo ended submit with "not an option" and exit 2, the offer unanswered: the SLA service
    # then rejected the task when the offer expired, and the submission was lost to a keystroke.
    import sys  # noqa: PLC0415

    from fleetpilot.cli import submit as submit_cmd  # noqa: PLC0415
    from fleetpilot.contracts import OfferOption, SlaOffer, SlaRequest  # noqa: PLC0415

    typed = ["3", "two", "2"]
    prompts: list[str] = []

    async def read_line(prompt: str, out) -> str:
        prompts.append(prompt)
        return typed.pop(0)

    monkeypatch.setattr(submit_cmd, "read_line", read_line)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    offer = SlaOffer(offer_id="o", task_id="t", tenant="local", asked=SlaRequest(), reason="too slow",
                     options=[OfferOption(option_id="o1", why="wait"), OfferOption(option_id="o2", why="A100")],
                     valid_until=0.0, at=0.0)
    out = io.StringIO()
    reply = await submit_cmd.answer_offer(offer, argparse.Namespace(decline_offer=False, accept_offer=False), out)
    assert (reply.accept, reply.option_id) == (True, "o2")
    assert len(prompts) == 3 and not typed
    assert "not an option: '3'" in out.getvalue() and "not an option: 'two'" in out.getvalue()
