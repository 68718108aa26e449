"""`ray job submit` for real: a Ray head started with `ray start` on loopback,
the repository shipped with `--working-dir .`, a short real-stack run
(vLLM-CPU + DeepSpeed-CPU) checked from its run files and from the cluster's
own record of the job.

Token authentication is on, as docs/clusters.md's recipe has it: a fresh
random token per test session, in a token file in the cluster's temp dir,
reaches `ray start` and every authorized `ray job submit` through
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH. One test checks that a
submission without the token (or with a wrong one) is refused and runs nothing.

The cluster is ours alone and is stopped by process, not with `ray stop`:
`ray stop` kills every Ray process on the machine by name, including other
people's clusters and this test session's own local Ray. `ray start` runs in a
new session (setsid), every daemon it starts inherits that session id, and the
workers the raylet forks keep it too; the job's entrypoint gets a session of
its own (Ray's job supervisor starts it so) but is a descendant of a worker.
So: every process of that session, plus their descendants, is the cluster."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from pipeline.core.events import load_events
from pipeline.tools.check import check_events

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the environment running the tests has ray and the project's deps
# On 2 real cores: enough logical CPUs for the actors (0.5 each), and few
# enough that run.dag_mode=auto picks classic graphs (compiled ones busy-wait
# a core per actor; auto counts the cluster's CPUs when joining one).
CLUSTER_CPUS = 4
START_DEADLINE_S = 120
# vLLM and DeepSpeed start-up: 20-35 s on a quiet machine, slower when shared.
REAL_JOB_DEADLINE_S = 400


@dataclass(frozen=True)
class Cluster:
    url: str          # the dashboard: job API and state API
    gcs: str          # host:port of the GCS, what `ray start --address` and ray.init() join
    temp_dir: Path
    session_id: int   # the session every process of this cluster belongs to
    env: dict         # the token's holder: RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH
    token: str

    @property
    def headers(self) -> dict:
        """For clients in this process, which runs with RAY_AUTH_MODE=disabled
        (conftest) and so adds no token of its own."""
        return {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:  # bound together, so the n ports differ
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _cluster_processes(session_id: int) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session_id:
                found[proc.pid] = proc
        except (ProcessLookupError, PermissionError):
            continue
    for proc in list(found.values()):
        try:
            found.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _terminate(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM, then SIGKILL what is still alive after grace_s."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + grace_s
    while (left := _alive(procs)) and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.2)
    for p in _alive(procs):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def stop_cluster(session_id: int, grace_s: float = 10.0, deadline_s: float = 60.0) -> list[str]:
    """Stop every process of the cluster in `ray stop`'s order: the raylet,
    then the rest, then the GCS. All at once, the GCS ignored SIGTERM for
    over 12 s; in this order the whole cluster is gone in about 1 s. A worker
    the raylet forked while we looked is caught by the next look. Returns the
    processes still alive at the deadline (there should be none)."""
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        # Collected before anything exits: orphans lose their parent, not their session.
        fresh = [p for p in _cluster_processes(session_id) if p.pid not in seen]
        seen.update({p.pid: p for p in fresh})
        procs = _alive(list(seen.values()))
        if not procs:
            return []
        names = {p.pid: _name(p) for p in procs}
        raylet = [p for p in procs if names[p.pid] == "raylet"]
        gcs = [p for p in procs if names[p.pid] == "gcs_server"]
        for group in (raylet, [p for p in procs if p not in raylet and p not in gcs], gcs):
            _terminate(group, grace_s)
        psutil.wait_procs(_alive(procs), timeout=1)
    return [f"pid {p.pid}: {_name(p)}" for p in _alive(list(seen.values()))]


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return "?"


def _http(url: str, headers: dict | None = None, data: bytes | None = None) -> tuple[int, str]:
    """Status and body of one request; HTTP errors are answers, not exceptions."""
    request = urllib.request.Request(url, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _wait_for_dashboard(url: str, token: str, deadline_s: float) -> None:
    """/api/version needs the token: a 200 means the dashboard is up and takes it."""
    deadline = time.monotonic() + deadline_s
    request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:  # not up yet; an HTTPError is an OSError too
            if isinstance(exc, urllib.error.HTTPError) and exc.code in (401, 403):  # up, and no use waiting
                raise RuntimeError(f"the dashboard at {url} refused the cluster's token: {exc}") from exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard at {url} did not answer within {deadline_s} s: {exc}") from exc
        time.sleep(0.5)  # polling an external process, with a deadline


@pytest.fixture(scope="module")
def cluster():
    # Short: Ray puts its Unix sockets under the temp dir (108-byte path limit).
    # Its own temp dir also keeps ray_current_cluster away from /tmp/ray, so
    # nobody's plain ray.init() connects to this cluster while it runs.
    temp_dir = Path(tempfile.mkdtemp(prefix="dagrl-job-", dir="/tmp"))
    # Token authentication on, with a token of this test session's own: a file
    # only we can read, named by RAY_AUTH_TOKEN_PATH. Whatever token the
    # machine has (RAY_AUTH_TOKEN, ~/.ray/auth_token) is not used: the
    # variable is dropped and RAY_AUTH_TOKEN_PATH takes precedence over the file.
    token = secrets.token_hex(32)
    token_file = temp_dir / "auth_token"
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") and not k.startswith("RAY_AUTH_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    # Every port explicit: the defaults (6379, 8265, 10001, 52365, ...) may be
    # taken by another cluster on this machine.
    gcs, dash, client, agent, agent_grpc, env_agent, metrics, node_mgr, obj_mgr = _free_ports(9)
    cmd = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           f"--num-cpus={CLUSTER_CPUS}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={env_agent}", f"--metrics-export-port={metrics}",
           f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
           f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    start = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        out, _ = start.communicate(timeout=START_DEADLINE_S)
        assert start.returncode == 0, f"ray start failed:\n{out[-3000:]}"
        _wait_for_dashboard(url, token, START_DEADLINE_S)
        yield Cluster(url, f"127.0.0.1:{gcs}", temp_dir, start.pid, env, token)
    finally:
        if start.poll() is None:  # ray start itself hung
            start.kill()
            start.wait()
        left = stop_cluster(start.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, "processes of the test's Ray cluster survived SIGKILL:\n" + "\n".join(left)


def submit(cluster: Cluster, submission_id: str, train_args: list[str], deadline_s: float) -> tuple[str, float]:
    """The README's command, with the token, blocking until the job ends; returns its output and seconds."""
    cmd = [str(BIN / "ray"), "job", "submit", "--address", cluster.url, "--submission-id", submission_id,
           "--working-dir", ".", "--", "python", "-m", "pipeline", "train", *train_args]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=deadline_s)
    except subprocess.TimeoutExpired as exc:
        subprocess.run([str(BIN / "ray"), "job", "stop", "--address", cluster.url, submission_id],
                       env=cluster.env, capture_output=True, timeout=60)
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"job {submission_id} did not finish within {deadline_s} s:\n{out[-4000:]}")
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"ray job submit exited {proc.returncode}:\n{output[-6000:]}"
    return output, elapsed


