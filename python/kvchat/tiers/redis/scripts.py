"""The Lua scripts the Redis tier runs: each one change the store makes whole,
so no reader sees half of it. What each takes and returns is written above it.
"""

# KEYS: manifest, tombstone, index, the session's chunk set, chunks...; ARGV:
# manifest, ttl, the tombstone the snapshot's copy began under ('' for none),
# written_at. Publishes nothing (returns -1) if the session was deleted since;
# else refreshes every chunk's TTL and publishes only if all are there, adding
# them to the set of every chunk the session's snapshots listed (what deleting
# it deletes). Returns the (1-based) positions of missing chunks, empty when
# published.
PUBLISH = """
local deleted = redis.call('GET', KEYS[2])
if deleted and deleted ~= ARGV[3] then return -1 end
local missing = {}
for i = 5, #KEYS do
  if redis.call('EXPIRE', KEYS[i], ARGV[2]) == 0 then missing[#missing + 1] = i - 4 end
end
if #missing == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  redis.call('HSET', KEYS[3], KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
  for i = 5, #KEYS, 1000 do
    redis.call('SADD', KEYS[4], unpack(KEYS, i, math.min(i + 999, #KEYS)))
  end
  redis.call('EXPIRE', KEYS[4], ARGV[2])
end
return missing
"""

# KEYS: manifest, tombstone, index, the session's routes, its chunk set, the
# set of processes that marked it held; ARGV: tombstone, ttl, session id, '1'
# if the deleting process holds it, the prefix of its held markers. Returns
# whether the store knew the session (a snapshot, a route, or a live held
# marker), and the chunk keys its snapshots listed (to delete those unused).
# Of a session that exists nowhere it leaves no tombstone: deletes of junk
# ids cost the store nothing.
DELETE = """
local known = redis.call('EXISTS', KEYS[1], KEYS[4], KEYS[5])
for _, holder in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  known = known + redis.call('DEL', ARGV[5] .. ':' .. holder)
end
redis.call('DEL', KEYS[6])
if ARGV[4] ~= '1' and known == 0 then
  return {0, {}}
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[3], KEYS[1])
for _, route in ipairs(redis.call('HKEYS', KEYS[4])) do
  if route ~= '~gen' and redis.call('GET', route) == ARGV[3] then redis.call('DEL', route) end
end
redis.call('DEL', KEYS[4])
local chunks = redis.call('SMEMBERS', KEYS[5])
redis.call('DEL', KEYS[5])
return {known, chunks}
"""

# The session's routes (a hash: route key -> conversation) also count its
# route changes ('~gen'), so a change made late (owed while Redis was down)
# is made only if no other process changed the session's routes since.

# KEYS: route, the session's routes, tombstone; ARGV: session id, ttl, the
# tombstone the session's copy here began under ('' for none), the
# conversation, the generation it must find ('' for any). The session's older
# routes go: it holds only its latest conversation, and a fork of an older one
# must start a session of its own, never take this one over. Returns the new
# generation, or -1 if refused.
ROUTE = """
local deleted = redis.call('GET', KEYS[3])
if deleted and deleted ~= ARGV[3] then return -1 end
local gen = tonumber(redis.call('HGET', KEYS[2], '~gen') or '0')
if ARGV[5] ~= '' and gen ~= tonumber(ARGV[5]) then return -1 end
for _, route in ipairs(redis.call('HKEYS', KEYS[2])) do
  if route ~= '~gen' and route ~= KEYS[1] and redis.call('GET', route) == ARGV[1] then
    redis.call('DEL', route)
  end
end
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], KEYS[1], ARGV[4], '~gen', gen + 1)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return gen + 1
"""

# KEYS: the session's routes; ARGV: session id, the generation it must find
# ('' for any). Takes every route of the session out of the map (a turn on it
# by its id begins). Returns {the new generation (-1: refused), the
# conversation of the route it held ('' for none), 1 if the session ever had
# a route (it is an automatic session) else 0}.
TAKE_SESSION = """
local gen = tonumber(redis.call('HGET', KEYS[1], '~gen') or '0')
if ARGV[2] ~= '' and gen ~= tonumber(ARGV[2]) then return {-1, '', 0} end
local held = ''
local routes = redis.call('HGETALL', KEYS[1])
for i = 1, #routes, 2 do
  if routes[i] ~= '~gen' and redis.call('GET', routes[i]) == ARGV[1] then
    redis.call('DEL', routes[i])
    held = routes[i + 1]
  end
end
if #routes > 0 then
  gen = gen + 1
  redis.call('HSET', KEYS[1], '~gen', gen)
end
return {gen, held, #routes > 0 and 1 or 0}
"""

# KEYS: per session held here, its held mark, its set of holders and its
# tombstone; ARGV: ttl, this process's name, then per session the tombstone
# its copy here began under ('' for none) and the copy's mark token. Keeps the
# marks of the copies here alive, but not of one deleted since it began (a
# tombstone other than its own; its own having expired is no delete), nor a
# mark another copy here set since (a newer token): returns the deleted
# (1-based).
REFRESH = """
local deleted = {}
for i = 1, #KEYS / 3 do
  local found = redis.call('GET', KEYS[3 * i]) or ''
  local mark = redis.call('GET', KEYS[3 * i - 2])
  if found ~= '' and found ~= ARGV[1 + 2 * i] then
    deleted[#deleted + 1] = i
  elseif not mark or mark == ARGV[2 + 2 * i] then
    redis.call('SET', KEYS[3 * i - 2], ARGV[2 + 2 * i], 'EX', ARGV[1])
    redis.call('SADD', KEYS[3 * i - 1], ARGV[2])
    redis.call('EXPIRE', KEYS[3 * i - 1], ARGV[1])
  end
end
return deleted
"""

