"""Lua shared by the Redis index's write scripts, standalone (:mod:`kvcore.index.redis`) and
cluster (:mod:`kvcore.index.redis_cluster`): the helper functions, the speculative-entry script,
and the bodies of the apply and clear scripts.

A body is text to be placed after the script's own preamble, which must define the local ``p``
(the key prefix: the namespace, or a cluster partition's hash tag) and ``slot`` (the worker's slot
number), and the Lua function ``log`` (:data:`LOG`). The two backends pass their arguments at
different ``ARGV`` positions; a body takes those positions as whole numbers (``ARGV[n]``). The
keys and the change-log entries written are those of the schema in :mod:`kvcore.index.redis`.
"""
from __future__ import annotations

from string import Template

# Every write script resolves the worker's slot itself (allocating it on first use), so a writer
# never uses a slot number that a restarted or flushed Redis has since given to another worker.
# ``epoch`` is set with the first slot; a lookup compares it to refresh its slot -> worker table.
SLOT_OF = """
local function slot_of(p, w)
  local s = redis.call('HGET', p .. 'slots', w)
  if not s then
    if redis.call('EXISTS', p .. 'epoch') == 0 then
      local t = redis.call('TIME')
      redis.call('SET', p .. 'epoch', t[1] .. '.' .. t[2])
    end
    s = redis.call('HLEN', p .. 'slots')
    redis.call('HSET', p .. 'slots', w, s)
  end
  return tonumber(s)
end
"""

# Every change to the index state is also appended to the change log (``P log``), in the same
# script call, so a replica (kvcore.index.redis_mirror) that has applied the log up to seq n holds
# exactly what Redis held after the change numbered n. ``fields``: the entry after 'n', seq.
LOG = """
local function log(p, maxlen, fields)
  local n = redis.call('INCR', p .. 'seq')
  redis.call('XADD', p .. 'log', 'MAXLEN', '~', maxlen, '*', 'n', n, unpack(fields))
  return n
end
"""

# ARGV: prefix, log maxlen, then (worker, ttl ms, packed 8-byte keys) triples: a gateway's
# speculative entries, which live only in the log (and in the replicas that read it), logged as
# fields 'p' (ttl ms) and 'x' (keys); a ttl of 0 withdraws the worker's speculative entries of those
# keys instead, logged as field 'd' (a reader that does not know 'd' skips it, keeping the entries
# until their TTL). Returns the log seq of the last one. The cluster runs it per partition
# (KEYS[1] the partition's seq key).
SPECULATIVE_LUA = LOG + """
local p = ARGV[1]
local n = 0
for j = 3, #ARGV, 3 do
  if ARGV[j + 1] == '0' then
    n = log(p, ARGV[2], {'w', ARGV[j], 'd', ARGV[j + 2]})
  else
    n = log(p, ARGV[2], {'w', ARGV[j], 'p', ARGV[j + 1], 'x', ARGV[j + 2]})
  end
end
return n
"""


def speculative_ttl_ms(ttl_s: float | None) -> int:
    """:data:`SPECULATIVE_LUA`'s ttl argument: ``ttl_s`` in ms, at least 1; 0 (a withdrawal) for None."""
    return 0 if ttl_s is None else max(1, int(ttl_s * 1000))