def check_job(cluster: Cluster, submission_id: str, run_dir: Path, steps: int, min_actors: int) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state.api import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource
    info = JobSubmissionClient(cluster.url, headers=cluster.headers).get_job_info(submission_id)
    assert info.status == JobStatus.SUCCEEDED, f"{info.status}: {info.message}"
    # The driver joined this cluster (RAY_ADDRESS, set by the job) rather than
    # starting a Ray of its own: the cluster knows the driver's job id and
    # ran the run's actors under it.
    assert info.job_id is not None, "the job's driver never connected to the cluster"
    actors = StateApiClient(cluster.url, headers=cluster.headers).list(
        StateResource.ACTORS, options=ListApiOptions(filters=[("job_id", "=", info.job_id)], limit=100),
        raise_on_missing_output=False)
    classes = sorted(a.class_name for a in actors)
    assert len(actors) >= min_actors, f"actors of job {info.job_id} on the cluster: {classes}"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["error"] is None and summary["steps"] == steps, summary
    assert (run_dir / "events.jsonl").stat().st_size > 0
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if r["step"] >= 0) == list(range(steps))
    # metrics.tensorboard is on by default: the same per-step scalars, read back.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("step_time_s")] == list(range(steps))


def _without_token(cluster: Cluster, home: Path) -> dict:
    """The environment of someone who reaches the cluster but has no token: no
    RAY_AUTH_* variable, and a home without ~/.ray/auth_token."""
    home.mkdir()
    env = {k: v for k, v in cluster.env.items() if not k.startswith("RAY_AUTH_")}
    env["HOME"] = str(home)
    return env


