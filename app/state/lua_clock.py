"""The server clock as a Lua snippet, shared by every script that stamps or expires something
(app/state/scripts.py, app/state/lifecycle.py): replicas agree on time only through Redis's."""

from __future__ import annotations

# Server time in ms (integer): `now_ms`, and `now_str` as integer text.
NOW_MS = """
local __t = redis.call('TIME')
local now_ms = tonumber(__t[1]) * 1000 + math.floor(tonumber(__t[2]) / 1000)
local now_str = string.format('%d', now_ms)
"""
