"""Agents the tests run through the gateway (agent.function=tests.agents.agents_for_tests:<name>)."""
from __future__ import annotations

import asyncio
import itertools
import math
import os
import queue
import subprocess
import sys
import threading

# Sessions an agent hands to the test that probes them (probe_and_wait).
OPEN_SESSIONS: queue.Queue = queue.Queue()
# Events rewrites_then_waits waits on, handed to the test that refits meanwhile.
WAITING_FOR_A_REFIT: queue.Queue = queue.Queue()


async def two_turns(client, prompt):
    """A user turn, the model's answer, a follow-up: the history repeats, so one segment."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="any", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and again"}]
    await client.chat.completions.create(model="any", messages=messages)
    return None


async def rewrites_history(client, prompt):
    """The second request drops the first answer: a new segment."""
    first = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    summary = f"summary: {first.choices[0].message.content}"
    await client.chat.completions.create(model="any", messages=[{"role": "user", "content": summary}])
    return 0.5


async def rewrites_then_waits(client, prompt):
    """Starts a second segment, then waits until the test has refitted; its third
    request continues that segment with the new weights."""
    first = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    messages = [{"role": "user", "content": f"summary: {first.choices[0].message.content}"}]
    second = await client.chat.completions.create(model="any", messages=messages)
    refitted = threading.Event()
    WAITING_FOR_A_REFIT.put(refitted)
    if not await asyncio.to_thread(refitted.wait, 60):
        raise TimeoutError("the test did not refit within 60 s")
    messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    await client.chat.completions.create(model="any", messages=messages)
    return 1.0


def plain_def(client, prompt):
    answer = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    return {"reward": 1.0, "info": {"chars": len(answer.choices[0].message.content)}}


async def fails_on_odd_prompts(client, prompt):
    await client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    number = int(prompt.id[1:])
    if number % 4 == 1:
        raise ValueError(f"agent bug on {prompt.id}")
    if number % 4 == 3:
        return math.nan
    return 1.0


async def overlong(client, prompt):
    """Asks once within the context, then with a message over it; reports the error it got."""
    await client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    try:
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x" * 500}])
    except Exception as exc:  # the test reads what the SDK raised
        return {"reward": 0.25, "info": {"error": type(exc).__name__, "code": getattr(exc, "code", None)}}
    return 1.0


async def sleeps_past_its_timeout(client, prompt):
    await client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    OPEN_SESSIONS.put((str(client.base_url), client.api_key))
    await asyncio.sleep(3600)


async def hands_its_session_to_the_test(client, prompt):
    """Publishes its base URL and key, then waits until the test has probed the session."""
    done = asyncio.Event()
    OPEN_SESSIONS.put((str(client.base_url), client.api_key, asyncio.get_running_loop(), done))
    await done.wait()
    return 1.0


async def one_request(client, prompt):
    answer = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    return float(bool(answer.choices[0].message.content))


CHILD = r"""
import json, os, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": os.environ["QUESTION"]}]}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, method="POST",
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(json.loads(opener.open(request, timeout=60).read())["choices"][0]["message"]["content"])
"""


def child_process(client, prompt):
    """The agent's work done by a child process over plain HTTP, with the client's URL and key."""
    env = {**os.environ, "OPENAI_BASE_URL": str(client.base_url).rstrip("/"), "OPENAI_API_KEY": client.api_key,
           "QUESTION": prompt.text}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return {"reward": 1.0, "info": {"content": out.stdout.strip()}}


_EVERY_OTHER = itertools.count()


async def sometimes_rewrites(client, prompt):
    """Every other sample drops its first answer before asking again: a group's
    samples then end on different segments (one or two)."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="any", messages=messages)
    if next(_EVERY_OTHER) % 2:
        messages = [{"role": "user", "content": f"summary: {first.choices[0].message.content}"}]
    else:
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    await client.chat.completions.create(model="any", messages=messages)
    return None


def gives_up_once(client, prompt):
    """Its first request times out on the client's side; the second is answered."""
    import openai
    try:
        client.with_options(timeout=0.2).chat.completions.create(
            model="any", messages=[{"role": "user", "content": prompt.text}])
    except openai.APITimeoutError:
        pass
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "again"}])
    return 1.0