_APPLY = Template("""local missing = 0
local fields = {'w', ARGV[2], 'h', ARGV[$ttl]}
for j = $first, #ARGV, 3 do
  fields[#fields + 1] = ARGV[j] .. ARGV[j + 1]
  fields[#fields + 1] = ARGV[j + 2]
end
for j = $first, #ARGV, 3 do
  local tier = tonumber(ARGV[j + 1])
  local packed = ARGV[j + 2]
  local off = slot * 4 + tier
  local owned = p .. 'o:' .. slot .. ':' .. tier
  local rc = p .. 'rc:' .. slot .. ':' .. tier
  if ARGV[j] == 's' then
    local new = {}
    for i = 1, #packed, 8 do
      local k = string.sub(packed, i, i + 7)
      if redis.call('SETBIT', p .. 'b:' .. k, off, 1) == 1 then
        redis.call('HINCRBY', rc, k, 1)
      else
        new[#new + 1] = k
        if #new == 2000 then
          redis.call('SADD', owned, unpack(new))
          new = {}
        end
      end
    end
    if #new > 0 then redis.call('SADD', owned, unpack(new)) end
  else
    for i = 1, #packed, 8 do
      local k = string.sub(packed, i, i + 7)
      local bk = p .. 'b:' .. k
      if redis.call('GETBIT', bk, off) == 0 then
        missing = missing + 1
      else
        local n = redis.call('HGET', rc, k)
        if n then
          if tonumber(n) > 1 then redis.call('HINCRBY', rc, k, -1) else redis.call('HDEL', rc, k) end
        else
          redis.call('SETBIT', bk, off, 0)
          redis.call('SREM', owned, k)
          if redis.call('BITCOUNT', bk) == 0 then redis.call('DEL', bk) end
        end
      end
    end
  end
end
${before_log}return {missing, log(p, ARGV[$maxlen], fields)}
""")

_CLEAR = Template("""local off = slot * 4 + tonumber($tier)
local fields = {'w', ARGV[2]}
if ARGV[$first] == '1' and redis.call('DEL', p .. 'rc:' .. slot .. ':' .. $tier) == 1 then
  fields[#fields + 1] = 'R' .. $tier
  fields[#fields + 1] = ''
end
if ARGV[$forget] == '1' then
${on_forget}  fields[#fields + 1] = 'F'
  fields[#fields + 1] = ''
end
local ks = redis.call('SPOP', p .. 'o:' .. slot .. ':' .. $tier, tonumber(ARGV[$batch]))
for _, k in ipairs(ks) do
  local bk = p .. 'b:' .. k
  redis.call('SETBIT', bk, off, 0)
  if redis.call('BITCOUNT', bk) == 0 then redis.call('DEL', bk) end
end
if #ks > 0 then
  fields[#fields + 1] = 'c' .. $tier
  fields[#fields + 1] = table.concat(ks)
end
if #fields == 2 then return {0, 0} end
return {#ks, log(p, ARGV[$maxlen], fields)}
""")


def apply_body(ttl: int, first: int, maxlen: int, before_log: str = "") -> str:
    """The apply script's body: ``(op 's'|'r', tier, packed 8-byte keys)`` triples from
    ``ARGV[first]`` to the end, stored in / removed from ``slot``'s bits, owned sets and duplicate
    counters, then one change-log entry (``w`` worker ``ARGV[2]``, ``h`` heartbeat TTL ms
    ``ARGV[ttl]``, then the triples; trimmed to ``ARGV[maxlen]`` entries). ``before_log``: Lua
    lines run after the triples, before the entry is logged. The script returns ``{keys removed
    that were absent, log seq of the change}``."""
    return _APPLY.substitute(ttl=ttl, first=first, maxlen=maxlen, before_log=before_log)


def clear_body(tier: str, batch: int, first: int, forget: int, maxlen: int, on_forget: str = "") -> str:
    """The clear script's body: pops up to ``ARGV[batch]`` keys from ``slot``'s owned set of tier
    ``tier`` (a Lua expression) and clears their bits; ``ARGV[first]`` ``'1'`` drops the duplicate
    counters first, ``ARGV[forget]`` ``'1'`` logs the purge ``F`` (``on_forget``: Lua lines, each
    indented by two spaces, run then). One change-log entry for whatever changed (trimmed to
    ``ARGV[maxlen]`` entries). The script returns ``{keys cleared, log seq of the change (0:
    nothing changed)}``."""
    return _CLEAR.substitute(tier=tier, batch=batch, first=first, forget=forget, maxlen=maxlen,
                             on_forget=on_forget)
