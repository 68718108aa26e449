"""The checks of agents' requests (pipeline/tools/check_agents.py) on hand-written
logs (tests/support/hand_logs.py, `agents=True`): each batch and validation is
one agent sample of one request on its generator's rollouts lane. A valid log
passes; each planted bug is caught as the invariant it breaks."""
from __future__ import annotations

import pytest
from tests.support.hand_logs import add, find, log, without_clocks

from pipeline.tools.check import check_events

pytestmark = pytest.mark.unit


def agent_findings(events) -> list:
    """The violations that name an agent event: this module's, not the rollouts'."""
    return [v for v in check_events(events) if any(e["ev"].startswith("agent_") for e in v.events)]


def inflight(events) -> list[dict]:
    find(events, "run_start")["refit_mode"] = "inflight"
    return events


@pytest.mark.parametrize("kw", [{}, dict(max_age=0), dict(groups=2), dict(start_step=2, steps=5),
                                dict(generators=("g",)), dict(finished=False)])
def test_a_valid_log_with_agents_passes(kw):
    events = log(agents=True, **kw)
    assert {"agent_request_start", "agent_request_end"} <= {e["ev"] for e in events}
    assert check_events(events) == [] and check_events(without_clocks(events)) == []


# --- invariant 2: inside its sample's rollout ---------------------------------------

def late_request(events, batch="b1.0", worker="gen1", version=4, **end):
    """A second request of `batch`'s sample, logged on its worker's lane after everything there."""
    fields = dict(lane=f"{worker}/rollouts", batch=batch, sample=f"{batch}/0", request=2)
    t = find(events, "run_end")["t"]
    start = add(events, t - 0.2, "agent_request_start", worker, version=version, loaded=version, **fields)
    stop = add(events, t - 0.1, "agent_request_end", worker, version=version,
               **{"token_versions": [[version, 4]], **end, **fields})
    return start, stop


def test_a_request_served_after_its_sample_was_delivered():
    events = log(agents=True)
    late_request(events)
    found = check_events(events)
    assert {v.invariant for v in found} == {2}
    outside = [v.message for v in found if "not inside its rollout" in v.message]
    assert len(outside) == 2 and all("agent sample b1.0/0 (batch b1.0 on gen1" in m for m in outside)


def test_an_agent_event_of_no_rollout_on_its_worker():
    events = log(agents=True)
    find(events, "agent_start", batch="b2.0")["batch"] = "b9.0"
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "belongs to no rollout of its worker" in found[0].message


def test_a_request_end_without_its_start():
    events = log(agents=True)
    events.remove(find(events, "agent_request_start", batch="b2.0"))
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "has no agent_request_start before it" in found[0].message


def test_a_request_end_the_clocks_do_not_put_after_its_start():
    events = log(agents=True)
    start, end = find(events, "agent_request_start", batch="b2.0"), find(events, "agent_request_end", batch="b2.0")
    end["vc"] = dict(start["vc"])
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "is not after its agent_request_start" in found[0].message


# --- drain: ordered with every refit and validation of its worker ------------------

def test_a_request_decoding_across_a_refit_under_drain():
    """The refits did not join the rollouts in flight: the agents' requests are not ordered with them either."""
    found = agent_findings(log(agents=True, drain=False))
    refits = [v.message for v in found if v.invariant == 2]
    assert any("b1.0/0 (batch b1.0 on gen1" in m and "the refit of step 0 are not ordered" in m for m in refits)
    assert check_events(inflight(log(agents=True, drain=False))) == []  # by design under inflight


def test_an_aborted_request_decodes_until_its_sample_ends():
    """A request without an end was aborted at its sample's end: a drain after that is no overlap."""
    events = log(agents=True)
    events.remove(find(events, "agent_request_end", batch="b2.0"))
    assert check_events(events) == []
    events.remove(find(events, "agent_end", batch="b2.0"))  # until its rollout's end, then
    assert check_events(events) == []


def test_an_agent_event_during_a_validation_under_drain():
    """resume did not wait for gen0's validation of step 0: b2.0, on gen0, is not ordered with it."""
    events = log(agents=True, validate=(0,), resume_waits_for_validation=False)
    found = [v for v in agent_findings(events) if v.invariant == 1]
    assert len(found) == 4 and all("b2.0/0" in v.message and "validation of step 0" in v.message for v in found)
    assert agent_findings(inflight(log(agents=True, validate=(0,), resume_waits_for_validation=False))) == []


# --- invariant 2: each token's version one the generator held -----------------------

@pytest.mark.parametrize("runs", [[[2, 4]], [[1, 2], [2, 2]], [[0, 4]]])
def test_tokens_of_a_version_the_generator_did_not_hold(runs):
    """b2.0 runs on gen0 with version 1, drained before the refit to 2."""
    events = log(agents=True)
    find(events, "agent_request_end", batch="b2.0")["token_versions"] = runs
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "which its generator never held while it decoded" in \
        found[0].message and "b2.0/0" in found[0].message


def test_a_request_that_claims_weights_its_engine_did_not_hold():
    events = log(agents=True)
    find(events, "agent_request_start", batch="b3.0")["loaded"] = 1   # gen1 loaded 2 before it, at step 1
    find(events, "agent_request_end", batch="b3.0")["token_versions"] = [[1, 4]]
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "says its engine held version 1, but its generator held [2]" \
        in found[0].message


def test_tokens_of_a_refit_that_landed_during_the_request_pass_under_inflight():
    """Without the drain, gen0's refit to version 2 is unordered with b2.0's
    request: its tokens may carry 1, then 2; never 3, loaded after it ended."""
    events = inflight(log(agents=True, drain=False))
    end = find(events, "agent_request_end", batch="b2.0")
    end["token_versions"] = [[1, 2], [2, 2]]
    assert check_events(events) == []
    end["token_versions"] = [[1, 2], [3, 2]]
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "sampled tokens of version [3]" in found[0].message \
        and "loaded [2]" in found[0].message


def test_a_validation_request_samples_with_the_validations_weights():
    events = log(agents=True, validate=(1,))
    find(events, "agent_request_end", batch="val")["token_versions"] = [[1, 4]]  # validation of step 1 holds 2
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "agent sample val/0" in found[0].message


def test_malformed_token_versions_are_named():
    events = log(agents=True)
    find(events, "agent_request_end", batch="b2.0")["token_versions"] = [1, 1, 1, 1]
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "not runs [[version, tokens], ...]" in found[0].message


# --- invariant 3: an agent's model tokens no older than max_age allows ----------------

def test_an_agent_samples_token_too_old_for_its_training_step_is_caught():
    """No check of its own: the trained tokens are rollout_end's, none may be older
    than their batch's start (invariant 2), whose age max_age bounds (invariant 3).
    b3.0 starts with version 2 and trains at step 3 with max_age 1; a token of
    version 1 (a session kept from an earlier batch) would be 2 steps old."""
    events = log(agents=True)
    find(events, "rollout_end", batch="b3.0")["token_versions"] = [[[1, 4], [2, 4]]]
    found = check_events(events)
    assert [v.invariant for v in found] == [2]
    assert "first token has version 1, older than the version 2 the batch started with" in found[0].message