@pytest.mark.timeout(START_DEADLINE_S + 180)
def test_submit_without_token_is_refused(cluster, tmp_path):
    marker = tmp_path / "ran"  # the refused jobs' entrypoint would create it
    outsider = _without_token(cluster, tmp_path / "home")
    wrong = {**cluster.env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # RAY_AUTH_TOKEN wins over the file
    ids = {"outsider": "dagrl-noauth", "wrong": "dagrl-wrongauth", "http": "dagrl-noauth-http"}

    assert _http(f"{cluster.url}/api/authentication_mode") == (200, '{"authentication_mode": "token"}')
    for who, env, refusal in (("outsider", outsider, "Unauthorized: Missing authentication token"),  # 401
                              ("wrong", wrong, "Forbidden: Invalid authentication token")):  # 403
        cmd = [str(BIN / "ray"), "job", "submit", "--address", cluster.url, "--submission-id", ids[who],
               "--", "touch", str(marker)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"ray job submit without the token ({who}) was accepted:\n{output[-3000:]}"
        assert refusal in output, output[-3000:]
    # The job API itself, no client in between: 401 without a token, 403 with a wrong one.
    body = json.dumps({"entrypoint": f"touch {marker}", "submission_id": ids["http"]}).encode()
    post = {"Content-Type": "application/json"}
    wrong_bearer = {**post, "Authorization": "Bearer " + secrets.token_hex(32)}
    assert _http(f"{cluster.url}/api/jobs/", post, body)[0] == 401
    assert _http(f"{cluster.url}/api/jobs/", wrong_bearer, body)[0] == 403
    assert _http(f"{cluster.url}/api/jobs/")[0] == 401  # nor can it read the job list
    # The GCS port refuses a driver without the token too (and a node: `ray start --address`). One
    # try: ray.init() would try 20 times, a second apart, though the refusal is the same each time.
    probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={cluster.gcs!r})"], cwd=REPO,
                           env={**outsider, "RAY_gcs_server_port_wait_time_s": "1"},
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0 and "InvalidAuthToken" in probe.stderr, probe.stderr[-3000:]

    # Nothing ran: the cluster knows none of these submissions, and no entrypoint touched the marker.
    from ray.job_submission import JobSubmissionClient
    known = {job.submission_id for job in JobSubmissionClient(cluster.url, headers=cluster.headers).list_jobs()}
    assert not known & set(ids.values()), known
    assert not marker.exists()


@pytest.mark.timeout(START_DEADLINE_S + REAL_JOB_DEADLINE_S + 120)
def test_submit_real_stack_run(cluster, tmp_path):
    # --working-dir . respects .gitignore: models/ is not uploaded, so the
    # model is given by an absolute path that exists on the (only) node.
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "pipeline", "build-tiny", "--out", str(model)], cwd=REPO,
                   check=True, capture_output=True, timeout=300)
    steps = 3
    output, elapsed = submit(cluster, "dagrl-real", [
        "--config", "examples/tiny_grpo.yaml", f"run.steps={steps}", f"model.path={model}",
        f"run.output_dir={tmp_path}", "run.name=real_job"], REAL_JOB_DEADLINE_S)
    print(f"real-stack job: {elapsed:.1f} s from submit to exit")
    assert "succeeded" in output
    # Not a terminal: the progress display prints one plain line per step.
    assert f"step {steps - 1} ({steps} of {steps} done) reward=" in output, output[-3000:]
    # The workers' lines reach the job's log; vLLM's INFO line at every refit must not (pipeline/core/vllm_env.py).
    assert "reset prefix cache" not in output, output[-3000:]
    run_dir = tmp_path / "real_job"
    check_job(cluster, "dagrl-real", run_dir, steps, min_actors=3)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["generation_backend"] == "vllm" and summary["training_backend"] == "deepspeed"
    assert Path(summary["checkpoint"]).is_dir() and Path(summary["checkpoint"]).parent == run_dir / "checkpoints"


@pytest.mark.timeout(START_DEADLINE_S + 300)
def test_ray_job_stop_stops_a_run_as_sigterm_does(cluster, tmp_path):
    """`ray job stop` sends the driver SIGTERM, then SIGKILL after
    RAY_JOB_STOP_WAIT_TIME_S: given the time, the run checkpoints its last step
    and says how to resume, as a SIGTERM on a laptop does (docs/checkpoints-and-faults.md)."""
    from ray.job_submission import JobStatus, JobSubmissionClient
    run_dir = tmp_path / "stopped_job"
    runtime_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    cmd = [str(BIN / "ray"), "job", "submit", "--address", cluster.url, "--submission-id", "dagrl-stop",
           "--working-dir", ".", "--runtime-env-json", runtime_env, "--no-wait", "--", "python", "-m", "pipeline",
           "train", "--config", "examples/sim_grpo.yaml", "run.steps=500", "run.checkpoint_every=0",
           f"run.output_dir={tmp_path}", "run.name=stopped_job", "metrics.progress=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = JobSubmissionClient(cluster.url, headers=cluster.headers)
    end = time.monotonic() + 240
    while _steps_done(run_dir) < 3:
        status = client.get_job_status("dagrl-stop")
        assert status == JobStatus.RUNNING or status == JobStatus.PENDING, client.get_job_logs("dagrl-stop")[-3000:]
        assert time.monotonic() < end, "the job did not reach step 3"
        time.sleep(0.5)  # polling another process's files, with a deadline
    stop = subprocess.run([str(BIN / "ray"), "job", "stop", "--address", cluster.url, "dagrl-stop"], cwd=REPO,
                          env=cluster.env, capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert client.get_job_status("dagrl-stop") == JobStatus.STOPPED
    summary = json.loads((run_dir / "summary.json").read_text())
    done = summary["steps"]
    assert summary["stopped_by"] == "SIGTERM" and done >= 3, summary
    assert (run_dir / "checkpoints" / f"step_{done}" / "meta.json").is_file()
    logs = client.get_job_logs("dagrl-stop")
    assert f"resume with: python -m pipeline train --resume {run_dir}" in logs, logs[-3000:]


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"step": -1' not in line) if path.is_file() else 0