# KEYS: per ended copy here, its held mark and its set of holders; ARGV: this
# process's name, then per copy its mark token. Removes each mark only if it
# is still that copy's: a copy begun here since has marked it anew.
RELEASE = """
for i = 1, #KEYS / 2 do
  if redis.call('GET', KEYS[2 * i - 1]) == ARGV[1 + i] then
    redis.call('DEL', KEYS[2 * i - 1])
    redis.call('SREM', KEYS[2 * i], ARGV[1])
  end
end
return 0
"""

# KEYS: routes, longest conversation first; ARGV: the namespace's session
# prefix. Takes the first route of the namespace out of the map and returns
# {its position (1-based), its session}, or {} if there is none.
TAKE = """
for i = 1, #KEYS do
  local session = redis.call('GET', KEYS[i])
  if session and string.sub(session, 1, #ARGV[1]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    return {i, session}
  end
end
return {}
"""

# Stored responses of `kvchat serve` (responses.py). Per API key: an index (a
# sorted set: record key -> its put's sequence number, so oldest first) and a
# hash of sizes (record key -> bytes, '~bytes': their sum, '~seq': the last
# sequence number); a hash of every key's index -> its sizes. A record that
# expired (or that maxmemory evicted) leaves its key's bounds once it is the
# oldest left: records all live as long, so the expired are the oldest.
_RESPONSES = """
local function drop(index, sizes, record)
  local size = tonumber(redis.call('HGET', sizes, record) or '0')
  redis.call('DEL', record)
  redis.call('ZREM', index, record)
  redis.call('HDEL', sizes, record)
  redis.call('HINCRBY', sizes, '~bytes', -size)
end
local function prune(index, sizes)
  while true do
    local oldest = redis.call('ZRANGE', index, 0, 0)[1]
    if not oldest or redis.call('EXISTS', oldest) == 1 then return end
    drop(index, sizes, oldest)
  end
end
"""

# KEYS: the record, its key's index, its key's sizes, the hash of every index;
# ARGV: the record's bytes, its life in ms ('' for ever), the most records
# and the most bytes a key keeps. Stores the record, then evicts the key's
# oldest until it is within both bounds again (never the record just put).
# Returns how many it evicted.
PUT_RESPONSE = (
    _RESPONSES
    + """
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('DEL', KEYS[3]) end
-- The index, the sizes and the list live as long as the longest-lived record
-- in them: a put with a shorter life (a replica with another --session-ttl)
-- never ends them under records still stored. Read before anything below
-- deletes or makes them: -2 none yet, -1 for ever.
local lives = {}
for i = 2, 4 do lives[i] = redis.call('PTTL', KEYS[i]) end
prune(KEYS[2], KEYS[3])
if redis.call('ZSCORE', KEYS[2], KEYS[1]) then drop(KEYS[2], KEYS[3], KEYS[1]) end
local seq = redis.call('HINCRBY', KEYS[3], '~seq', 1)
if ARGV[2] == '' then
  redis.call('SET', KEYS[1], ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
redis.call('ZADD', KEYS[2], seq, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], #ARGV[1])
local total = redis.call('HINCRBY', KEYS[3], '~bytes', #ARGV[1])
local evicted = 0
local count = redis.call('ZCARD', KEYS[2])
while count > 1 and (count > tonumber(ARGV[3]) or total > tonumber(ARGV[4])) do
  drop(KEYS[2], KEYS[3], redis.call('ZRANGE', KEYS[2], 0, 0)[1])
  total = tonumber(redis.call('HGET', KEYS[3], '~bytes'))
  count = count - 1
  evicted = evicted + 1
end
redis.call('HSET', KEYS[4], KEYS[2], KEYS[3])
for i = 2, 4 do
  if ARGV[2] == '' or lives[i] == -1 then
    redis.call('PERSIST', KEYS[i])
  else
    redis.call('PEXPIRE', KEYS[i], math.max(lives[i], tonumber(ARGV[2])))
  end
end
return evicted
"""
)

# KEYS: the record, its key's index, its key's sizes. Returns 1 if it was stored.
DELETE_RESPONSE = (
    _RESPONSES
    + """
local existed = redis.call('EXISTS', KEYS[1])
if redis.call('ZSCORE', KEYS[2], KEYS[1]) then
  drop(KEYS[2], KEYS[3], KEYS[1])
else
  redis.call('DEL', KEYS[1])
end
return existed
"""
)

# KEYS: the hash of every index. Drops what expired; returns {records, bytes}
# stored over every key.
RESPONSE_TOTALS = (
    _RESPONSES
    + """
local records, bytes = 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  prune(all[i], all[i + 1])
  local count = redis.call('ZCARD', all[i])
  if count == 0 then
    redis.call('DEL', all[i + 1])
    redis.call('HDEL', KEYS[1], all[i])
  else
    records = records + count
    bytes = bytes + tonumber(redis.call('HGET', all[i + 1], '~bytes') or '0')
  end
end
return {records, bytes}
"""
)
