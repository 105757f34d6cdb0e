"""Acceptance check of one GPU node: does Fleetpilot see this node as it really is?

Run on a GPU node with the NVIDIA driver and PyTorch (for the test task), from the
repository root, with Fleetpilot installed (``pip install -e .``)::

    python deploy/gpu-check/node_check.py --out /tmp/gpu-check

It checks, each as one PASS/FAIL line, on the real hardware:

1. ``nvml``: NVML opens and reads every GPU (``fleetpilot probe``'s reading); fields the
   GPU refuses are listed.
2. ``collector``: the collector service, started as its own process against an embedded
   ``nats-server``, publishes ``topology.report.<node>`` and ``telemetry.gpu.<node>``.
3. ``attribution``: a real CUDA task started by the executor's process backend (with
   ``CUDA_VISIBLE_DEVICES`` and ``FLEETPILOT_TASK_ID``) shows up on
   ``telemetry.task.<task>`` under its own id, with the memory PyTorch says it holds
   (plus its CUDA context), while the GPU's utilisation rises.
4. ``fingerprint``: the memory series read off the bus is fingerprinted as growth, with
   a predicted peak close to what the task reached.
5. ``pcie``: while the task copies pinned host memory to its GPU, every reading of the
   telemetry's PCIe rate is that copy rate.
6. ``evict``: SIGTERM with grace ends the task as ``evicted`` and its memory is released.
7. ``oom``: a CUDA out-of-memory ends a task as ``oom_killed``.
8. ``fleet``: the whole fleet of services (``fleetpilot up`` with the collector on NVML and
   the executor on the process backend) takes a CUDA task submitted with ``fleetpilot
   submit``: a decision places it on this node's GPU, the executor runs it there, it
   finishes, the fingerprinter publishes its fingerprint and the feedback service records
   the placement's outcome.
9. ``envelope``: the fingerprinter has written that task's program an envelope (the most it
   held by each twentieth of its declared duration, read off NVML): rising from its first
   level to the 8 GiB it grew to.

Everything read is written to ``OUT/report.json``; the exit code is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
from fleetpilot.cli.probe_cmd import probe
from fleetpilot.contracts import (
    NodeTelemetry,
    Placement,
    TaskSubmitted,
    TaskTelemetry,
    TopologyReport,
    decode,
)
from fleetpilot.executor.process import ProcessBackend
from fleetpilot.fingerprint import ENVELOPE_POINTS, load_stats, task_signature
from fleetpilot.fingerprint.analysis import fingerprint_series
from fleetpilot.fleet.nvml_reader import NvmlReader
from fleetpilot.runtime.embedded import EmbeddedNats
from nats.js.errors import KeyNotFoundError

NODE = "gpu-check"
TASK_SCRIPT = Path(__file__).with_name("growing_task.py")
CONTEXT_ALLOWANCE_MB = 2048.0  # the CUDA context and allocator slack NVML counts on top of PyTorch's pool


class Checks:
    """PASS/FAIL lines and the facts behind them."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}

    def record(self, name: str, ok: bool, summary: str, **facts: Any) -> None:
        """Print one line and keep the facts for the report."""
        self.results[name] = {"ok": bool(ok), "summary": summary, **facts}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {summary}", flush=True)

    @property
    def ok(self) -> bool:
        """True when every recorded check passed."""
        return all(r["ok"] for r in self.results.values())


