"""Agents the tests run through the gateway."""
from __future__ import annotations


async def two_turns(client, prompt):
    """A user turn, the model's answer, a follow-up: the history repeats, so one segment."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="any", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "and again"}]
    await client.chat.completions.create(model="any", messages=messages)
    return None


def plain_def(client, prompt):
    answer = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt.text}])
    return {"reward": float(len(answer.choices[0].message.content) % 3), "info": {"chars": 1}}
