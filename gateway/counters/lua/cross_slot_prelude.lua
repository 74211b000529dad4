-- The cross-slot form of sliding_window.lua: this replaces its line
-- ``local KEYS, ARGV, read = KEYS, ARGV, nil`` and the script runs with the flag
-- ``allow-cross-slot-keys`` (Redis 7.0 and later; cross_slot_text() in
-- gateway/counters/redis_backend.py builds it).
--
-- Why: a Redis Cluster master runs a call's declared keys of one slot only, and under a
-- gateway's load nearly every request is alone in its slot, so each was a call of its
-- own, which costs the master about 25,000 instructions before any limit is looked at
-- (benchmarks/script_instructions.py). With this flag a script may touch keys of other
-- slots the same master serves, so the requests of one pipeline to a master go in one
-- call, as they do to a single server.
--
-- KEYS     the first request's keys (one hash tag: they route the call to its master)
-- ARGV     [1] the number of requests n; [2 .. n+1] each request's limits, as the
--          script takes them; then the keys of the requests after the first, in order
--
-- Every key is read here, before anything is written: a key whose slot this master
-- does not serve (the slot moved since the gateway read its slot map) fails the whole
-- call with Redis's error reply (``... non local key ...``) and nothing is counted, so
-- the gateway sends its requests again, each to its slot's owner.
local last = #ARGV
local n = tonumber(ARGV[1])
if n == nil or n < 1 or n % 1 ~= 0 or n + 1 > last then
  return redis.error_reply('sliding_window: ARGV 1 is not the number of requests')
end
local keys, limits_of = {}, {}
for i = 1, #KEYS do
  keys[i] = KEYS[i]
end
for i = n + 2, last do
  keys[#keys + 1] = ARGV[i]
end
for r = 1, n do
  limits_of[r] = ARGV[r + 1]
end
local read = {}
for i = 1, #keys do
  local key = keys[i]
  if read[key] == nil then
    -- pcall: a value of another type (an operator's) is the script's to skip, below;
    -- any other error (a key not served here) ends the call before any write.
    local value = redis.pcall('GET', key)
    if type(value) == 'table' and value.err
        and not string.find(value.err, 'WRONGTYPE', 1, true) then
      return value
    end
    read[key] = value
  end
end
local KEYS, ARGV = keys, limits_of
nargs = n