class BusLog:
    """What the collector put on the bus, as decoded events with their arrival times."""

    def __init__(self) -> None:
        self.gpu: list[NodeTelemetry] = []
        self.tasks: dict[str, list[TaskTelemetry]] = {}
        self.topology: list[TopologyReport] = []
        self.undecodable: list[str] = []

    async def attach(self, nc: Any) -> None:
        """Subscribe to the collector's subjects for this node."""

        async def on_gpu(msg: Any) -> None:
            self._keep(msg, NodeTelemetry, self.gpu.append)

        async def on_task(msg: Any) -> None:
            self._keep(msg, TaskTelemetry, lambda t: self.tasks.setdefault(t.task_id, []).append(t))

        async def on_topology(msg: Any) -> None:
            self._keep(msg, TopologyReport, self.topology.append)

        await nc.subscribe(f"telemetry.gpu.{NODE}", cb=on_gpu)
        await nc.subscribe("telemetry.task.>", cb=on_task)
        await nc.subscribe(f"topology.report.{NODE}", cb=on_topology)

    def _keep(self, msg: Any, event_type: type, keep: Any) -> None:
        try:
            keep(decode(msg.data, event_type))
        except msgspec.DecodeError as exc:
            self.undecodable.append(f"{msg.subject}: {exc}")


