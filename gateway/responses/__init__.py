"""OpenAI's Responses API: a conversation turn stored in Redis, run now or in the background.

`schema` reads the body, `items` turns items into chat messages and answers into output
items, `fold` reads a response's chunks (across a crashed worker's restart), `events` derives
its typed stream events, `store` keeps it in Redis and `finisher` completes background runs
on whichever gateway is alive. The route is `gateway/routes/responses.py`.
"""