async def wait_for(predicate: Any, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(poll_s)
    return bool(predicate())


async def wait_for_end(backend: ProcessBackend, task_id: str, timeout_s: float) -> list[Any]:
    """Lifecycle events of ``task_id`` until one that ends it (or the timeout)."""
    events: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events.extend(e for e in await backend.poll() if e.task_id == task_id)
        if any(e.state not in ("started", "resized") for e in events):
            break
        await asyncio.sleep(0.2)
    return events


def check_nvml(checks: Checks) -> dict[str, Any]:
    """Step 1: read NVML directly, three rounds."""
    reader = NvmlReader(node=NODE)
    try:
        result = probe(reader, samples=3, interval_s=0.5)
    finally:
        reader.close()
    last = result.rounds[-1]
    ok = bool(last) and all(s.memory_total_mb > 0 and s.model for s in last)
    refused = sorted({f for fields in result.unsupported.values() for f in fields})
    checks.record("nvml", ok, f"{len(last)} GPU(s): {', '.join(sorted({s.model for s in last}))}, driver "
                  f"{result.driver_version}, read in {min(result.read_ms):.1f}-{max(result.read_ms):.1f} ms; "
                  f"refused: {', '.join(refused) or 'nothing'}", refused=refused)
    return msgspec.to_builtins(result)


def start_collector(url: str, out: Path, state_dir: Path) -> subprocess.Popen:
    """The collector service as its own process, reading NVML every 0.5 s."""
    env = {**os.environ, "FLEETPILOT_NATS_URL": url, "FLEETPILOT_COLLECTOR_SOURCE": "nvml",
           "FLEETPILOT_COLLECTOR_NODE_NAME": NODE, "FLEETPILOT_COLLECTOR_INTERVAL_S": "0.5",
           "FLEETPILOT_COLLECTOR_METRICS_PORT": "-1", "FLEETPILOT_STATE_DIR": str(state_dir)}
    log = open(out / "collector.log", "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen([sys.executable, "-m", "fleetpilot_services.collector"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def task_series(log: BusLog, task_id: str) -> tuple[list[float], list[float], list[float]]:
    """(time since first sample, memory MB, SM %) of one task as read off the bus."""
    samples = log.tasks.get(task_id, [])
    if not samples:
        return [], [], []
    t0 = samples[0].at
    return ([s.at - t0 for s in samples], [s.memory_used_mb for s in samples],
            [s.utilization_gpu_pct for s in samples])


def task_report(out: Path, task_id: str) -> list[dict[str, Any]]:
    """The JSON lines the test task printed (its own view of its memory)."""
    path = out / "tasks" / f"{task_id}.out"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


async def run_checks(args: argparse.Namespace, checks: Checks) -> dict[str, Any]:
    """Steps 2-6 over an embedded nats-server; returns what was read."""
    out: Path = args.out
    report: dict[str, Any] = {}
    scratch = Path(tempfile.mkdtemp(prefix="fleetpilot-gpu-check-"))
    server = EmbeddedNats(scratch / "nats").start()
    collector = start_collector(server.url, out, scratch / "state")
    nc = await nats.connect(server.url)
    log = BusLog()
    await log.attach(nc)
    backend = ProcessBackend(node=NODE, log_dir=out / "tasks")
    try:
        got = await wait_for(lambda: log.topology and len(log.gpu) >= 3, timeout_s=30)
        gpus = log.gpu[-1].gpus if log.gpu else []
        checks.record("collector", got and not log.undecodable,
                      f"{len(log.topology)} topology report(s), {len(log.gpu)} telemetry message(s) with "
                      f"{len(gpus)} GPU(s) each, {len(log.undecodable)} undecodable",
                      undecodable=log.undecodable[:5])
        if not got:
            return report
        baseline_mb = next(s.memory_used_mb for s in log.gpu[-1].gpus if s.gpu == args.gpu)

        # 3. A real task, attributed by its id, on the GPU it was given.
        grow_id = "gpu-check-grow"
        placement = [Placement(node=NODE, gpu=args.gpu, milli=1000, memory_mb=args.grow_gb * 1024)]
        command = [sys.executable, str(TASK_SCRIPT), "--grow-gb", str(args.grow_gb), "--step-s", str(args.step_s),
                   "--pcie-s", "3", "--hold-s", "120"]
        await backend.start(grow_id, placement, command, {})
        target_mb = args.grow_gb * 1024
        grown = await wait_for(lambda: any(t.memory_used_mb >= target_mb for t in log.tasks.get(grow_id, []))
                               or grow_id not in backend.running(), timeout_s=args.grow_gb * args.step_s + 60)
        grown = grown and grow_id in backend.running()
        await asyncio.sleep(2.0)  # a few samples of the held level
        own = [r for r in task_report(out, grow_id) if "reserved_mb" in r]
        t, mem, sm = task_series(log, grow_id)
        busy = [s for s in log.gpu if s.at >= (log.tasks[grow_id][0].at if t else 0)]
        util = max((g.utilization_gpu_pct for s in busy for g in s.gpus if g.gpu == args.gpu), default=0.0)
        held = mem[-1] if mem else 0.0
        torch_mb = own[-1]["reserved_mb"] if own else 0.0
        gpu_ids = sorted({g for s in log.tasks.get(grow_id, []) for g in s.gpus})
        attributed = grown and torch_mb > 0 and torch_mb <= held <= torch_mb + CONTEXT_ALLOWANCE_MB
        checks.record("attribution", attributed and util > 0,
                      f"{len(mem)} samples of {grow_id} on GPU {gpu_ids}: NVML {held:.0f} MB vs PyTorch "
                      f"{torch_mb:.0f} MB reserved (+{held - torch_mb:.0f} MB context); GPU utilisation up to "
                      f"{util:.0f}%, task SM up to {max(sm, default=0):.0f}%",
                      nvml_mb=held, torch_reserved_mb=torch_mb, max_gpu_util_pct=util, gpus=gpu_ids)
        report["task_series"] = {"t_s": t, "memory_mb": mem, "sm_pct": sm, "task_view": own}

        # 4. The series off the bus, fingerprinted as the fingerprinter would: while the task
        # grows (its rate against the one it logged itself), and once it holds (its peak).
        peak_at = next((i for i, m in enumerate(mem) if m >= held), len(mem))
        true_rate = ((own[-1]["reserved_mb"] - own[0]["reserved_mb"]) / (own[-1]["t"] - own[0]["t"])
                     if len(own) >= 2 else 0.0)
        if peak_at >= 5 and len(mem) > peak_at:
            growing = fingerprint_series(t[:peak_at], mem[:peak_at], signature=grow_id)
            whole = fingerprint_series(t, mem, signature=grow_id)
            rate_ok = growing.pattern in ("linear", "steps", "leak") and \
                abs(growing.growth_rate_mb_per_s - true_rate) <= 0.25 * true_rate
            peak_ok = abs(whole.predicted_peak_mb - held) <= 0.1 * held
            checks.record("fingerprint", rate_ok and peak_ok,
                          f"growing ({peak_at} samples): {growing.pattern} ({growing.pattern_confidence:.2f}) at "
                          f"{growing.growth_rate_mb_per_s:.0f} MB/s, the task logged {true_rate:.0f} MB/s; "
                          f"whole series: {whole.pattern} after {whole.warmup_s:.1f} s warm-up, predicted peak "
                          f"{whole.predicted_peak_mb:.0f} MB [{whole.peak_low_mb:.0f}, {whole.peak_high_mb:.0f}] "
                          f"vs held {held:.0f} MB",
                          growing=msgspec.to_builtins(growing), whole=msgspec.to_builtins(whole),
                          logged_rate_mb_per_s=true_rate)
        else:
            checks.record("fingerprint", False, f"{len(mem)} samples of {grow_id}, growing for {peak_at}: too few")

        # 5. PCIe traffic as the telemetry saw it (before the eviction ends the task).
        copied = await wait_for(lambda: any("pcie_copy_mb_per_s" in r for r in task_report(out, grow_id))
                                or grow_id not in backend.running(), timeout_s=20)
        phase = next((r for r in task_report(out, grow_id) if "pcie_copy_mb_per_s" in r), None)
        if copied and phase is not None:
            await asyncio.sleep(1.0)  # the reading that closes the copy phase
            inside = [g for s in log.gpu if phase["pcie_from"] + 0.6 <= s.at <= phase["pcie_to"]
                      for g in s.gpus if g.gpu == args.gpu]
            # Every reading inside the copy, not only the best: NVML's byte counters wrap
            # (32-bit on an H200, every 78 ms of such a copy), and a rate made of one wrapped
            # count read as 7.6 GB/s between readings of 58.
            seen = [max(g.pcie_rx_kbps, g.pcie_tx_kbps) / 1024.0 for g in inside]
            rate = phase["pcie_copy_mb_per_s"]
            low, high = (min(seen), max(seen)) if seen else (0.0, 0.0)
            checks.record("pcie", bool(inside) and 0.5 * rate <= low and high <= 1.5 * rate,
                          f"copy at {rate:.0f} MB/s (the task's clock), telemetry {low:.0f} to {high:.0f} MB/s over "
                          f"{len(inside)} reading(s) inside the copy", copy_mb_per_s=rate, telemetry_mb_per_s=seen)
        else:
            checks.record("pcie", False, "the task did not report its copy phase")

        # 6. Evict with grace: SIGTERM, the task exits by itself, its memory comes back.
        began = time.monotonic()
        await backend.stop(grow_id, grace_s=10.0)
        stop_s = time.monotonic() - began
        events = await wait_for_end(backend, grow_id, timeout_s=5)
        freed_at = len(log.gpu)
        freed = await wait_for(lambda: any(g.gpu == args.gpu and g.memory_used_mb <= baseline_mb + 256
                                           for s in log.gpu[freed_at:] for g in s.gpus), timeout_s=15)
        states = [e.state for e in events]
        checks.record("evict", "evicted" in states and freed,
                      f"lifecycle {states}, stopped in {stop_s:.1f} s, GPU memory back to baseline "
                      f"({baseline_mb:.0f} MB): {freed}", lifecycle=states, stop_s=stop_s)

        # 7. A CUDA out-of-memory is reported as one.
        oom_id = "gpu-check-oom"
        await backend.start(oom_id, placement, [sys.executable, str(TASK_SCRIPT), "--oom"], {})
        events = await wait_for_end(backend, oom_id, timeout_s=60)
        ending = [e for e in events if e.state != "started"]
        checks.record("oom", bool(ending) and ending[0].state == "oom_killed",
                      f"lifecycle {[e.state for e in events]}: {ending[0].detail if ending else 'no end seen'}",
                      lifecycle=[msgspec.to_builtins(e) for e in events])
        report["gpu_telemetry"] = [msgspec.to_builtins(s) for s in log.gpu]
        report["topology_report"] = msgspec.to_builtins(log.topology[-1])
        return report
    finally:
        await backend.shutdown(grace_s=2.0)
        await nc.drain()
        collector.terminate()
        try:
            rc = collector.wait(10)
        except subprocess.TimeoutExpired:
            collector.kill()
            rc = collector.wait()
        report["collector_exit_code"] = rc
        server.stop()


FLEET_TASK = "gpu-check-fleet"
FLEET_GROW_GB = 8  # what the fleet task grows to, a GiB a second


async def check_fleet(args: argparse.Namespace, checks: Checks) -> dict[str, Any]:
    """Steps 8 and 9: ``fleetpilot up`` on this node, one real task through the whole loop,
    and the envelope its program was given."""
    out: Path = args.out
    scratch = Path(tempfile.mkdtemp(prefix="fleetpilot-gpu-fleet-"))
    env = {**os.environ, "FLEETPILOT_COLLECTOR_SOURCE": "nvml", "FLEETPILOT_EXECUTOR_BACKEND": "process"}
    up = subprocess.Popen([sys.executable, "-m", "fleetpilot.cli.main", "up", "--duration", "300",
                           "--state-dir", str(scratch)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    url = ""
    began = time.monotonic()
    while not url and time.monotonic() - began < 30 and up.poll() is None:
        line = await asyncio.to_thread(up.stdout.readline)  # type: ignore[union-attr]
        lines.append(line)
        if "NATS at " in line:
            url = line.split("NATS at ", 1)[1].split(",", 1)[0].strip()
    reader = asyncio.create_task(asyncio.to_thread(lambda: lines.extend(up.stdout)))  # type: ignore[arg-type]
    seen: dict[str, list[dict[str, Any]]] = {}
    report: dict[str, Any] = {}
    try:
        if not url:
            checks.record("fleet", False, "fleetpilot up did not start: " + "".join(lines[-5:]).strip())
            checks.record("envelope", False, "no fleet, no run")
            return report
        nc = await nats.connect(url)

        async def keep(msg: Any) -> None:
            try:
                event = msgspec.json.decode(msg.data)
            except msgspec.DecodeError:
                return
            if isinstance(event, dict) and event.get("task_id") == FLEET_TASK:
                seen.setdefault(str(event.get("type", msg.subject)), []).append(event)

        for subject in ("decision.made", "action.>", "task.lifecycle.>", "task.fingerprinted", "feedback.recorded"):
            await nc.subscribe(subject, cb=keep)
        task = {"task_id": FLEET_TASK, "kind": "train", "gpus": 1, "gpu_milli": 1000, "gpu_memory_mb": 10_000,
                "expected_duration_s": 30, "sla": {"tier": "standard", "max_queue_s": 120},
                "command": [sys.executable, str(TASK_SCRIPT), "--grow-gb", str(FLEET_GROW_GB), "--step-s", "1",
                            "--hold-s", "10"]}
        (scratch / "task.json").write_text(json.dumps(task))
        submit = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "fleetpilot.cli.main", "submit", "-f", str(scratch / "task.json"),
                             "--nats-url", url, "--state-dir", str(scratch), "--timeout", "90", "--accept-offer"],
            capture_output=True, text=True, env=env, timeout=120)

        def states() -> list[str]:
            return [e.get("state", "") for e in seen.get("task.lifecycle.v1", [])]

        # Until the task is judged: a finished one fingerprinted too, a failed one just judged
        # (its feedback follows the lifecycle event; reading on at once would race it).
        await wait_for(lambda: seen.get("feedback.recorded.v1") and (
            "finished" in states() and seen.get("task.fingerprinted.v1") or {"failed", "oom_killed"} & set(states())),
            timeout_s=150)
        decisions = seen.get("decision.made.v1", [])
        placed = [p for d in decisions if d.get("action") == "assign" for p in d.get("placement", [])]
        fps = seen.get("task.fingerprinted.v1", [])
        feedback = seen.get("feedback.recorded.v1", [])
        fp = fps[-1].get("fingerprint", {}) if fps else {}
        ok = (submit.returncode == 0 and bool(placed) and "finished" in states() and bool(fps)
              and any(f.get("outcome") == "success" for f in feedback))
        where = ", ".join(f"{p.get('node')}/gpu{p.get('gpu')}" for p in placed) or "nowhere"
        checks.record("fleet", ok,
                      f"submit exit {submit.returncode}; decision {[d.get('action') for d in decisions]} on {where}; "
                      f"lifecycle {states()}; fingerprint {fp.get('pattern', '-')} peak "
                      f"{fp.get('predicted_peak_mb', 0):.0f} MB; feedback {[f.get('outcome') for f in feedback]}",
                      events={k: v for k, v in seen.items()}, submit_stdout=submit.stdout[-2000:],
                      submit_stderr=submit.stderr[-2000:])
        if "finished" in states():
            await check_envelope(nc, msgspec.convert(task, TaskSubmitted), checks)
        else:  # only a run that finished teaches one: nothing to wait for
            checks.record("envelope", False, "the fleet task did not finish: no envelope learnt", envelope_mb=[])
        await nc.drain()
        return report
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                await asyncio.to_thread(up.wait, 60)
            except subprocess.TimeoutExpired:
                up.kill()
        await asyncio.wait_for(reader, timeout=10)
        (out / "fleet-up.log").write_text("".join(lines))


async def check_envelope(nc: Any, task: TaskSubmitted, checks: Checks) -> None:
    """Step 9: the statistics the fingerprinter wrote for the fleet task's signature, once its
    run has ended, carry an envelope that rises from its first level to what it grew to."""
    kv = await nc.jetstream().key_value("fingerprints")
    found: dict[str, Any] = {}

    async def written() -> bool:
        try:
            entry = await kv.get(task_signature(task))
        except KeyNotFoundError:
            return False
        found["stats"] = load_stats(entry.value) if entry.value else None
        return bool(found["stats"] is not None and found["stats"].envelope_mb)

    deadline = time.monotonic() + 15.0
    while not await written() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    envelope = list(found["stats"].envelope_mb) if found.get("stats") is not None else []
    grown_mb = FLEET_GROW_GB * 1024.0
    ok = (len(envelope) == ENVELOPE_POINTS and envelope == sorted(envelope) and envelope[0] < envelope[-1]
          and grown_mb <= envelope[-1] <= grown_mb + CONTEXT_ALLOWANCE_MB)
    shown = ", ".join(f"{mb / 1024:.1f}" for mb in envelope[::4]) if envelope else "none"
    checks.record("envelope", ok, f"{len(envelope)} points, GB at 0/20/40/60/80% of its declared "
                  f"{task.expected_duration_s:.0f} s: {shown}; its last {envelope[-1] if envelope else 0:.0f} MB "
                  f"against the {grown_mb:.0f} MB it grew to", envelope_mb=envelope)


def main() -> int:
    """Parse, run every check, write the report; exit 1 when a check fails."""
    parser = argparse.ArgumentParser(description="Acceptance check of one GPU node for Fleetpilot.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for report.json and logs")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU the test task runs on (default 0)")
    parser.add_argument("--grow-gb", type=int, default=16, help="GiB the test task grows to (default 16)")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds between its 1 GiB steps (default 0.5)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # The process backend appends to a task's log (a task started again keeps its history),
    # and the checks read their tasks' own lines from it: a run into the same folder must
    # not read the last run's.
    shutil.rmtree(args.out / "tasks", ignore_errors=True)
    checks = Checks()
    report: dict[str, Any] = {}
    try:
        report["nvml"] = check_nvml(checks)
        report.update(asyncio.run(run_checks(args, checks)))
        report.update(asyncio.run(check_fleet(args, checks)))
    except Exception as exc:  # noqa: BLE001 - a broken node is a FAIL line and a report, not a traceback
        checks.record("run", False, f"{type(exc).__name__}: {exc}")
    report["checks"] = checks.results
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"{'all checks passed' if checks.ok else 'some checks FAILED'}; report in {args.out / 'report.json'}")
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
